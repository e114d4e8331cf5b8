"""The replay log on the real file system: framing, rollover, fsync policy, recovery."""

from __future__ import annotations

import os
import random
import struct
import threading
from pathlib import Path

import crc32c
import msgspec
import pytest

from replay.errors import (
    CorruptRecordError,
    InvalidRecordError,
    LogNotFoundError,
    ReplayError,
)
from replay.log import (
    FRAME_HEADER,
    SEGMENT_HEADER,
    FsyncPolicy,
    LogReader,
    ReplayLog,
    frame,
    read_records,
    scan,
)
from replay.records import (
    ActivationRecord,
    ConsumptionRecord,
    EngineActivation,
    PolicyIdentity,
    RolloutRecord,
    RunMetaRecord,
    Timings,
)

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

IDENTITY = PolicyIdentity("ckpt", "tok-hash", "tmpl-hash", "bf16")


def rollout(i: int, n_tokens: int = 6) -> RolloutRecord:
    return RolloutRecord.from_lists(
        rollout_id=i, group_id=i // 2, prompt_id=f"p{i}", engine_id="e0",
        prompt_token_ids=[1, 2, 3], completion_token_ids=[i % 100 + t for t in range(n_tokens)],
        completion_logprobs=[-0.5] * n_tokens, dispatched_version=i,
        identity=IDENTITY, timings=Timings(1.0, 1.5, 2.0), rewards={"score": float(i)},
    )


def write_log(run_dir: Path, records: list, **options) -> list:
    with ReplayLog.open(run_dir, **options) as log:
        return [log.append(record) for record in records]


def segments(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "replay").glob("*.seg"))


def test_records_of_every_type_read_back_in_order(tmp_path):
    records = [
        RunMetaRecord(run_id="r1", created_at=0.0, identity=IDENTITY, config={"lr": 1e-6}),
        rollout(0),
        ActivationRecord(version=1, outcome="activated", engines=[EngineActivation("e0", 0.2, 0.01)]),
        rollout(1),
        ConsumptionRecord(step=1, rollout_ids=[0, 1]),
    ]
    acks = write_log(tmp_path, records)
    assert list(read_records(tmp_path)) == records
    assert [ack.seq for ack in acks] == [1, 2, 3, 4, 5]
    assert all(ack.durable for ack in acks)
    offsets = [ack.offset for ack in acks]
    assert offsets[0] == SEGMENT_HEADER.size and offsets == sorted(offsets)


def test_reader_accepts_the_log_directory_itself_and_names_a_missing_log(tmp_path):
    write_log(tmp_path, [rollout(0)])
    assert list(read_records(tmp_path / "replay")) == [rollout(0)]
    with pytest.raises(LogNotFoundError, match="no replay log"):
        list(read_records(tmp_path / "elsewhere"))


def test_segments_roll_over_at_the_size_limit(tmp_path):
    records = [rollout(i, n_tokens=20) for i in range(30)]
    acks = write_log(tmp_path, records, segment_bytes=1024)
    files = segments(tmp_path)
    assert len(files) > 3
    assert all(f.stat().st_size <= 1024 for f in files)
    assert {ack.segment for ack in acks} == {f.name for f in files}
    assert list(read_records(tmp_path)) == records


def test_every_n_policy_acknowledges_on_the_nth_append_and_on_flush(tmp_path):
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(3)) as log:
        acks = [log.append(rollout(i)) for i in range(4)]
        assert [ack.durable for ack in acks] == [False, False, True, False]
        assert log.durable_seq == 3
        log.flush()
        assert log.durable_seq == 4
        assert log.wait_durable(acks[3], timeout=0)


def test_interval_policy_makes_a_quiet_log_durable_in_the_background(tmp_path):
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.interval(5)) as log:
        ack = log.append(rollout(0))
        assert log.wait_durable(ack, timeout=30)
        assert log.durable_seq == 1


def test_fsync_policy_refuses_nonsense():
    with pytest.raises(ValueError, match="every_records"):
        FsyncPolicy(every_records=0)
    with pytest.raises(ValueError, match="needs"):
        FsyncPolicy(every_records=None, every_ms=None)


def test_appending_from_many_threads_loses_and_mixes_nothing(tmp_path):
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(7), segment_bytes=4096) as log:
        acks: list = []

        def worker(first: int) -> None:
            for i in range(first, first + 100):
                acks.append(log.append(rollout(i)))

        threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    ids = sorted(r.rollout_id for r in read_records(tmp_path))
    assert ids == sorted(k * 1000 + i for k in range(4) for i in range(100))
    assert len({(a.segment, a.offset) for a in acks}) == 400
    assert sorted(a.seq for a in acks) == list(range(1, 401))


