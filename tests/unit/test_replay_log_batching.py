"""The writer's batching (issue #32, item 4): the frames of one sync interval reach the OS in
one write, the bytes on disk are those of one frame per record whatever the policy, and
nothing the policy acknowledged is ever left in memory: a crash, a reader, a rollover, a close
or an exception with frames waiting in the buffer loses or shows only what it may."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import replay.log.writer as writer_module
from replay.errors import ReplayError
from replay.log import (
    WRITE_BUFFER_BYTES,
    FsyncPolicy,
    LogReader,
    OsFileSystem,
    ReplayLog,
    frame,
    iter_segment_frames,
    read_records,
    scan,
    segment_header,
)
from replay.log.framing import SegmentScan
from replay.records import ActivationRecord, EngineActivation, encode_record
from tests.unit.test_replay_log import rollout, segments

REPO = Path(__file__).resolve().parents[2]


class RecordingFile:
    """A real append file that also notes every operation, in order, with the bytes written."""

    def __init__(self, fs: RecordingFileSystem, path: str, fail_write: int | None) -> None:
        self._file = OsFileSystem().open_append(path)
        self._fs, self._path, self._fail_write = fs, path, fail_write

    def write(self, data: bytes | bytearray) -> None:
        self._fs.ops.append(("write", os.path.basename(self._path), bytes(data)))
        writes = sum(op[0] == "write" for op in self._fs.ops)
        if self._fail_write is not None and writes >= self._fail_write:
            self._file.write(bytes(data)[: len(data) // 2])  # the disk filled up half way
            raise OSError(28, "No space left on device")
        self._file.write(data)

    def sync(self) -> None:
        self._fs.ops.append(("sync", os.path.basename(self._path), b""))
        self._file.sync()

    def truncate(self, size: int) -> None:
        self._file.truncate(size)

    def size(self) -> int:
        return self._file.size()

    def close(self) -> None:
        name = os.path.basename(self._path)
        self._fs.ops.append(("close", name, b""))
        self._fs.closes[name] = self._fs.closes.get(name, 0) + 1
        if self._fs.closes[name] == 1:  # a real second close could hit a reused descriptor
            self._file.close()


class RecordingFileSystem(OsFileSystem):
    """The real file system; the n-th write (counted from the first, headers included) can be
    made to fail after writing half its bytes."""

    def __init__(self, fail_write: int | None = None) -> None:
        self.ops: list[tuple[str, str, bytes]] = []
        self.closes: dict[str, int] = {}  # close calls per file name
        self._fail_write = fail_write

    def open_append(self, path: str) -> RecordingFile:  # type: ignore[override]
        return RecordingFile(self, path, self._fail_write)

    def writes(self) -> list[bytes]:
        """What each write handed the OS after the first segment's header."""
        return [data for op, _, data in self.ops if op == "write"][1:]


def records_of(data: bytes) -> list[bytes]:
    """The payloads of `data`, which must hold whole frames and nothing else."""
    blob = segment_header(0) + data  # a header makes the bytes a segment the scan accepts
    found = SegmentScan(name="batch", size=len(blob))
    payloads = [bytes(payload) for _, payload in iter_segment_frames(blob, found, is_last=True,
                                                                    lenient=False)]
    assert found.valid_end == len(blob), "these bytes end inside a frame"
    return payloads


def mixed_records(count: int) -> list:
    """Records of two types and falling and rising sizes, one of them past the write buffer."""
    records: list = []
    for i in range(count):
        if i % 5 == 4:
            records.append(ActivationRecord(version=i, outcome="activated",
                                            engines=[EngineActivation("e0", 0.5, 0.01)]))
        else:
            records.append(rollout(i, n_tokens=(i * 37) % 90))
    records.append(rollout(count, n_tokens=WRITE_BUFFER_BYTES // 6))  # ~8 bytes per token
    records.append(rollout(count + 1))
    return records


# --- the bytes on disk -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", [FsyncPolicy.always(), FsyncPolicy.every(7),
                                    FsyncPolicy.every(10_000), FsyncPolicy.interval(60_000)],
                         ids=["always", "every7", "every10000", "interval"])
def test_the_bytes_on_disk_are_one_frame_per_record_whatever_the_policy(tmp_path, policy):
    records = mixed_records(23)
    with ReplayLog.open(tmp_path, fsync=policy) as log:
        for record in records:
            log.append(record)
    expected = segment_header(1) + b"".join(frame(encode_record(record)) for record in records)
    assert segments(tmp_path)[0].read_bytes() == expected


