"""A segment's summary: what `ColumnBuilder` needs from one segment, without token blobs.
A leaf shared by the column builder and the sidecar files (neither imports the other's
reasons to change)."""

from __future__ import annotations

from typing import Any, Final

import msgspec
import numpy as np

from replay.records import ActivationRecord, ConsumptionRecord, DiscardRecord, EvalRecord

# Per-rollout columns (consumed and discarded aside: they stay lists, later records change them).
ROLLOUT_DTYPES: Final = {
    "rollout_id": np.int64, "engine": np.int32, "status": np.int8, "detail": np.int32,
    "dispatched": np.int64, "span_start": np.int64, "span_end": np.int64, "n_versions": np.int32,
    "n_tokens": np.int64, "reward": np.float64, "env_tokens": np.int64, "turns": np.int32,
    "truncated": np.int8}
RUN_DTYPES: Final = {"seg_row": np.int64, "seg_version": np.int64, "seg_tokens": np.int64}
_SUMMARY_DTYPES: Final = ROLLOUT_DTYPES | RUN_DTYPES | {"consumed": np.int64}


class SummaryEvent(msgspec.Struct, array_like=True):
    """A consumption, discard, activation or eval record, after `at` rollouts of its segment."""

    at: int
    record: ConsumptionRecord | ActivationRecord | DiscardRecord | EvalRecord


class SegmentSummary(msgspec.Struct, array_like=True):
    """What ColumnBuilder needs from one segment, without token blobs: its rollouts as
    little-endian column bytes (vocabulary codes index this segment's own name lists), its
    consumption, discard and activation records, how many records it held and how many of a
    type this reader does not know it skipped."""

    records: int
    columns: dict[str, bytes]
    engines: list[str]
    drop_reasons: list[str]
    error_kinds: list[str]
    events: list[SummaryEvent]
    unknown_records: int = 0

    def arrays(self) -> list[tuple[str, bytes, Any]]:
        return [(name, self.columns[name], np.dtype(dtype).newbyteorder("<"))
                for name, dtype in _SUMMARY_DTYPES.items()]

    def check(self) -> None:
        """Raise ValueError unless the parts fit together (so that adding it cannot fail)."""
        arrays = {}
        for name, blob, dtype in self.arrays():
            if len(blob) % dtype.itemsize:
                raise ValueError(f"column {name}: {len(blob)} bytes")
            arrays[name] = np.frombuffer(blob, dtype)
        rows = len(arrays["rollout_id"])
        if any(len(arrays[name]) != rows for name in (*ROLLOUT_DTYPES, "consumed")):
            raise ValueError("rollout columns of different lengths")
        runs = int(arrays["n_versions"].sum()) if rows else 0
        if (arrays["n_versions"] < 0).any() or any(len(arrays[name]) != runs for name in RUN_DTYPES):
            raise ValueError("version runs do not match n_versions")
        if runs and not (np.diff(arrays["seg_row"]) >= 0).all() or \
                runs and not (0 <= arrays["seg_row"].min() and arrays["seg_row"].max() < rows):
            raise ValueError("version runs name rows out of range")
        status, detail = arrays["status"], arrays["detail"]
        if rows and not (((status >= 0) & (status <= 2)).all()
                         and _codes_ok(arrays["engine"], len(self.engines))
                         and _codes_ok(detail[status == 1], len(self.drop_reasons))
                         and _codes_ok(detail[status == 2], len(self.error_kinds))):
            raise ValueError("status or vocabulary codes out of range")
        at = [event.at for event in self.events]
        if at != sorted(at) or (at and not 0 <= at[0] <= at[-1] <= rows):
            raise ValueError("events out of order")
        if self.records < rows + len(self.events) or self.unknown_records < 0:
            raise ValueError("record counts do not add up")


def _codes_ok(codes: np.ndarray, size: int) -> bool:
    return len(codes) == 0 or (0 <= int(codes.min()) and int(codes.max()) < size)