def test_a_refused_record_writes_nothing(tmp_path):
    with ReplayLog.open(tmp_path) as log:
        log.append(rollout(0))
        size = segments(tmp_path)[0].stat().st_size
        with pytest.raises(InvalidRecordError, match="rollout_id"):
            log.append(msgspec.structs.replace(rollout(1), rollout_id="one"))
        assert segments(tmp_path)[0].stat().st_size == size
        log.append(rollout(2))
    assert [r.rollout_id for r in read_records(tmp_path)] == [0, 2]


def test_a_second_writer_is_refused_until_the_first_closes(tmp_path):
    first = ReplayLog.open(tmp_path)
    with pytest.raises(ReplayError, match="another process"):
        ReplayLog.open(tmp_path)
    first.append(rollout(0))
    first.close()
    with ReplayLog.open(tmp_path) as second:
        second.append(rollout(1))
    assert [r.rollout_id for r in read_records(tmp_path)] == [0, 1]


def test_a_closed_log_refuses_appends(tmp_path):
    log = ReplayLog.open(tmp_path)
    log.close()
    log.close()
    with pytest.raises(ReplayError, match="closed"):
        log.append(rollout(0))


# --- torn tails ------------------------------------------------------------------------------


def test_last_record_cut_at_every_byte_offset(tmp_path):
    source = tmp_path / "source"
    records = [rollout(0), rollout(1), rollout(2, n_tokens=3)]
    acks = write_log(source, records)
    data = segments(source)[0].read_bytes()
    last_start = acks[-1].offset
    for cut in range(last_start, len(data)):
        run_dir = tmp_path / f"cut{cut}"
        (run_dir / "replay").mkdir(parents=True)
        (run_dir / "replay" / "00000001.seg").write_bytes(data[:cut])
        assert list(read_records(run_dir)) == records[:2], cut
        with ReplayLog.open(run_dir) as log:
            assert log.recovered_torn_bytes == cut - last_start
            log.append(rollout(9))
        assert list(read_records(run_dir)) == records[:2] + [rollout(9)], cut


@pytest.mark.parametrize("tail", ["zeros", "random", "huge_length", "impossible_length",
                                  "partial_header"])
def test_garbage_tails_are_cut_as_torn(tmp_path, tail):
    records = [rollout(0), rollout(1)]
    write_log(tmp_path, records)
    path = segments(tmp_path)[0]
    good_size = path.stat().st_size
    rng = random.Random(7)
    garbage = {
        "zeros": bytes(4096),
        "random": rng.randbytes(4096),
        # a well-formed header whose length runs far past the end of the file
        "huge_length": _header_claiming(2**31),
        # a length beyond MAX_RECORD_BYTES: judged (and refused) without allocating it
        "impossible_length": _header_claiming(2**32 - 1) + b"x" * 100,
        "partial_header": frame(b"\x90")[:9],
    }[tail]
    with path.open("ab") as f:
        f.write(garbage)
    result = scan(tmp_path)
    assert result.records == records
    assert result.torn_tail_bytes == len(garbage)
    assert result.corrupt_records == 0
    with ReplayLog.open(tmp_path) as log:
        assert path.stat().st_size == good_size
        log.append(rollout(5))
    assert list(read_records(tmp_path)) == records + [rollout(5)]


def _header_claiming(length: int) -> bytes:
    prefix = struct.pack("<4sII", b"\xf1RPL", length, 0)
    return prefix + crc32c.crc32c(prefix).to_bytes(4, "little")


def test_a_segment_cut_inside_its_header_starts_again(tmp_path):
    write_log(tmp_path, [rollout(0)], segment_bytes=200)
    write_log(tmp_path, [rollout(1)], segment_bytes=200)
    last = segments(tmp_path)[-1]
    last.write_bytes(last.read_bytes()[:5])
    assert list(read_records(tmp_path)) == [rollout(0)]
    write_log(tmp_path, [rollout(2)], segment_bytes=200)
    assert list(read_records(tmp_path)) == [rollout(0), rollout(2)]


# --- corruption before the tail --------------------------------------------------------------


def test_one_flipped_byte_in_an_earlier_record_is_reported_at_its_offset(tmp_path):
    source = tmp_path / "source"
    records = [rollout(0), rollout(1), rollout(2)]
    acks = write_log(source, records)
    data = segments(source)[0].read_bytes()
    start, end = acks[1].offset, acks[2].offset
    for position in range(start, end):
        run_dir = tmp_path / f"flip{position}"
        (run_dir / "replay").mkdir(parents=True)
        corrupted = bytearray(data)
        corrupted[position] ^= 0x5A
        (run_dir / "replay" / "00000001.seg").write_bytes(bytes(corrupted))

        with pytest.raises(CorruptRecordError) as raised:
            list(read_records(run_dir))
        assert (raised.value.segment, raised.value.offset) == ("00000001.seg", start)
        assert f"00000001.seg at byte offset {start}" in str(raised.value)
        lenient = scan(run_dir, lenient=True)
        assert lenient.records == [records[0], records[2]]
        assert lenient.corrupt_records == 1
        with pytest.raises(CorruptRecordError):
            ReplayLog.open(run_dir)


