"""Sidecar summaries of segments: a cache of what `ColumnBuilder` needs from one segment, so
that `inflight stats` need not decode every record again.

A sidecar is used only when it summarizes exactly the bytes a segment holds now. It is named
and keyed by the segment's size and SHA-256 (a CRC would not do: CRC32C is linear, so an edit
that rewrites a frame header with its header checksum recomputed leaves the CRC of the whole
segment unchanged). File layout (integers little-endian)::

    00000001.seg.SIZE.SHA256[:32].cols
    header  68 bytes: magic b"IFLCOLS\\0" | u16 format (SIDECAR_FORMAT) | u16 flags (0)
                      | u32 crc32c(body) | u32 schema | u64 segment size | 32s sha256(segment)
                      | u64 body length
    body    msgpack SegmentSummary

`schema` fingerprints the record definitions and the summary's columns: a sidecar written by
code with other definitions (a record type added, a column added) is ignored. Any mismatch
(name, format, schema, size, digest, body checksum, a body that does not decode or whose
columns do not fit together) means the segment is scanned instead: a bad sidecar never costs
more than speed.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable
from typing import Final

import crc32c
import msgspec
import numpy as np
import structlog

from replay.log import SEGMENT_SUFFIX, FileSystem
from replay.query.columns import ColumnBuilder
from replay.query.summary import (  # noqa: F401 - re-exported
    _SUMMARY_DTYPES,
    SegmentSummary,
    SummaryEvent,
    _codes_ok,
)
from replay.records import (
    RECORD_TYPES,
    ActivationRecord,
    ConsumptionRecord,
    DiscardRecord,
    EvalRecord,
    Record,
    RolloutRecord,
)

log = structlog.get_logger("replay.query")

SIDECAR_SUFFIX: Final = ".cols"
SIDECAR_MAGIC: Final = b"IFLCOLS\x00"
SIDECAR_FORMAT: Final = 2  # 1: plain msgpack named by CRC32C; 2: this header, SHA-256, rewards
SIDECAR_HEADER: Final = struct.Struct("<8sHHIIQ32sQ")


def summarize_segment(records: Iterable[Record]) -> SegmentSummary:
    """The summary of one segment's records (in order)."""
    builder, events, count = ColumnBuilder(), [], 0
    for record in records:
        count += 1
        if isinstance(record, RolloutRecord):
            builder.add_rollout(record)  # no claim seen: `consumed` is its own, else -1
        elif isinstance(record, ConsumptionRecord | ActivationRecord | DiscardRecord | EvalRecord):
            events.append(SummaryEvent(builder.rows, record))
    columns = builder.build()
    blobs = {name: np.ascontiguousarray(getattr(columns, name), np.dtype(dtype).newbyteorder("<")
                                        ).tobytes()
             for name, dtype in _SUMMARY_DTYPES.items()}
    return SegmentSummary(count, blobs, columns.engines, columns.drop_reasons,
                          columns.error_kinds, events)


def _schema() -> int:
    """A fingerprint of what a summary's meaning depends on."""
    parts = [f"{cls.__struct_config__.tag}:{','.join(cls.__struct_fields__)}" for cls in RECORD_TYPES]
    parts += [f"{name}:{np.dtype(dtype).str}" for name, dtype in _SUMMARY_DTYPES.items()]
    parts += [f"summary:{','.join(SegmentSummary.__struct_fields__)}"]
    return crc32c.crc32c(";".join(parts).encode())


SCHEMA: Final = _schema()
_summary_decoder = msgspec.msgpack.Decoder(SegmentSummary)
_summary_encoder = msgspec.msgpack.Encoder()


class SegmentKey:
    """A segment's size and (computed when first asked for) SHA-256."""

    def __init__(self, segment: str, data: bytes) -> None:
        self.segment, self.size, self._data = segment, len(data), data
        self._digest: bytes | None = None

    @property
    def digest(self) -> bytes:
        if self._digest is None:
            self._digest = hashlib.sha256(self._data).digest()
            self._data = b""
        return self._digest

    @property
    def sidecar_name(self) -> str:
        return sidecar_name(self.segment, self.size, self.digest)


