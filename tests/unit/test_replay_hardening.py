"""Hardening of reading (issue #11): sidecars cannot give wrong statistics silently, a missing
segment is corruption, and a reader survives a writer cutting a torn tail under it."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import crc32c
import pytest

from replay.errors import CorruptRecordError
from replay.log import FRAME_HEADER, SEGMENT_HEADER, LogReader, read_records, scan
from replay.query import SIDECAR_SUFFIX, fromlog, stats_from_log, summarize_segment
from replay.query.sidecars import SIDECAR_HEADER
from tests.unit.test_replay_cli import run_cli
from tests.unit.test_replay_log import rollout, write_log
from tests.unit.test_replay_query import generate_log

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_dir(tmp_path) -> Path:
    generate_log(tmp_path)
    return tmp_path


@pytest.fixture
def scans(monkeypatch) -> list[int]:
    """Counts segments summarized by scanning (not read from a sidecar)."""
    calls: list[int] = []
    summarize = fromlog.summarize_segment

    def counting(records):
        calls.append(1)
        return summarize(records)

    monkeypatch.setattr(fromlog, "summarize_segment", counting)
    return calls


def segments(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "replay").glob("*.seg"))


def sidecars(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "replay").glob(f"*{SIDECAR_SUFFIX}"))


def without_log(stats: dict) -> str:
    return json.dumps({k: v for k, v in stats.items() if k != "log"})


# --- 11. sidecars ----------------------------------------------------------------------------


def test_a_frame_header_rewritten_with_its_crc_recomputed_is_reported_despite_a_sidecar(run_dir):
    stats_from_log(run_dir)  # writes the sidecars
    first = segments(run_dir)[0]
    data = bytearray(first.read_bytes())
    offset = SEGMENT_HEADER.size  # the first frame
    prefix = struct.pack("<4sII", b"\xf1RPL", 0xFFFFFFFF, struct.unpack_from("<I", data, offset + 8)[0])
    data[offset:offset + FRAME_HEADER.size] = prefix + crc32c.crc32c(prefix).to_bytes(4, "little")
    # A block followed by its own CRC32C: the CRC32C of the whole segment does not change.
    assert crc32c.crc32c(bytes(data)) == crc32c.crc32c(first.read_bytes())
    first.write_bytes(bytes(data))

    for verify in (False, True):
        with pytest.raises(CorruptRecordError) as raised:
            stats_from_log(run_dir, sidecars=not verify)
        assert (raised.value.segment, raised.value.offset) == (first.name, offset)
        assert "impossible length" in raised.value.reason
    assert run_cli(["stats", str(run_dir), "--json"]) == 2
    lenient = stats_from_log(run_dir, lenient=True)
    assert lenient["log"]["corrupt_records"] == 1
    assert without_log(lenient) == without_log(stats_from_log(run_dir, lenient=True, sidecars=False))


def test_a_flipped_bit_in_a_sidecar_column_falls_back_to_a_scan(run_dir, scans):
    expected = stats_from_log(run_dir, sidecars=False)
    stats_from_log(run_dir)
    first = segments(run_dir)[0]
    column = summarize_segment(LogReader(run_dir).segment_records(first.name, False)).columns["dispatched"]
    sidecar = next(p for p in sidecars(run_dir) if p.name.startswith(first.name))
    blob = bytearray(sidecar.read_bytes())
    at = blob.find(column)
    assert at > 0
    blob[at] ^= 0x04  # the first rollout's dispatched version, off by 4
    sidecar.write_bytes(bytes(blob))
    scanned = len(scans)
    assert without_log(stats_from_log(run_dir)) == without_log(expected)
    assert len(scans) == scanned + 1  # that segment, and only it, was scanned again
    assert stats_from_log(run_dir)["log"] == expected["log"]  # and its sidecar rewritten


@pytest.mark.parametrize("damage", ["format", "schema", "truncated", "garbage", "empty"])
def test_a_sidecar_of_another_format_or_a_broken_one_is_ignored(run_dir, scans, damage):
    expected = stats_from_log(run_dir)
    n_segments = len(segments(run_dir))
    for path in sidecars(run_dir):
        blob = bytearray(path.read_bytes())
        if damage == "format":
            struct.pack_into("<H", blob, 8, 99)
        elif damage == "schema":
            struct.pack_into("<I", blob, 16, 12345)
        elif damage == "truncated":
            del blob[-3:]
        elif damage == "garbage":
            blob[:SIDECAR_HEADER.size] = os.urandom(SIDECAR_HEADER.size)
        else:
            blob = bytearray()
        path.write_bytes(bytes(blob))
    assert stats_from_log(run_dir) == expected
    assert len(scans) == 2 * n_segments  # every damaged sidecar ignored, every segment scanned


def test_a_sidecar_of_the_previous_format_is_ignored_and_replaced(run_dir, scans):
    import msgspec

    expected = stats_from_log(run_dir, sidecars=False)
    for path in sidecars(run_dir):
        path.unlink()
    first = segments(run_dir)[0]
    data = first.read_bytes()
    old = msgspec.msgpack.encode([1, {}, [], [], [], [], 1])  # format-1 layout, named by CRC32C
    (first.parent / f"{first.name}.{len(data)}.{crc32c.crc32c(data):08x}.cols").write_bytes(old)
    before = len(scans)
    assert stats_from_log(run_dir) == expected
    assert len(scans) == before + len(segments(run_dir))
    assert len([p for p in sidecars(run_dir) if p.name.startswith(first.name)]) == 1


# --- 12. missing segments --------------------------------------------------------------------


@pytest.fixture
def three_segments(tmp_path) -> tuple[Path, list]:
    records = [rollout(i, n_tokens=20) for i in range(9)]
    from replay.records import encode_record

    frame = FRAME_HEADER.size + len(encode_record(records[0]))
    acks = write_log(tmp_path, records, segment_bytes=SEGMENT_HEADER.size + 3 * frame + frame // 2)  # three per segment
    assert len(segments(tmp_path)) == 3
    return tmp_path, [(ack.segment, record) for ack, record in zip(acks, records)]


@pytest.mark.parametrize("with_sidecars", [False, True])
def test_a_deleted_middle_segment_is_corruption(three_segments, capsys, with_sidecars):
    run_dir, placed = three_segments
    if with_sidecars:
        stats_from_log(run_dir)
    (run_dir / "replay" / "00000002.seg").unlink()
    kept = [record for segment, record in placed if segment != "00000002.seg"]

    with pytest.raises(CorruptRecordError) as raised:
        stats_from_log(run_dir)
    assert raised.value.segment == "00000002.seg"
    assert "00000002.seg" in str(raised.value) and "missing" in str(raised.value)
    with pytest.raises(CorruptRecordError, match="00000002.seg"):
        list(read_records(run_dir))
    assert run_cli(["stats", str(run_dir), "--json"]) == 2
    assert "segment 00000002.seg" in capsys.readouterr().err

    lenient = stats_from_log(run_dir, lenient=True)
    assert lenient["log"]["missing_segments"] == 1 and lenient["log"]["corrupt_records"] == 0
    assert lenient["rollouts"]["total"] == len(kept)
    result = scan(run_dir, lenient=True)
    assert result.records == kept and result.missing_segments == 1
    capsys.readouterr()  # (log lines of the calls above)
    assert run_cli(["stats", str(run_dir), "--json", "--lenient"]) == 0
    assert json.loads(capsys.readouterr().out)["log"]["missing_segments"] == 1


def test_deleted_first_segments_are_missing_too(three_segments):
    run_dir, _ = three_segments
    (run_dir / "replay" / "00000001.seg").unlink()
    with pytest.raises(CorruptRecordError) as raised:
        list(read_records(run_dir))
    assert raised.value.segment == "00000001.seg"
    assert scan(run_dir, lenient=True).missing_segments == 1


def test_a_segment_renamed_into_a_gap_is_caught_by_its_header_index(three_segments):
    run_dir, placed = three_segments
    log_dir = run_dir / "replay"
    (log_dir / "00000002.seg").unlink()
    (log_dir / "00000003.seg").rename(log_dir / "00000002.seg")
    with pytest.raises(CorruptRecordError) as raised:
        stats_from_log(run_dir)
    assert (raised.value.segment, raised.value.offset) == ("00000002.seg", 0)
    assert "index 3" in raised.value.reason
    result = scan(run_dir, lenient=True)
    assert result.corrupt_records == 1  # counted, and its records still read
    assert result.records == [record for segment, record in placed if segment != "00000002.seg"]


# --- 13. a writer cutting a torn tail while a reader reads -----------------------------------


READER_UNDER_A_CUT = textwrap.dedent('''
    import sys, threading
    from replay.log import LogReader, ReplayLog
    from replay.records import PolicyIdentity, RolloutRecord, Timings

    run_dir, path = sys.argv[1], sys.argv[2]
    reader = iter(LogReader(run_dir))
    first = next(reader)  # the reader has the segment open now
    # The writer reopens: it cuts the 1 MiB torn tail off the file the reader is reading.
    cutter = threading.Thread(target=lambda: ReplayLog.open(run_dir).close())
    cutter.start()
    cutter.join()
    import os
    assert os.path.getsize(path) < 2**20, os.path.getsize(path)
    print(1 + sum(1 for _ in reader))
''')


def test_a_reader_survives_a_writer_cutting_the_tail_under_it(tmp_path):
    write_log(tmp_path, [rollout(i, n_tokens=500) for i in range(40)])
    path = segments(tmp_path)[0]
    with path.open("ab") as f:
        f.write(os.urandom(2**20))  # a torn tail of many pages
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", READER_UNDER_A_CUT, str(tmp_path), str(path)], check=False,
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode != -7, "the reader died of SIGBUS"
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "40"  # every record (log lines go to stdout first)
