"""Writing the replay log: framed appends, fsync policy and acknowledgement, rollover to a
new segment, and recovery of a torn tail on open."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Final

import crc32c
import msgspec
import structlog

from replay.errors import InvalidRecordError, ReplayError
from replay.log.files import AppendFile, FileSystem, OsFileSystem
from replay.log.framing import (
    _HEADER_CRC,
    DEFAULT_SEGMENT_BYTES,
    FRAME_HEADER,
    FRAME_MAGIC,
    FRAME_PREFIX,
    LOCK_FILE,
    LOG_SUBDIR,
    MAX_RECORD_BYTES,
    SEGMENT_HEADER,
    WRITE_BUFFER_BYTES,
    SegmentScan,
    _release_map,
    iter_segment_frames,
    segment_header,
    segment_name,
)
from replay.log.reader import _segment_indices
from replay.records import Record, encode_record_to

log = structlog.get_logger("replay.log")

# Bound once: append runs these for every record.
_crc: Final = crc32c.crc32c
_pack_prefix: Final = FRAME_PREFIX.pack
_pack_header_crc: Final = _HEADER_CRC.pack
_FRAME_HEADER_SIZE: Final = FRAME_HEADER.size
_SCRATCH_KEEP_BYTES: Final = 1024 * 1024  # a scratch buffer grown past this is not kept

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
        self._scratch = bytearray()  # where append encodes each record (see append)
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
        scan = SegmentScan(name=name, size=len(data), index=index)
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
        try:
            file.truncate(0)  # a leftover from an earlier failed attempt is never valid
            file.write(segment_header(index))
            file.sync()
            self._fs.sync_dir(self.log_dir)  # the new name must survive a crash too
        except BaseException:
            _close_quietly(file)  # not kept: the first error is the one that counts
            raise
        self._use(file, index, SEGMENT_HEADER.size)

    # -- appending ----------------------------------------------------------------------------

    def append(self, record: Record) -> Ack:
        """Validate, encode, frame and write one record; fsync per policy.

        Raises InvalidRecordError (naming the field) for a bad record; nothing is written.
        """
        with self._lock:
            if self._closed or self._failure is not None:
                self._check_usable()
            # The record is encoded (and checked) into a scratch buffer that keeps its memory
            # from one append to the next (msgspec writes into it in place), then framed and
            # copied once to the end of the write buffer. A refused record leaves nothing
            # behind. (Measured: about half the time of encoding to a new bytes object, and
            # less than handing each payload to writev(2) from a pool of buffers.)
            scratch = self._scratch
            try:
                encode_record_to(record, scratch)
            except BaseException:
                if len(scratch) > _SCRATCH_KEEP_BYTES:
                    self._scratch = bytearray()
                raise
            length = len(scratch)
            if length > _SCRATCH_KEEP_BYTES:
                self._scratch = bytearray()  # do not hold on to a huge record's memory
                if length > MAX_RECORD_BYTES:
                    raise InvalidRecordError("type", f"encoded record of {length} bytes exceeds "
                                                     f"{MAX_RECORD_BYTES}")
            offset = self._size
            frame_bytes = _FRAME_HEADER_SIZE + length
            if offset + frame_bytes > self.segment_bytes and offset > SEGMENT_HEADER.size:
                self._roll_over()  # writes and syncs what the old segment had waiting
                offset = self._size
            buffer = self._buffer
            mark = len(buffer)
            try:
                prefix = _pack_prefix(FRAME_MAGIC, length, _crc(scratch))
                buffer += prefix
                buffer += _pack_header_crc(_crc(prefix))
                buffer += scratch
                self._size = offset + frame_bytes
            except BaseException:
                # A frame goes into the buffer in three pieces. Interrupted in between (a signal's
                # KeyboardInterrupt, a MemoryError growing the buffer), the part already there
                # would reach the disk with the next batch: a torn frame with whole ones after it,
                # which readers must report as corruption. Cut it off: the log stays as it was.
                del buffer[mark:]
                self._size = offset
                raise
            if len(buffer) >= WRITE_BUFFER_BYTES:
                self._write_buffer()
            seq = self._seq = self._seq + 1
            if seq - self._durable_seq >= self._sync_every_records:
                self._sync_locked()
            elif self._timed:
                if self._oldest_unsynced is None:
                    self._oldest_unsynced = time.monotonic()
                if self._sync_due():
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
        """Write and sync the frames the old segment has waiting, close it, start the next."""
        self._sync_locked()
        # Forgotten before it is closed: if starting the next segment fails, close() must not
        # close it again (its descriptor number may by then belong to another file).
        old, self._file = self._file, None
        self._guarded(old.close)  # type: ignore[union-attr]
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
                    _close_quietly(self._file)
                self._release_lock()

    def __enter__(self) -> ReplayLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close_quietly(file: AppendFile) -> None:
    try:
        file.close()
    except OSError:
        log.exception("replay.close_failed")
