"""The replay log: append-only segment files of CRC32C-framed records.

File format (all integers little-endian)::

    RUN_DIR/replay/00000001.seg, 00000002.seg, ...   (a new segment when one reaches segment_bytes)

    segment header  16 bytes: magic b"IFLREPLY" | u16 format version (1) | u16 flags (0) | u32 index
    frame           16 bytes: magic b"\\xf1RPL" | u32 payload length | u32 crc32c(payload)
                              | u32 crc32c(the 12 bytes before it)
                    then the payload: one msgpack-encoded record (replay.records)

The header checksum lets a reader judge a frame's length before trusting it: a bogus length
is rejected before anything is allocated or read for it.

Durability: an append is acknowledged (`Ack.durable`, or `flush()` returned) once the fsync
(fdatasync) covering it has returned; a new segment's header and directory entry are synced
when it is created, and a segment is synced before the next one is started. Frames wait in
a small in-memory buffer until the sync that acknowledges them (or until 256 KiB are waiting),
so another process reading a live log sees records no later than they are acknowledged.

Recovery: a bad frame followed by no valid frame in the newest segment is a torn tail (the
writer died mid-append, or the OS lost unsynced bytes); opening the log for writing cuts it
off and appends after the last whole record, and readers stop before it. A bad frame that a
valid frame follows, or any bad frame in an older segment, is corruption: strict readers raise
`CorruptRecordError(segment, offset)`; lenient readers skip it and count it. Loss of unsynced
bytes is assumed to leave a prefix of what was written (possibly followed by zeros or garbage),
as file systems do when they extend a file before its data reaches the disk.

All file I/O goes through the small `FileSystem` seam so that tests can inject a file layer
that drops unsynced bytes at a crash.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Final, Protocol

import crc32c
import msgspec
import structlog

from replay.errors import (
    CorruptRecordError,
    InvalidRecordError,
    LogNotFoundError,
    ReplayError,
)
from replay.records import Record, decode_record, encode_record_into

log = structlog.get_logger(__name__)

LOG_SUBDIR: Final = "replay"
LOCK_FILE: Final = "writer.lock"
SEGMENT_SUFFIX: Final = ".seg"
SEGMENT_MAGIC: Final = b"IFLREPLY"
FORMAT_VERSION: Final = 1
SEGMENT_HEADER: Final = struct.Struct("<8sHHI")
FRAME_MAGIC: Final = b"\xf1RPL"
FRAME_HEADER: Final = struct.Struct("<4sIII")
FRAME_PREFIX: Final = struct.Struct("<4sII")  # the part the header checksum covers
_HEADER_CRC: Final = struct.Struct("<I")
_BLANK_HEADER: Final = bytes(FRAME_HEADER.size)
MAX_RECORD_BYTES: Final = 64 * 1024 * 1024
DEFAULT_SEGMENT_BYTES: Final = 64 * 1024 * 1024
# Frames wait in memory until a sync (or this much is pending): one write(2) per batch instead
# of one per record. Nothing waiting there was acknowledged, so a crash cannot lose an ack.
WRITE_BUFFER_BYTES: Final = 256 * 1024


# --------------------------------------------------------------------------------------------
# The file seam.


class AppendFile(Protocol):
    """An open file that is only ever appended to (or cut back)."""

    def write(self, data: bytes | bytearray) -> None: ...  # writes every byte or raises
    def sync(self) -> None: ...  # returns once written bytes are durable
    def truncate(self, size: int) -> None: ...
    def size(self) -> int: ...
    def close(self) -> None: ...


class FileSystem(Protocol):
    """The few file operations the log needs."""

    def list_dir(self, path: str) -> list[str]: ...
    def make_dirs(self, path: str) -> None: ...
    def is_dir(self, path: str) -> bool: ...
    def read_bytes(self, path: str) -> bytes: ...
    def open_append(self, path: str) -> AppendFile: ...  # creates the file when missing
    def sync_dir(self, path: str) -> None: ...  # makes created file names durable
    def lock(self, path: str) -> Callable[[], None]: ...  # exclusive; returns the release


class OsAppendFile:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def write(self, data: bytes | bytearray) -> None:
        # Views are released even on error: the log's bytearray buffer must stay resizable.
        with memoryview(data) as view:
            written = os.write(self._fd, view)
            while written < len(view):
                with view[written:] as rest:
                    written += os.write(self._fd, rest)

    def sync(self) -> None:
        # fdatasync also persists the file size, which is all an append changes.
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(self._fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        os.close(self._fd)


class OsFileSystem:
    """The real file system."""

    def list_dir(self, path: str) -> list[str]:
        return os.listdir(path)

    def make_dirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def read_bytes(self, path: str) -> bytes:
        # A read-only map, not a copy: reading a 64 MiB segment into a bytes object would cost
        # about as much as verifying and decoding its records. (mmap has the bytes methods
        # the reader uses: find, len, slicing, the buffer protocol.)
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size == 0:
                return b""
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # type: ignore[return-value]

    def open_append(self, path: str) -> OsAppendFile:
        return OsAppendFile(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace `path` with `data` all at once: a reader sees the old file, the whole new
        one, or none, never a part (temp file, fsync, rename, directory fsync)."""
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self.sync_dir(os.path.dirname(path))

    def remove(self, path: str) -> None:
        os.unlink(path)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def lock(self, path: str) -> Callable[[], None]:
        """An advisory exclusive lock (flock), released by the returned function or when the
        process dies: two writers appending to one log would interleave their frames."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ReplayError(f"the replay log in {os.path.dirname(path)} is open for writing "
                              f"by another process or handle") from None

        def release() -> None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        return release


# --------------------------------------------------------------------------------------------
# Framing.


def frame_header(payload: bytes) -> bytes:
    """The 16 bytes before a payload: magic, length, payload CRC, header CRC."""
    prefix = FRAME_PREFIX.pack(FRAME_MAGIC, len(payload), crc32c.crc32c(payload))
    return prefix + crc32c.crc32c(prefix).to_bytes(4, "little")


def frame(payload: bytes) -> bytes:
    """One framed record: header then payload."""
    return frame_header(payload) + payload


def segment_header(index: int) -> bytes:
    return SEGMENT_HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION, 0, index)


def segment_name(index: int) -> str:
    return f"{index:08d}{SEGMENT_SUFFIX}"


def _check_frame(data: bytes | memoryview, pos: int) -> tuple[int, str]:
    """(payload length, "") if a whole valid frame starts at `pos`, else (-1, why not)."""
    remaining = len(data) - pos
    if remaining < FRAME_HEADER.size:
        return -1, f"truncated frame header ({remaining} bytes)"
    magic, length, payload_crc, header_crc = FRAME_HEADER.unpack_from(data, pos)
    if magic != FRAME_MAGIC:
        return -1, "bad frame magic"
    view = memoryview(data)
    if crc32c.crc32c(view[pos:pos + FRAME_PREFIX.size]) != header_crc:
        return -1, "frame header checksum mismatch"
    # The length is trusted only now, and is still compared before anything is read for it.
    if length > MAX_RECORD_BYTES:
        return -1, f"impossible length {length}"
    if length > remaining - FRAME_HEADER.size:
        return -1, f"length {length} runs past the end of the segment"
    start = pos + FRAME_HEADER.size
    if crc32c.crc32c(view[start:start + length]) != payload_crc:
        return -1, "payload checksum mismatch"
    return length, ""


def _next_valid_frame(data: bytes, start: int) -> int | None:
    """The offset of the first whole valid frame at or after `start`, if any."""
    pos = data.find(FRAME_MAGIC, start)
    while pos != -1:
        if _check_frame(data, pos)[0] >= 0:
            return pos
        pos = data.find(FRAME_MAGIC, pos + 1)
    return None


class SegmentScan(msgspec.Struct):
    """What scanning one segment found (filled in as its frames are iterated)."""

    name: str
    size: int
    header_ok: bool = True
    valid_end: int = 0  # end of the last whole record (where a writer continues)
    torn_tail_bytes: int = 0
    corrupt_records: int = 0
    problems: list[str] = msgspec.field(default_factory=list)


def iter_segment_frames(data: bytes, scan: SegmentScan, *, is_last: bool,
                        lenient: bool) -> Iterator[tuple[int, memoryview]]:
    """Yield (offset, payload) for each valid frame of one segment's bytes; see module doc."""
    view = memoryview(data)
    pos = _check_segment_header(data, scan, is_last=is_last, lenient=lenient)
    if pos is None:
        return
    scan.valid_end = pos
    size, header_size, prefix_size = len(data), FRAME_HEADER.size, FRAME_PREFIX.size
    unpack, crc = FRAME_HEADER.unpack_from, crc32c.crc32c
    while pos < size:
        # The fast path for a good frame (the same checks as _check_frame, inlined: this loop
        # runs once per record). Comparing the length allocates nothing, whatever its value.
        if size - pos >= header_size:
            magic, length, payload_crc, header_crc = unpack(data, pos)
            start = pos + header_size
            end = start + length
            if (magic == FRAME_MAGIC and length <= MAX_RECORD_BYTES and end <= size
                    and crc(view[pos:pos + prefix_size]) == header_crc
                    and crc(view[start:end]) == payload_crc):
                yield pos, view[start:end]
                pos = scan.valid_end = end
                continue
        reason = _check_frame(data, pos)[1]
        resume = _next_valid_frame(data, pos + 1)
        if resume is None and is_last:
            scan.torn_tail_bytes = len(data) - pos
            return
        _corrupt(scan, pos, reason, lenient)
        if resume is None:
            return
        pos = resume