def sidecar_name(segment: str, size: int, digest: bytes) -> str:
    """A sidecar is named after the exact bytes it summarizes (an append, a cut or any
    rewrite changes the size or the SHA-256)."""
    return f"{segment}.{size}.{digest[:16].hex()}{SIDECAR_SUFFIX}"


def encode_sidecar(key: SegmentKey, summary: SegmentSummary) -> bytes:
    body = _summary_encoder.encode(summary)
    return SIDECAR_HEADER.pack(SIDECAR_MAGIC, SIDECAR_FORMAT, 0, crc32c.crc32c(body), SCHEMA,
                               key.size, key.digest, len(body)) + body


def decode_sidecar(blob: bytes, key: SegmentKey) -> SegmentSummary:
    """The summary in a sidecar's bytes; ValueError (or a msgspec error) on any mismatch."""
    if len(blob) < SIDECAR_HEADER.size:
        raise ValueError(f"truncated header ({len(blob)} bytes)")
    magic, version, _flags, body_crc, schema, size, digest, length = SIDECAR_HEADER.unpack_from(blob)
    if magic != SIDECAR_MAGIC:
        raise ValueError("not a sidecar")
    if version != SIDECAR_FORMAT:
        raise ValueError(f"sidecar format {version}, this reader uses {SIDECAR_FORMAT}")
    if schema != SCHEMA:
        raise ValueError("written for other record definitions")
    if size != key.size or digest != key.digest:
        raise ValueError("summarizes other segment bytes")
    body = memoryview(blob)[SIDECAR_HEADER.size:]
    if len(body) != length or crc32c.crc32c(body) != body_crc:
        raise ValueError("body checksum mismatch")
    summary = _summary_decoder.decode(body)
    summary.check()
    return summary


def find_sidecars(fs: FileSystem, log_dir: str) -> dict[str, list[str]]:
    """Sidecar file names by segment name."""
    found: dict[str, list[str]] = {}
    for name in fs.list_dir(log_dir):
        if name.endswith(SIDECAR_SUFFIX):
            found.setdefault(name.split(".", 2)[0] + SEGMENT_SUFFIX, []).append(name)
        # (temp files end in .tmp and are ignored)
    return found


def load_sidecar(fs: FileSystem, log_dir: str, key: SegmentKey,
                 candidates: list[str]) -> SegmentSummary | None:
    """The segment's summary from its sidecar, or None (no sidecar matches, or it is bad)."""
    prefix = f"{key.segment}.{key.size}."
    if not any(name.startswith(prefix) for name in candidates):
        return None  # the size alone rules every sidecar out: no need to hash
    wanted = key.sidecar_name
    if wanted not in candidates:
        return None
    try:
        return decode_sidecar(fs.read_bytes(os.path.join(log_dir, wanted)), key)
    except (OSError, ValueError, msgspec.MsgspecError) as exc:
        log.warning("replay.sidecar_ignored", sidecar=wanted, error=str(exc))
        return None


def write_sidecar(fs: FileSystem, log_dir: str, key: SegmentKey, summary: SegmentSummary,
                  stale: list[str]) -> None:
    """Best effort: a log directory we may not write to, or a full disk, costs only speed."""
    write_atomic = getattr(fs, "write_atomic", None)
    if write_atomic is None:
        return
    name = key.sidecar_name
    try:
        write_atomic(os.path.join(log_dir, name), encode_sidecar(key, summary))
        for old in stale:
            if old != name:
                fs.remove(os.path.join(log_dir, old))  # type: ignore[attr-defined]
    except OSError as exc:
        log.warning("replay.sidecar_not_written", segment=key.segment, error=str(exc))