def test_the_frames_of_one_sync_interval_reach_the_os_in_one_write(tmp_path):
    fs = RecordingFileSystem()
    records = [rollout(i) for i in range(30)]
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(10), fs=fs) as log:
        for record in records:
            log.append(record)
    writes = fs.writes()
    assert [records_of(data) for data in writes] == [
        [encode_record(r) for r in records[k:k + 10]] for k in (0, 10, 20)]
    # Each batch is synced right after its write, before anything else is written.
    ops = [op for op, _, _ in fs.ops]
    assert ops == ["write", "sync"] * 4 + ["close"]  # the segment header, then three batches


def test_with_a_sync_per_record_each_record_is_its_own_write(tmp_path):
    fs = RecordingFileSystem()
    records = [rollout(i) for i in range(5)]
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.always(), fs=fs) as log:
        assert all(log.append(record).durable for record in records)
    assert [records_of(data) for data in fs.writes()] == [[encode_record(r)] for r in records]


def test_a_batch_past_the_write_buffer_goes_to_the_os_before_its_sync_in_whole_frames(tmp_path):
    fs = RecordingFileSystem()
    records = [rollout(i, n_tokens=WRITE_BUFFER_BYTES // 40) for i in range(12)]  # ~50 KiB each
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(10_000), fs=fs) as log:
        for record in records:
            log.append(record)
        unsynced = fs.writes()
        assert len(unsynced) >= 2 and all(len(data) >= WRITE_BUFFER_BYTES for data in unsynced)
        assert fs.ops[-1][0] == "write"  # written to the OS, not yet synced (nor acknowledged)
        assert log.durable_seq == 0
    # Every write ends at a frame boundary, and together they hold every record in order.
    assert [p for data in fs.writes() for p in records_of(data)] == [encode_record(r) for r in records]
    assert sum(map(len, fs.writes())) == sum(len(frame(encode_record(r))) for r in records)


# --- what waits in memory: crash, reader ------------------------------------------------------


KILLED_WITH_FRAMES_BUFFERED = textwrap.dedent('''
    import os, sys
    from replay.log import FsyncPolicy, ReplayLog
    from tests.unit.test_replay_log import rollout

    log = ReplayLog.open(sys.argv[1], fsync=FsyncPolicy.every(4))
    acks = [log.append(rollout(i)) for i in range(10)]
    print(",".join(str(int(ack.durable)) for ack in acks), flush=True)
    os._exit(0)  # as a kill -9 would: no close, no flush; the OS keeps what it was given
''')


def test_a_process_killed_with_frames_buffered_loses_exactly_the_unacknowledged_ones(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", KILLED_WITH_FRAMES_BUFFERED, str(tmp_path)],
                          check=False, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    durable = [flag == "1" for flag in done.stdout.split()[-1].split(",")]
    assert durable == [False, False, False, True] * 2 + [False, False]
    # Records 9 and 10 were in the writer's memory only: gone whole, nothing torn left behind.
    with ReplayLog.open(tmp_path) as log:
        assert log.recovered_torn_bytes == 0
    assert list(read_records(tmp_path)) == [rollout(i) for i in range(8)]


def test_a_reader_sees_no_buffered_frame_and_no_torn_tail_until_the_sync(tmp_path):
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(4)) as log:
        for i in range(3):
            assert not log.append(rollout(i)).durable
            seen = scan(tmp_path)
            assert (seen.records, seen.torn_tail_bytes, seen.corrupt_records) == ([], 0, 0)
        assert log.append(rollout(3)).durable
        assert scan(tmp_path).records == [rollout(i) for i in range(4)]


def test_a_reader_that_catches_a_batch_half_written_stops_at_its_last_whole_frame(tmp_path):
    """A read(2) racing the write(2) of a batch may see any prefix of it: the reader must take it
    for a torn tail (never corruption) and return exactly the whole records before the cut."""
    records = [rollout(i, n_tokens=1 + i % 4) for i in range(9)]
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(5)) as log:
        acks = [log.append(record) for record in records]  # batches: 5, then 4 at close
    data = segments(tmp_path)[0].read_bytes()
    starts = [ack.offset for ack in acks] + [len(data)]
    payloads = [encode_record(record) for record in records]
    for cut in range(starts[5], len(data) + 1):
        # What a reader does with the newest segment's bytes; strict: it would raise on
        # anything it took for corruption.
        found = SegmentScan(name="00000001.seg", size=cut, index=1)
        seen = [bytes(p) for _, p in iter_segment_frames(data[:cut], found, is_last=True,
                                                         lenient=False)]
        whole = sum(1 for end in starts[6:] if end <= cut)
        assert seen == payloads[:5 + whole], cut
        assert found.torn_tail_bytes == cut - starts[5 + whole], cut


# --- rollover, close -------------------------------------------------------------------------