def _check_segment_header(data: bytes, scan: SegmentScan, *, is_last: bool,
                          lenient: bool) -> int | None:
    """The offset of the first frame, or None when the segment holds no frames."""
    if len(data) >= SEGMENT_HEADER.size:
        magic, version, _flags, _index = SEGMENT_HEADER.unpack_from(data, 0)
        if magic == SEGMENT_MAGIC and version == FORMAT_VERSION:
            return SEGMENT_HEADER.size
        reason = (f"unsupported format version {version}" if magic == SEGMENT_MAGIC
                  else "bad segment header")
    else:
        reason = f"truncated segment header ({len(data)} bytes)"
    scan.header_ok = False
    resume = _next_valid_frame(data, 0)
    if resume is None and is_last:
        # A segment whose creation was cut short: nothing in it was ever acknowledged.
        scan.torn_tail_bytes = len(data)
        return None
    _corrupt(scan, 0, reason, lenient)
    return resume


def _corrupt(scan: SegmentScan, offset: int, reason: str, lenient: bool) -> None:
    if not lenient:
        raise CorruptRecordError(scan.name, offset, reason)
    scan.corrupt_records += 1
    scan.problems.append(str(CorruptRecordError(scan.name, offset, reason)))
    log.warning("replay.corrupt_record_skipped", segment=scan.name, offset=offset, reason=reason)


