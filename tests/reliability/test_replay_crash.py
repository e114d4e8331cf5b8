"""Crash safety of the replay log against a file layer that loses unsynced bytes.

`CrashingFileSystem` is a fault injector, not a mock: it keeps, per file, what the process
sees and what a sync made durable, can crash in the middle of any write/sync/truncate, and
after a crash produces the state a disk could hold: the durable bytes, plus any prefix of the
unsynced ones, possibly followed by zeros or garbage where the file system had extended the
file; file names not made durable by a directory sync may vanish.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.log import FsyncPolicy, ReplayLog, read_records
from replay.records import (
    ActivationRecord,
    Completed,
    Dropped,
    EngineActivation,
    PolicyIdentity,
    RolloutRecord,
    Timings,
)

IDENTITY = PolicyIdentity("ckpt", "tok-hash", "tmpl-hash", "bf16")


class Crash(BaseException):
    """The simulated power cut (a BaseException, so no error handler in the log swallows it)."""


@dataclass
class FakeFile:
    data: bytearray = field(default_factory=bytearray)  # what the process sees
    synced: bytes = b""  # what survives a crash for sure


class FakeHandle:
    def __init__(self, fs: CrashingFileSystem, path: str) -> None:
        self.fs, self.path = fs, path

    @property
    def file(self) -> FakeFile:
        return self.fs.files[self.path]

    def write(self, data: bytes) -> None:
        if self.fs.tick():
            cut = self.fs.rng.randrange(len(data) + 1)  # part of the write reached the file
            self.file.data += data[:cut]
            raise Crash
        self.file.data += data

    def sync(self) -> None:
        if self.fs.tick():
            raise Crash
        self.file.synced = bytes(self.file.data)

    def truncate(self, size: int) -> None:
        if self.fs.tick():
            raise Crash
        del self.file.data[size:]

    def size(self) -> int:
        return len(self.file.data)

    def close(self) -> None:
        pass


class CrashingFileSystem:
    def __init__(self, rng: random.Random, crash_at: int | None = None) -> None:
        self.rng = rng
        self.crash_at = crash_at  # the operation number that crashes (None: never)
        self.operations = 0
        self.files: dict[str, FakeFile] = {}
        self.durable_names: set[str] = set()
        self.dirs: set[str] = set()

    def tick(self) -> bool:
        self.operations += 1
        return self.crash_at is not None and self.operations >= self.crash_at

    # FileSystem protocol
    def list_dir(self, path: str) -> list[str]:
        return [os.path.basename(p) for p in self.files if os.path.dirname(p) == path]

    def make_dirs(self, path: str) -> None:
        self.dirs.add(path)

    def is_dir(self, path: str) -> bool:
        return path in self.dirs

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.files[path].data)

    def open_append(self, path: str) -> FakeHandle:
        self.files.setdefault(path, FakeFile())
        return FakeHandle(self, path)

    def lock(self, path: str):
        return lambda: None  # one writer at a time is the test's own discipline

    def sync_dir(self, path: str) -> None:
        if self.tick():
            raise Crash
        self.durable_names |= {p for p in self.files if os.path.dirname(p) == path}

    def after_crash(self) -> CrashingFileSystem:
        """What a disk may hold after the power came back."""
        survivor = CrashingFileSystem(self.rng)
        survivor.dirs = set(self.dirs)
        for path, file in self.files.items():
            if path not in self.durable_names and self.rng.random() < 0.5:
                continue  # a name that was never synced into its directory is gone
            content = self._surviving_bytes(file)
            survivor.files[path] = FakeFile(bytearray(content), content)
            survivor.durable_names.add(path)
        return survivor

    def _surviving_bytes(self, file: FakeFile) -> bytes:
        data, synced = bytes(file.data), file.synced
        if not data.startswith(synced):  # an unsynced truncation may or may not have landed
            return synced if self.rng.random() < 0.5 else data
        unsynced = data[len(synced):]
        kept = unsynced[: self.rng.randrange(len(unsynced) + 1)]
        lost = len(unsynced) - len(kept)
        tail = self.rng.choice(["none", "zeros", "garbage"])
        if tail == "zeros":
            kept += bytes(lost)
        elif tail == "garbage":
            kept += self.rng.randbytes(lost)
        return synced + kept


def make_record(index: int, n_tokens: int) -> RolloutRecord | ActivationRecord:
    if index % 7 == 6:
        return ActivationRecord(version=index, outcome="activated",
                                engines=[EngineActivation("e0", 0.5, 0.01)])
    half = n_tokens // 2
    return RolloutRecord.from_lists(
        rollout_id=index, group_id=index // 4, prompt_id=f"p{index}", engine_id=f"e{index % 2}",
        prompt_token_ids=list(range(index % 5 + 1)),
        completion_token_ids=[(index * 31 + t) % 1000 for t in range(n_tokens)],
        completion_logprobs=[-0.25 * (t % 4) for t in range(n_tokens)],
        dispatched_version=index,
        token_versions=[index] * half + [index + 1] * (n_tokens - half),
        status=Completed() if n_tokens else Dropped("stale"),
        identity=IDENTITY, timings=Timings(float(index), None, float(index) + 1),
    )


@dataclass
class Appender:
    """Drives a log and remembers what it acknowledged."""

    log: ReplayLog
    written: list = field(default_factory=list)  # every record append() was called with
    acknowledged: int = 0  # a prefix length: durability is in append order

    def append(self, record: object) -> None:
        self.written.append(record)
        ack = self.log.append(record)  # type: ignore[arg-type]
        if ack.durable:
            self.acknowledged = ack.seq  # seq counts appends since open: all up to it are synced

    def flush(self) -> None:
        self.log.flush()
        self.acknowledged = len(self.written)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    every=st.sampled_from([1, 2, 5]),
    segment_bytes=st.sampled_from([300, 1200, 1 << 20]),
    crash_at=st.integers(1, 250),
    flush_at=st.sets(st.integers(0, 29), max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_acknowledged_records_survive_any_crash(sizes, every, segment_bytes, crash_at, flush_at, seed):
    rng = random.Random(seed)
    fs = CrashingFileSystem(rng, crash_at=crash_at)
    records = [make_record(i, n) for i, n in enumerate(sizes)]
    appender: Appender | None = None
    try:
        appender = Appender(ReplayLog.open("/run", fsync=FsyncPolicy.every(every),
                                           segment_bytes=segment_bytes, fs=fs))
        for i, record in enumerate(records):
            appender.append(record)
            if i in flush_at:
                appender.flush()
    except Crash:
        pass
    # Crash now (if the injected crash did not come first): unsynced bytes are at risk.
    written = appender.written if appender else []
    acknowledged = appender.acknowledged if appender else 0
    disk = fs.after_crash()

    with ReplayLog.open("/run", fsync=FsyncPolicy.always(), segment_bytes=segment_bytes, fs=disk) as log:
        survivors = list(read_records("/run", fs=disk))
        # Only whole, unaltered records, in order, and every acknowledged one among them.
        assert survivors == written[: len(survivors)]
        assert len(survivors) >= acknowledged
        extra = [make_record(1000 + i, 3) for i in range(3)]
        for record in extra:
            assert log.append(record).durable
    assert list(read_records("/run", fs=disk)) == survivors + extra


def test_fault_injector_really_loses_unsynced_bytes():
    """Guards the property test above against a fault injector that never injects faults."""
    lost_any = False
    for seed in range(20):
        fs = CrashingFileSystem(random.Random(seed))
        with_log = ReplayLog.open("/run", fsync=FsyncPolicy.every(1000), fs=fs)
        for i in range(5):
            assert not with_log.append(make_record(i, 10)).durable
        disk = fs.after_crash()
        ReplayLog.open("/run", fs=disk).close()
        lost_any |= len(list(read_records("/run", fs=disk))) < 5
    assert lost_any
