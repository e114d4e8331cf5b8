"""Reading the replay log: segments in order, every frame verified and every record decoded
and validated; corruption, invalid records, unknown record types and missing segments are
raised (strict) or counted (lenient)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import msgspec
import structlog

from replay.errors import (
    CorruptRecordError,
    InvalidRecordError,
    LogNotFoundError,
    UnknownRecordTypeError,
)
from replay.log.files import FileSystem, OsFileSystem
from replay.log.framing import (
    LOG_SUBDIR,
    SEGMENT_SUFFIX,
    SegmentScan,
    _release_map,
    iter_segment_frames,
    segment_name,
)
from replay.records import Record, decode_record

log = structlog.get_logger("replay.log")

def resolve_log_dir(path: str | os.PathLike[str], fs: FileSystem | None = None) -> str:
    """The directory holding the segments: RUN_DIR/replay, or the path itself."""
    fs = fs or OsFileSystem()
    path = os.fspath(path)
    nested = os.path.join(path, LOG_SUBDIR)
    if fs.is_dir(nested):
        return nested
    if fs.is_dir(path) and _segment_indices(fs, path):
        return path
    raise LogNotFoundError(f"no replay log in {path} (expected {nested}/*{SEGMENT_SUFFIX})")


def _index_of(name: str) -> int | None:
    stem, suffix = os.path.splitext(name)
    return int(stem) if suffix == SEGMENT_SUFFIX and stem.isdigit() else None


def _segment_indices(fs: FileSystem, log_dir: str) -> list[int]:
    indices = []
    for name in fs.list_dir(log_dir):
        stem, suffix = os.path.splitext(name)
        if suffix == SEGMENT_SUFFIX and stem.isdigit():
            indices.append(int(stem))
    return sorted(indices)


# --------------------------------------------------------------------------------------------
# Reading.


class LocatedRecord(msgspec.Struct, frozen=True):
    segment: str
    offset: int
    record: Record


class LogReader:
    """Iterate the records of a log in order, verifying every frame and record.

    Strict (default): a corrupt frame raises CorruptRecordError, an invalid record raises
    InvalidRecordError, both naming segment and offset; a segment missing from the sequence
    (a gap in the segment indices) raises CorruptRecordError naming it. Lenient: all three are
    skipped and counted in `corrupt_records` / `invalid_records` / `missing_segments`. A torn
    tail ends the newest segment either way (`torn_tail_bytes`), and a record of a type this
    reader does not know is skipped either way (`unknown_records`). Counters are final once
    iteration has finished.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, lenient: bool = False,
                 fs: FileSystem | None = None) -> None:
        self.fs = fs or OsFileSystem()
        self.log_dir = resolve_log_dir(run_dir, self.fs)
        self.lenient = lenient
        self.records_read = 0
        self.corrupt_records = 0
        self.invalid_records = 0
        self.unknown_records = 0
        self.missing_segments = 0
        self.torn_tail_bytes = 0
        self.problems: list[str] = []
        self._last_index = 0  # the index of the last segment read (gaps are checked on reading)

    def segments(self) -> list[tuple[str, bool]]:
        """(segment name, is the newest) of every segment, in order."""
        indices = _segment_indices(self.fs, self.log_dir)
        return [(segment_name(index), position == len(indices) - 1)
                for position, index in enumerate(indices)]

    def frames(self) -> Iterator[tuple[str, int, memoryview]]:
        """(segment name, offset, payload) of every valid frame."""
        for name, is_last in self.segments():
            for offset, payload in self.segment_frames(name, is_last):
                yield name, offset, payload

    def read_segment(self, name: str) -> bytes:
        """A segment's bytes; pass them to segment_frames/segment_records and release them
        with release_segment. Read segments in order: reading one checks that none is missing
        before it (CorruptRecordError naming the first missing one, or counted if lenient)."""
        self._check_gap(name)
        return self.fs.read_bytes(os.path.join(self.log_dir, name))

    def _check_gap(self, name: str) -> None:
        index = _index_of(name)
        if index is None or index <= self._last_index:
            return
        first_missing, self._last_index = self._last_index + 1, index
        missing = index - first_missing
        if not missing:
            return
        reason = (f"segment missing: {missing} segment(s) from {segment_name(first_missing)} "
                  f"before {name} are gone, with any records they held")
        error = CorruptRecordError(segment_name(first_missing), 0, reason)
        if not self.lenient:
            raise error
        self.missing_segments += missing
        self.problems.append(str(error))
        log.warning("replay.missing_segments", first=segment_name(first_missing), count=missing,
                    before=name)

    @staticmethod
    def release_segment(data: bytes) -> None:
        _release_map(data)

    def segment_frames(self, name: str, is_last: bool,
                       data: bytes | None = None) -> Iterator[tuple[int, memoryview]]:
        """(offset, payload) of every valid frame of one segment (read here unless `data`)."""
        owned = data is None
        if data is None:
            data = self.read_segment(name)
        scan = SegmentScan(name=name, size=len(data), index=_index_of(name))
        try:
            yield from iter_segment_frames(data, scan, is_last=is_last, lenient=self.lenient)
        finally:
            self.corrupt_records += scan.corrupt_records
            self.torn_tail_bytes += scan.torn_tail_bytes
            self.problems.extend(scan.problems)
            if owned:
                _release_map(data)

    def segment_records(self, name: str, is_last: bool, data: bytes | None = None) -> Iterator[Record]:
        """The records of one segment (see __iter__)."""
        frames = ((name, offset, payload) for offset, payload in self.segment_frames(name, is_last, data))
        for _, _, record in self._decoded(frames):
            yield record

    def located(self) -> Iterator[LocatedRecord]:
        """Every valid record with the segment and offset of its frame."""
        for name, offset, record in self._decoded(self.frames()):
            yield LocatedRecord(name, offset, record)

    def __iter__(self) -> Iterator[Record]:
        for _, _, record in self._decoded(self.frames()):
            yield record

    def _decoded(self, frames: Iterable[tuple[str, int, bytes]]) -> Iterator[tuple[str, int, Record]]:
        """Decode framed payloads; an invalid record is raised (strict) or skipped and counted."""
        for name, offset, payload in frames:
            try:
                record = decode_record(payload)
            except UnknownRecordTypeError as exc:
                # A newer writer's record type: tolerated as new fields are, strict or not.
                self.unknown_records += 1
                log.info("replay.unknown_record_skipped", segment=name, offset=offset,
                         record_type=exc.record_type)
                continue
            except InvalidRecordError as exc:
                self._skip_invalid(exc, name, offset)
                continue
            self.records_read += 1
            yield name, offset, record

    def _skip_invalid(self, exc: InvalidRecordError, name: str, offset: int) -> None:
        located = exc.at(name, offset)
        if not self.lenient:
            raise located from None
        self.invalid_records += 1
        self.problems.append(str(located))
        log.warning("replay.invalid_record_skipped", segment=name, offset=offset,
                    field=exc.field, reason=exc.reason)


class ScanResult(msgspec.Struct):
    records: list[Record]
    corrupt_records: int
    invalid_records: int
    torn_tail_bytes: int
    problems: list[str]
    unknown_records: int = 0
    missing_segments: int = 0


def read_records(run_dir: str | os.PathLike[str], *, lenient: bool = False,
                 fs: FileSystem | None = None) -> Iterator[Record]:
    """Every record of the log at `run_dir`, in append order (see LogReader)."""
    return iter(LogReader(run_dir, lenient=lenient, fs=fs))


def scan(run_dir: str | os.PathLike[str], *, lenient: bool = False,
         fs: FileSystem | None = None) -> ScanResult:
    """All records in memory, plus what was skipped (small logs and tests; stream otherwise)."""
    reader = LogReader(run_dir, lenient=lenient, fs=fs)
    records = list(reader)
    return ScanResult(records, reader.corrupt_records, reader.invalid_records,
                      reader.torn_tail_bytes, reader.problems, reader.unknown_records,
                      reader.missing_segments)