def _release_map(data: object) -> None:
    """Unmap a segment read by OsFileSystem (no-op for bytes)."""
    close = getattr(data, "close", None)
    if close is not None:
        try:
            close()
        except BufferError:  # a caller still holds a view; the map goes when it does
            pass


# --------------------------------------------------------------------------------------------
# Finding segments.


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
    InvalidRecordError, both naming segment and offset. Lenient: both are skipped and counted
    in `corrupt_records` / `invalid_records`. A torn tail ends the newest segment either way
    (`torn_tail_bytes`). Counters are final once iteration has finished.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, lenient: bool = False,
                 fs: FileSystem | None = None) -> None:
        self.fs = fs or OsFileSystem()
        self.log_dir = resolve_log_dir(run_dir, self.fs)
        self.lenient = lenient
        self.records_read = 0
        self.corrupt_records = 0
        self.invalid_records = 0
        self.torn_tail_bytes = 0
        self.problems: list[str] = []

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
        """A segment's bytes (a read-only map); pass them to segment_frames/segment_records and
        release them with release_segment."""
        return self.fs.read_bytes(os.path.join(self.log_dir, name))

    @staticmethod
    def release_segment(data: bytes) -> None:
        _release_map(data)

    def segment_frames(self, name: str, is_last: bool,
                       data: bytes | None = None) -> Iterator[tuple[int, memoryview]]:
        """(offset, payload) of every valid frame of one segment (read here unless `data`)."""
        owned = data is None
        if data is None:
            data = self.read_segment(name)
        scan = SegmentScan(name=name, size=len(data))
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
                      reader.torn_tail_bytes, reader.problems)