def test_strict_reading_yields_nothing_corrupt_before_failing(tmp_path):
    acks = write_log(tmp_path, [rollout(i) for i in range(4)])
    path = segments(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[acks[2].offset + FRAME_HEADER.size + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    seen = []
    with pytest.raises(CorruptRecordError):
        for record in read_records(tmp_path):
            seen.append(record)
    assert seen == [rollout(0), rollout(1)]


def test_lenient_writer_reopens_after_corruption_and_keeps_appending(tmp_path):
    acks = write_log(tmp_path, [rollout(i) for i in range(3)])
    path = segments(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[acks[0].offset + FRAME_HEADER.size] ^= 0x01
    path.write_bytes(bytes(data))
    with ReplayLog.open(tmp_path, lenient=True) as log:
        log.append(rollout(7))
    result = scan(tmp_path, lenient=True)
    assert [r.rollout_id for r in result.records] == [1, 2, 7]
    assert result.corrupt_records == 1


def test_a_bad_tail_in_an_older_segment_is_corruption_not_a_torn_tail(tmp_path):
    write_log(tmp_path, [rollout(i, n_tokens=20) for i in range(6)], segment_bytes=600)
    first = segments(tmp_path)[0]
    size = first.stat().st_size
    with first.open("r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CorruptRecordError) as raised:
        list(read_records(tmp_path))
    assert raised.value.segment == first.name
    assert scan(tmp_path, lenient=True).corrupt_records == 1


def test_a_bad_segment_header_before_valid_records_is_corruption(tmp_path):
    write_log(tmp_path, [rollout(0), rollout(1)])
    path = segments(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[0:8] = b"NOTALOG!"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match="offset 0"):
        list(read_records(tmp_path))
    assert scan(tmp_path, lenient=True).records == [rollout(0), rollout(1)]


# --- invalid records that pass their checksum ------------------------------------------------


def _append_raw_payload(run_dir: Path, payload: bytes) -> int:
    path = segments(run_dir)[-1]
    offset = path.stat().st_size
    with path.open("ab") as f:
        f.write(frame(payload))
    return offset


@pytest.mark.parametrize("change, field", [
    ({"rollout_id": "seven"}, "rollout_id"),
    ({"completion_logprobs": struct.pack("<6f", -1, -1, float("nan"), -1, -1, -1)},
     "completion_logprobs"),
    ({"completion_logprobs": struct.pack("<5f", -1, -1, -1, -1, -1)}, "completion_logprobs"),
    ({"version_starts": struct.pack("<2i", 0, 3), "version_values": struct.pack("<2i", 9, 4)},
     "version_values"),
])
def test_invalid_records_are_refused_strictly_and_counted_leniently(tmp_path, change, field):
    write_log(tmp_path, [rollout(0)])
    bad = _with_bytes(msgspec.to_builtins(rollout(4)) | change, change)
    offset = _append_raw_payload(tmp_path, msgspec.msgpack.encode(bad))
    write_log(tmp_path, [rollout(1)])
    with pytest.raises(InvalidRecordError) as raised:
        list(read_records(tmp_path))
    assert raised.value.field == field
    assert raised.value.offset == offset and raised.value.segment == "00000001.seg"
    reader = LogReader(tmp_path, lenient=True)
    assert list(reader) == [rollout(0), rollout(1)]
    assert reader.invalid_records == 1 and reader.corrupt_records == 0


def _with_bytes(builtins: dict, change: dict) -> dict:
    """to_builtins turned blobs into base64 text; put the real bytes back."""
    record = rollout(4)
    for name in ("prompt_token_ids", "completion_token_ids", "completion_logprobs",
                 "version_starts", "version_values", "environment_spans"):
        builtins[name] = change.get(name, getattr(record, name))
    return builtins


def test_reading_a_log_written_elsewhere_is_not_disturbed_by_a_stale_temp_file(tmp_path):
    write_log(tmp_path, [rollout(0)])
    (tmp_path / "replay" / "notes.txt").write_text("not a segment")
    (tmp_path / "replay" / "00000009.seg.tmp").write_bytes(b"junk")
    assert list(read_records(tmp_path)) == [rollout(0)]
    assert sorted(os.listdir(tmp_path / "replay"))[0] == "00000001.seg"