def test_a_rollover_writes_and_syncs_the_pending_batch_in_the_old_segment_first(tmp_path):
    fs = RecordingFileSystem()
    records = [rollout(i, n_tokens=20) for i in range(30)]
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(10_000), segment_bytes=1024, fs=fs) as log:
        acks, durable_after = [], []
        for record in records:
            acks.append(log.append(record))
            durable_after.append(log.durable_seq)
    located = [(r.segment, r.offset) for r in LogReader(tmp_path).located()]
    assert located == [(ack.segment, ack.offset) for ack in acks]
    for before, ack, durable in zip(acks, acks[1:], durable_after[1:], strict=False):
        if ack.segment != before.segment:  # this append started a new segment
            assert durable == ack.seq - 1  # everything before it was synced first
    # In the file operations: a segment's last write is synced and closed before the next opens.
    names = [name for _, name, _ in fs.ops]
    for name in sorted(set(names))[:-1]:
        last = max(i for i, n in enumerate(names) if n == name)
        assert [op for op, _, _ in fs.ops[last - 2:last + 1]] == ["write", "sync", "close"], name


def test_close_writes_and_syncs_what_is_buffered(tmp_path):
    fs = RecordingFileSystem()
    log = ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(10_000), fs=fs)
    records = [rollout(i) for i in range(5)]
    for record in records:
        assert not log.append(record).durable
    assert fs.writes() == []
    log.close()
    assert [op for op, _, _ in fs.ops[-3:]] == ["write", "sync", "close"]
    assert records_of(fs.writes()[0]) == [encode_record(r) for r in records]
    assert log.durable_seq == 5


# --- exceptions ------------------------------------------------------------------------------


def test_an_interruption_while_a_frame_goes_into_the_buffer_leaves_no_trace(tmp_path, monkeypatch):
    """A KeyboardInterrupt landing after a frame's first bytes were buffered: the append fails,
    the log goes on, and no partial frame reaches the disk between whole ones."""
    real = writer_module._pack_header_crc
    calls = []

    def interrupted_once(value: int) -> bytes:
        calls.append(value)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(value)

    monkeypatch.setattr(writer_module, "_pack_header_crc", interrupted_once)
    records = [rollout(i) for i in range(6)]
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(100)) as log:
        acks = []
        for i, record in enumerate(records):
            if i == 2:
                with pytest.raises(KeyboardInterrupt):
                    log.append(record)
            else:
                acks.append(log.append(record))
    kept = records[:2] + records[3:]
    assert list(read_records(tmp_path)) == kept  # strict: a torn frame inside would raise
    located = [(r.segment, r.offset) for r in LogReader(tmp_path).located()]
    assert located == [(ack.segment, ack.offset) for ack in acks]


def test_a_write_that_fails_half_way_costs_no_acknowledged_record(tmp_path):
    fs = RecordingFileSystem(fail_write=3)  # the header, one batch, then half of the next
    records = [rollout(i) for i in range(12)]
    log = ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(3), fs=fs)
    acknowledged = 0
    with pytest.raises(ReplayError, match="No space left"):
        for record in records:
            ack = log.append(record)
            acknowledged = ack.seq if ack.durable else acknowledged
    assert acknowledged == 3
    # The file's state is unknown now: the log refuses everything until it is reopened.
    with pytest.raises(ReplayError, match="must be reopened"):
        log.append(records[-1])
    with pytest.raises(ReplayError, match="must be reopened"):
        log.flush()
    log.close()
    with ReplayLog.open(tmp_path) as reopened:
        assert reopened.recovered_torn_bytes > 0  # the half batch's cut frame
        reopened.append(rollout(99))
    survivors = list(read_records(tmp_path))
    # Whole records in order, every acknowledged one among them (a whole frame of the half
    # batch may survive too: it was never acknowledged, nor promised lost), then the new one.
    assert survivors[-1] == rollout(99)
    assert len(survivors) - 1 >= acknowledged
    assert survivors[:-1] == records[:len(survivors) - 1]


def test_a_rollover_that_fails_closes_each_file_once(tmp_path):
    """The old segment is closed by the rollover; the new one, whose header could not be
    written, is not kept open. Closing the log afterwards closes neither again (a second
    os.close could hit a descriptor the process has since reused for another file)."""
    fs = RecordingFileSystem(fail_write=3)  # segment 1's header, its batch, segment 2's header
    log = ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(10_000), segment_bytes=1024, fs=fs)
    appended = 0
    with pytest.raises(ReplayError, match="No space left"):
        for i in range(30):
            log.append(rollout(i, n_tokens=20))
            appended += 1
    log.close()
    assert fs.closes == {"00000001.seg": 1, "00000002.seg": 1}
    with ReplayLog.open(tmp_path) as reopened:  # the half header of segment 2: started again
        assert reopened.recovered_torn_bytes > 0
        reopened.append(rollout(99))
    expected = [rollout(i, n_tokens=20) for i in range(appended)] + [rollout(99)]
    assert list(read_records(tmp_path)) == expected