# --------------------------------------------------------------------------------------------
# Writing.


class FsyncPolicy(msgspec.Struct, frozen=True):
    """When appends are made durable.

    every_records=N: fsync when N records are waiting (1: every append returns durable).
    every_ms=T: fsync when the oldest waiting record is T ms old (checked on append and by a
    background thread, so a quiet log still syncs within about T ms).
    Both may be set; either one triggers. `flush()` always syncs at once.
    """

    every_records: int | None = 1
    every_ms: float | None = None

    def __post_init__(self) -> None:
        if self.every_records is None and self.every_ms is None:
            raise ValueError("FsyncPolicy needs every_records or every_ms")
        if self.every_records is not None and self.every_records < 1:
            raise ValueError(f"every_records must be >= 1, got {self.every_records}")
        if self.every_ms is not None and self.every_ms <= 0:
            raise ValueError(f"every_ms must be > 0, got {self.every_ms}")

    @classmethod
    def always(cls) -> FsyncPolicy:
        return cls(every_records=1)

    @classmethod
    def every(cls, records: int) -> FsyncPolicy:
        return cls(every_records=records)

    @classmethod
    def interval(cls, ms: float) -> FsyncPolicy:
        return cls(every_records=None, every_ms=ms)


SYNC_EVERY_RECORD: Final = FsyncPolicy.always()


class Ack(msgspec.Struct, frozen=True):
    """Where an appended record lies, and whether it was durable when `append` returned.

    `seq` counts appends since this process opened the log; `ReplayLog.wait_durable(ack)`
    blocks until a later fsync covers it.
    """

    segment: str
    offset: int
    seq: int
    durable: bool


