"""Framing of the replay log: segment headers, CRC32C-framed records, and the scan of one
segment's bytes that tells whole records from a torn tail and from corruption."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final

import crc32c
import msgspec
import structlog

from replay.errors import CorruptRecordError

log = structlog.get_logger("replay.log")

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
    index: int | None = None  # the index the file name gives; the header must repeat it
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
        magic, version, _flags, index = SEGMENT_HEADER.unpack_from(data, 0)
        if magic == SEGMENT_MAGIC and version == FORMAT_VERSION:
            if scan.index is None or index == scan.index:
                return SEGMENT_HEADER.size
            # A renamed or copied segment (its records belong elsewhere in the log), or, with
            # no frame after it in the newest segment, a header whose write was cut short.
            reason = f"segment header says index {index}, the file name {scan.index}"
        else:
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

