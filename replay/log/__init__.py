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

Missing segments: segment indices run 1, 2, 3, ... with no gap, and each segment's header
repeats its index; a gap in the file names (a deleted segment) or a header naming another
index is corruption too (strict: `CorruptRecordError` naming the missing segment; lenient:
counted in `missing_segments` / `corrupt_records`).

Readers read each segment into memory (not a map), so a writer that cuts a torn tail while a
reader is at work cannot crash the reader (SIGBUS). Record types the reader does not know (a
newer writer's) are skipped and counted in `unknown_records`, strict or lenient.

All file I/O goes through the small `FileSystem` seam so that tests can inject a file layer
that drops unsynced bytes at a crash.

Modules: `files` (the seam), `framing` (headers, frames, one segment's scan), `reader`,
`writer`; every name is importable from `replay.log`.
"""

from replay.log.files import AppendFile, FileSystem, OsAppendFile, OsFileSystem
from replay.log.framing import (
    DEFAULT_SEGMENT_BYTES,
    FORMAT_VERSION,
    FRAME_HEADER,
    FRAME_MAGIC,
    FRAME_PREFIX,
    LOCK_FILE,
    LOG_SUBDIR,
    MAX_RECORD_BYTES,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    SEGMENT_SUFFIX,
    WRITE_BUFFER_BYTES,
    SegmentScan,
    frame,
    frame_header,
    iter_segment_frames,
    segment_header,
    segment_name,
)
from replay.log.reader import (
    LocatedRecord,
    LogReader,
    ScanResult,
    read_records,
    resolve_log_dir,
    scan,
)
from replay.log.writer import SYNC_EVERY_RECORD, Ack, FsyncPolicy, ReplayLog

__all__ = [
    "DEFAULT_SEGMENT_BYTES", "FORMAT_VERSION", "FRAME_HEADER", "FRAME_MAGIC", "FRAME_PREFIX",
    "LOCK_FILE", "LOG_SUBDIR", "MAX_RECORD_BYTES", "SEGMENT_HEADER", "SEGMENT_MAGIC",
    "SEGMENT_SUFFIX", "SYNC_EVERY_RECORD", "WRITE_BUFFER_BYTES", "Ack", "AppendFile",
    "FileSystem", "FsyncPolicy", "LocatedRecord", "LogReader", "OsAppendFile", "OsFileSystem",
    "ReplayLog", "ScanResult", "SegmentScan", "frame", "frame_header", "iter_segment_frames",
    "read_records", "resolve_log_dir", "scan", "segment_header", "segment_name",
]