class ReplayLog:
    """The writer. Thread-safe; `append` is synchronous (call it from a worker thread in
    asyncio code). Use `ReplayLog.open(...)`, preferably as a context manager."""

    def __init__(self, log_dir: str, fs: FileSystem, fsync: FsyncPolicy, segment_bytes: int,
                 lenient: bool) -> None:
        self.log_dir = log_dir
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self._fs = fs
        self._lenient = lenient
        self._lock = threading.Lock()
        self._durable = threading.Condition(self._lock)
        self._file: AppendFile | None = None
        self._buffer = bytearray()  # framed records not yet handed to the OS
        self._segment_index = 0
        self._segment_name = ""
        # every_records as a plain int (a huge one when unset) keeps the per-append check cheap
        self._sync_every_records = fsync.every_records or 2**62
        self._timed = fsync.every_ms is not None
        self._size = 0
        self._seq = 0
        self._durable_seq = 0
        self._oldest_unsynced: float | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._stop_flusher = threading.Event()
        self._flusher: threading.Thread | None = None
        self._release_lock: Callable[[], None] = lambda: None
        self.recovered_torn_bytes = 0

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(cls, run_dir: str | os.PathLike[str], *, fsync: FsyncPolicy = SYNC_EVERY_RECORD,
             segment_bytes: int = DEFAULT_SEGMENT_BYTES, lenient: bool = False,
             fs: FileSystem | None = None) -> ReplayLog:
        """Open (creating it if needed) the log in RUN_DIR/replay and recover its tail.

        A torn tail of the newest segment is cut back to the last whole record. Corruption
        before the tail raises CorruptRecordError unless `lenient` (then appending goes on
        after the last valid record).
        """
        if segment_bytes < SEGMENT_HEADER.size + FRAME_HEADER.size + 1:
            raise ValueError(f"segment_bytes too small: {segment_bytes}")
        fs = fs or OsFileSystem()
        log_dir = os.path.join(os.fspath(run_dir), LOG_SUBDIR)
        fs.make_dirs(log_dir)
        release = fs.lock(os.path.join(log_dir, LOCK_FILE))
        writer = cls(log_dir, fs, fsync, segment_bytes, lenient)
        writer._release_lock = release
        try:
            writer._recover()
        except BaseException:
            release()
            raise
        if fsync.every_ms is not None:
            writer._start_flusher()
        return writer

    def _recover(self) -> None:
        indices = _segment_indices(self._fs, self.log_dir)
        if not indices:
            self._start_segment(1)
            return
        index = indices[-1]
        name = segment_name(index)
        path = os.path.join(self.log_dir, name)
        data = self._fs.read_bytes(path)
        scan = SegmentScan(name=name, size=len(data))
        for _ in iter_segment_frames(data, scan, is_last=True, lenient=self._lenient):
            pass
        _release_map(data)  # before the file is cut back under it
        if not scan.header_ok and scan.valid_end == 0:
            # Creation of this segment was cut short: start it again from nothing.
            file = self._fs.open_append(path)
            file.truncate(0)
            file.write(segment_header(index))
            file.sync()
            self._fs.sync_dir(self.log_dir)
            self._use(file, index, SEGMENT_HEADER.size)
            self.recovered_torn_bytes = scan.size
            log.warning("replay.torn_segment_reset", segment=name, bytes=scan.size)
            return
        file = self._fs.open_append(path)
        if scan.valid_end < scan.size:
            file.truncate(scan.valid_end)
            file.sync()
            self.recovered_torn_bytes = scan.size - scan.valid_end
            log.warning("replay.torn_tail_cut", segment=name, offset=scan.valid_end,
                        bytes=scan.size - scan.valid_end)
        self._use(file, index, scan.valid_end)

    def _use(self, file: AppendFile, index: int, size: int) -> None:
        self._file, self._segment_index, self._size = file, index, size
        self._segment_name = segment_name(index)

    def _start_segment(self, index: int) -> None:
        path = os.path.join(self.log_dir, segment_name(index))
        file = self._fs.open_append(path)
        file.truncate(0)  # a leftover from an earlier failed attempt is never valid
        file.write(segment_header(index))
        file.sync()
        self._fs.sync_dir(self.log_dir)  # the new name must survive a crash too
        self._use(file, index, SEGMENT_HEADER.size)

    # -- appending ----------------------------------------------------------------------------

    def append(self, record: Record) -> Ack:
        """Validate, encode, frame and write one record; fsync per policy.

        Raises InvalidRecordError (naming the field) for a bad record; nothing is written.
        """
        with self._lock:
            if self._closed or self._failure is not None:
                self._check_usable()
            # The frame is built in place at the end of the write buffer: a blank header, the
            # record encoded straight after it, then the header filled in from checksums over
            # views of the buffer. No per-record bytes objects, one copy of the blobs.
            buffer = self._buffer
            start = len(buffer)
            payload_start = start + FRAME_HEADER.size
            buffer += _BLANK_HEADER
            try:
                encode_record_into(record, buffer, payload_start)
            except BaseException:
                del buffer[start:]  # a refused record leaves nothing behind
                raise
            length = len(buffer) - payload_start
            if length > MAX_RECORD_BYTES:
                del buffer[start:]
                raise InvalidRecordError("type", f"encoded record of {length} bytes exceeds "
                                                 f"{MAX_RECORD_BYTES}")
            with memoryview(buffer) as view:
                FRAME_PREFIX.pack_into(buffer, start, FRAME_MAGIC, length,
                                       crc32c.crc32c(view[payload_start:]))
                _HEADER_CRC.pack_into(buffer, start + FRAME_PREFIX.size,
                                      crc32c.crc32c(view[start:start + FRAME_PREFIX.size]))
            frame_bytes = FRAME_HEADER.size + length
            if self._size + frame_bytes > self.segment_bytes and self._size > SEGMENT_HEADER.size:
                framed = bytes(buffer[start:])
                del buffer[start:]
                self._roll_over()  # writes and syncs what the old segment had waiting
                buffer += framed
            offset = self._size
            self._size = offset + frame_bytes
            if len(buffer) >= WRITE_BUFFER_BYTES:
                self._write_buffer()
            seq = self._seq = self._seq + 1
            if self._timed:
                if self._oldest_unsynced is None:
                    self._oldest_unsynced = time.monotonic()
                if self._sync_due():
                    self._sync_locked()
            elif seq - self._durable_seq >= self._sync_every_records:
                self._sync_locked()
            return Ack(self._segment_name, offset, seq, self._durable_seq >= seq)

    def _sync_due(self) -> bool:
        policy = self.fsync
        if self._seq - self._durable_seq >= self._sync_every_records:
            return True
        if policy.every_ms is not None and self._oldest_unsynced is not None:
            return (time.monotonic() - self._oldest_unsynced) * 1000 >= policy.every_ms
        return False

    def _write_buffer(self) -> None:
        if self._buffer:
            self._guarded(self._file.write, self._buffer)  # type: ignore[union-attr]
            self._buffer.clear()

    def _sync_locked(self) -> None:
        if self._durable_seq == self._seq:
            return
        self._write_buffer()
        self._guarded(self._file.sync)  # type: ignore[union-attr]
        self._durable_seq = self._seq
        self._oldest_unsynced = None
        self._durable.notify_all()

    def _roll_over(self) -> None:
        self._sync_locked()
        self._guarded(self._file.close)  # type: ignore[union-attr]
        self._guarded(self._start_segment, self._segment_index + 1)

    def _guarded(self, operation, *args):  # type: ignore[no-untyped-def]
        """Run a file operation; any failure leaves the log unusable (a failed write may have
        left part of a frame, and after a failed fsync nothing is known to be durable)."""
        try:
            return operation(*args)
        except OSError as exc:
            self._failure = exc
            self._durable.notify_all()
            raise ReplayError(f"replay log {self.log_dir} failed and must be reopened: {exc!r}") from exc
        except BaseException as exc:  # interrupted mid-operation: the file state is unknown
            self._failure = exc
            self._durable.notify_all()
            raise

    def _check_usable(self) -> None:
        if self._closed:
            raise ReplayError(f"replay log {self.log_dir} is closed")
        if self._failure is not None:
            raise ReplayError(f"replay log {self.log_dir} failed earlier and must be reopened: "
                              f"{self._failure!r}")

    # -- durability ---------------------------------------------------------------------------

    def flush(self) -> None:
        """fsync now: every record appended so far is durable when this returns."""
        with self._lock:
            self._check_usable()
            self._sync_locked()

    def wait_durable(self, ack: Ack, timeout: float | None = None) -> bool:
        """Block until a sync covers `ack` (or the log fails/closes); True if it is durable."""
        with self._lock:
            self._durable.wait_for(lambda: self._durable_seq >= ack.seq or self._failure is not None
                                   or self._closed, timeout)
            return self._durable_seq >= ack.seq

    @property
    def appended(self) -> int:
        return self._seq

    @property
    def durable_seq(self) -> int:
        return self._durable_seq

    def _start_flusher(self) -> None:
        self._flusher = threading.Thread(target=self._flush_periodically, name="replay-fsync",
                                         daemon=True)
        self._flusher.start()

    def _flush_periodically(self) -> None:
        interval = self.fsync.every_ms / 1000  # type: ignore[operator]
        while not self._stop_flusher.wait(interval / 2):
            with self._lock:
                if self._failure is None and not self._closed and self._sync_due():
                    try:
                        self._sync_locked()
                    except ReplayError:
                        log.exception("replay.background_fsync_failed")
                        return

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Sync what is pending and close. Idempotent."""
        self._stop_flusher.set()
        if self._flusher is not None:
            self._flusher.join()
        with self._lock:
            if self._closed:
                return
            try:
                if self._failure is None:
                    self._sync_locked()
            finally:
                self._closed = True
                self._durable.notify_all()
                if self._file is not None:
                    try:
                        self._file.close()
                    except OSError:
                        log.exception("replay.close_failed")
                self._release_lock()

    def __enter__(self) -> ReplayLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
