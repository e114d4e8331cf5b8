"""Staleness statistics over a replay log, computed on numpy columns.

One implementation serves `inflight stats` (offline, from the files) and the live `/stats`
endpoint (the orchestrator feeds each record it appends to a `ColumnBuilder` and calls
`compute_stats(builder.build(), filters)`).

Definitions (over rollouts that a trainer step consumed):

    staleness      consumed_step - dispatched_version
    in_flight_lag  last version of the span - first version of the span   (0 for one version)
    queue_lag      staleness - in_flight_lag, so that the two parts add up to the whole
    token lag      consumed_step - the version a token was sampled under

Percentiles are nearest-rank: p50 is the smallest value with at least 50% of the values at or
below it (numpy's "inverted_cdf"), so they are always values that occurred. Histograms of
integer lags map each value (as a string, for JSON) to its count.

Only a compact summary of each rollout is kept (ids, versions, change points, token counts),
never the token blobs, so a million rollouts fit in a few tens of megabytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import crc32c
import msgspec
import numpy as np
import structlog

from replay.log import SEGMENT_SUFFIX, FileSystem, LogReader
from replay.records import (
    DROP_STALE,
    STATUS_NAMES,
    ActivationRecord,
    Completed,
    ConsumptionRecord,
    Dropped,
    Errored,
    Record,
    RolloutRecord,
    int32_values,
)

log = structlog.get_logger(__name__)

PERCENTILES: Final = (50, 90, 99)
NOT_CONSUMED: Final = -1
_STATUS_CODE: Final = {Completed: 0, Dropped: 1, Errored: 2}


class Filters(msgspec.Struct, frozen=True):
    """Which rollouts (and activations) the statistics cover.

    step_min/step_max bound the consuming trainer step (inclusive; rollouts no step consumed
    are then left out) and the version of activations. Empty `engines`/`statuses`: all.
    """

    step_min: int | None = None
    step_max: int | None = None
    engines: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.statuses) - set(STATUS_NAMES)
        if unknown:
            raise ValueError(f"unknown status {sorted(unknown)}; expected {list(STATUS_NAMES)}")


@dataclass(frozen=True)
class Columns:
    """Columnar summary of a log. Row i of the rollout arrays is one rollout; the `seg_*`
    arrays hold one entry per version run (change point) of a rollout's completion; the
    `act_*` arrays one entry per activation and the `entry_*` arrays one per engine in it."""

    # rollouts
    rollout_id: np.ndarray  # int64
    engine: np.ndarray  # int32 index into `engines`
    status: np.ndarray  # int8: 0 completed, 1 dropped, 2 errored
    detail: np.ndarray  # int32 index into `drop_reasons` (dropped) or `error_kinds` (errored)
    dispatched: np.ndarray  # int64
    span_start: np.ndarray  # int64 (the dispatched version for an empty completion)
    span_end: np.ndarray  # int64
    n_versions: np.ndarray  # int32, 0 for an empty completion
    n_tokens: np.ndarray  # int64 completion tokens
    consumed: np.ndarray  # int64 consuming step, NOT_CONSUMED (-1) if none
    # version runs
    seg_row: np.ndarray  # int64 rollout row
    seg_version: np.ndarray  # int64
    seg_tokens: np.ndarray  # int64
    # activations
    act_version: np.ndarray  # int64
    act_outcome: np.ndarray  # int32 index into `outcomes`
    entry_activation: np.ndarray  # int64 activation row
    entry_engine: np.ndarray  # int32 index into `engines`
    entry_transfer_s: np.ndarray  # float64
    entry_pause_s: np.ndarray  # float64
    # vocabularies
    engines: list[str] = field(default_factory=list)
    drop_reasons: list[str] = field(default_factory=list)
    error_kinds: list[str] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)
    unmatched_consumptions: int = 0

    @property
    def rows(self) -> int:
        return len(self.rollout_id)


class _Vocabulary:
    def __init__(self) -> None:
        self.names: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        index = self._index.get(name)
        if index is None:
            index = self._index[name] = len(self.names)
            self.names.append(name)
        return index


# Per-rollout columns (consumed aside: it stays a list, consumption records change it later).
_ROLLOUT_DTYPES: Final = {
    "rollout_id": np.int64, "engine": np.int32, "status": np.int8, "detail": np.int32,
    "dispatched": np.int64, "span_start": np.int64, "span_end": np.int64, "n_versions": np.int32,
    "n_tokens": np.int64}
_RUN_DTYPES: Final = {"seg_row": np.int64, "seg_version": np.int64, "seg_tokens": np.int64}


class ColumnBuilder:
    """Accumulates records (in log order) into `Columns`. Cheap per record: no token blobs
    are kept. Consumption records may come before or after the rollouts they name.

    Rows arrive one record at a time (`add`) or a segment at a time from a sidecar summary
    (`add_summary`); both give the same columns. Rows added one by one wait in lists, which
    become a numpy chunk when a summary's chunk follows or at `build`.
    """

    def __init__(self) -> None:
        self._engines, self._reasons, self._kinds, self._outcomes = (
            _Vocabulary(), _Vocabulary(), _Vocabulary(), _Vocabulary())
        self._rollout: dict[str, list[int]] = {name: [] for name in _ROLLOUT_DTYPES}
        self._seg_row: list[int] = []
        self._seg_version: list[int] = []
        self._seg_tokens: list[int] = []
        self._chunks: list[dict[str, np.ndarray]] = []
        self._rows = 0
        self._consumed: list[int] = []
        self._act_version: list[int] = []
        self._act_outcome: list[int] = []
        self._entry: dict[str, list[Any]] = {name: [] for name in (
            "activation", "engine", "transfer_s", "pause_s")}
        self._row_of: dict[int, int] = {}
        self._pending_consumption: dict[int, int] = {}

    @property
    def rows(self) -> int:
        return self._rows

    def add(self, record: Record) -> None:
        if isinstance(record, RolloutRecord):
            self.add_rollout(record)
        elif isinstance(record, ConsumptionRecord):
            self.add_consumption(record)
        elif isinstance(record, ActivationRecord):
            self.add_activation(record)
        # RunMetaRecord: nothing to count

    def add_rollout(self, rec: RolloutRecord) -> None:
        row = self._rows
        self._rows += 1
        status = rec.status
        if isinstance(status, Dropped):
            detail = self._reasons(status.reason)
        elif isinstance(status, Errored):
            detail = self._kinds(status.kind)
        else:
            detail = -1
        n_tokens = len(rec.completion_token_ids) // 4
        values = int32_values(rec.version_values)
        if values:
            starts = int32_values(rec.version_starts)
            ends = starts[1:] + [n_tokens]
            self._seg_row.extend([row] * len(values))
            self._seg_version.extend(values)
            self._seg_tokens.extend(end - start for start, end in zip(starts, ends))
            first, last = values[0], values[-1]
        else:
            first = last = rec.dispatched_version
        consumed = rec.consumed_step
        if consumed is None:
            consumed = self._pending_consumption.pop(rec.rollout_id, NOT_CONSUMED)
        columns = self._rollout
        columns["rollout_id"].append(rec.rollout_id)
        columns["engine"].append(self._engines(rec.engine_id))
        columns["status"].append(_STATUS_CODE[type(status)])
        columns["detail"].append(detail)
        columns["dispatched"].append(rec.dispatched_version)
        columns["span_start"].append(first)
        columns["span_end"].append(last)
        columns["n_versions"].append(len(values))
        columns["n_tokens"].append(n_tokens)
        self._consumed.append(consumed)
        self._row_of[rec.rollout_id] = row

    def add_consumption(self, rec: ConsumptionRecord) -> None:
        consumed = self._consumed
        for rollout_id in rec.rollout_ids:
            row = self._row_of.get(rollout_id)
            if row is None:
                self._pending_consumption[rollout_id] = rec.step
            elif consumed[row] == NOT_CONSUMED:
                consumed[row] = rec.step

    def add_activation(self, rec: ActivationRecord) -> None:
        row = len(self._act_version)
        self._act_version.append(rec.version)
        self._act_outcome.append(self._outcomes(rec.outcome))
        for engine in rec.engines:
            self._entry["activation"].append(row)
            self._entry["engine"].append(self._engines(engine.engine_id))
            self._entry["transfer_s"].append(engine.transfer_s)
            self._entry["pause_s"].append(engine.pause_s)

    # -- a segment at a time ------------------------------------------------------------------

    def add_summary(self, summary: SegmentSummary) -> None:
        """Add a segment's records from its summary, with the same result as adding them one
        by one: rollout rows go in as numpy chunks, between the consumption and activation
        records in the order the segment held them."""
        part = {name: np.frombuffer(blob, dtype) for name, blob, dtype in summary.arrays()}
        run_end = np.cumsum(part["n_versions"], dtype=np.int64)
        start = 0
        for event in summary.events:
            self._add_rows(summary, part, run_end, start, event.at)
            start = event.at
            self.add(event.record)
        self._add_rows(summary, part, run_end, start, len(part["rollout_id"]))

    def _add_rows(self, summary: SegmentSummary, part: dict[str, np.ndarray], run_end: np.ndarray,
                  lo: int, hi: int) -> None:
        if lo == hi:
            return
        self._flush()
        row0, n = self._rows, hi - lo
        chunk = {name: part[name][lo:hi] for name in _ROLLOUT_DTYPES}
        # Vocabulary codes are the segment's own: map them onto this builder's, registering
        # names in the order the records first used them (as add_rollout would have).
        chunk["engine"] = _recode(chunk["engine"], summary.engines, self._engines)
        status, detail = chunk["status"], chunk["detail"].copy()
        for code, names, vocabulary in ((1, summary.drop_reasons, self._reasons),
                                        (2, summary.error_kinds, self._kinds)):
            rows = status == code
            detail[rows] = _recode(detail[rows], names, vocabulary)
        chunk["detail"] = detail
        runs = slice(int(run_end[lo - 1]) if lo else 0, int(run_end[hi - 1]))
        chunk["seg_row"] = part["seg_row"][runs] + (row0 - lo)
        chunk["seg_version"], chunk["seg_tokens"] = part["seg_version"][runs], part["seg_tokens"][runs]
        self._chunks.append(chunk)
        ids = chunk["rollout_id"].tolist()
        consumed = part["consumed"][lo:hi].tolist()  # the records' own consumed_step, else -1
        if self._pending_consumption:  # consumption records that came before these rollouts
            for i, rollout_id in enumerate(ids):
                if consumed[i] == NOT_CONSUMED:
                    consumed[i] = self._pending_consumption.pop(rollout_id, NOT_CONSUMED)
        self._consumed.extend(consumed)
        self._row_of.update(zip(ids, range(row0, row0 + n)))
        self._rows += n

    def _flush(self) -> None:
        """Turn the rows added one by one into a chunk."""
        if not self._rollout["rollout_id"]:
            return
        chunk = {name: np.array(values, _ROLLOUT_DTYPES[name]) for name, values in self._rollout.items()}
        for name, values in (("seg_row", self._seg_row), ("seg_version", self._seg_version),
                             ("seg_tokens", self._seg_tokens)):
            chunk[name] = np.array(values, _RUN_DTYPES[name])
            values.clear()
        for values in self._rollout.values():
            values.clear()
        self._chunks.append(chunk)

    def build(self) -> Columns:
        self._flush()
        e = self._entry

        def column(name: str, dtype: Any) -> np.ndarray:
            parts = [chunk[name] for chunk in self._chunks]
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        return Columns(
            **{name: column(name, dtype) for name, dtype in (_ROLLOUT_DTYPES | _RUN_DTYPES).items()},
            consumed=np.array(self._consumed, np.int64),
            act_version=np.array(self._act_version, np.int64),
            act_outcome=np.array(self._act_outcome, np.int32),
            entry_activation=np.array(e["activation"], np.int64),
            entry_engine=np.array(e["engine"], np.int32),
            entry_transfer_s=np.array(e["transfer_s"], np.float64),
            entry_pause_s=np.array(e["pause_s"], np.float64),
            engines=list(self._engines.names),
            drop_reasons=list(self._reasons.names),
            error_kinds=list(self._kinds.names),
            outcomes=list(self._outcomes.names),
            unmatched_consumptions=len(self._pending_consumption),
        )


def _recode(codes: np.ndarray, names: list[str], vocabulary: _Vocabulary) -> np.ndarray:
    if len(codes) == 0:
        return codes.astype(np.int32)
    present, first = np.unique(codes, return_index=True)
    table = np.full(len(names), -1, np.int32)
    for code in present[np.argsort(first)]:
        table[code] = vocabulary(names[code])
    return table[codes]


# --------------------------------------------------------------------------------------------
# Sidecar summaries of segments.


class SummaryEvent(msgspec.Struct, array_like=True):
    """A consumption or activation record, after `at` rollouts of its segment."""

    at: int
    record: ConsumptionRecord | ActivationRecord


class SegmentSummary(msgspec.Struct, array_like=True):
    """What ColumnBuilder needs from one segment, without token blobs: its rollouts as
    little-endian column bytes (vocabulary codes index this segment's own name lists), its
    consumption and activation records, and how many records it held."""

    records: int
    columns: dict[str, bytes]
    engines: list[str]
    drop_reasons: list[str]
    error_kinds: list[str]
    events: list[SummaryEvent]
    format: int = 1

    def arrays(self) -> list[tuple[str, bytes, Any]]:
        dtypes = _ROLLOUT_DTYPES | _RUN_DTYPES | {"consumed": np.int64}
        return [(name, self.columns[name], np.dtype(dtypes[name]).newbyteorder("<"))
                for name in dtypes]


def summarize_segment(records: Iterable[Record]) -> SegmentSummary:
    """The summary of one segment's records (in order)."""
    builder, events, count = ColumnBuilder(), [], 0
    for record in records:
        count += 1
        if isinstance(record, RolloutRecord):
            builder.add_rollout(record)  # no consumption seen: `consumed` is its own, else -1
        elif isinstance(record, ConsumptionRecord | ActivationRecord):
            events.append(SummaryEvent(builder.rows, record))
    columns = builder.build()
    local_rows = {"seg_row": columns.seg_row}  # rows of this segment, from 0
    blobs = {name: np.ascontiguousarray(local_rows.get(name, getattr(columns, name)),
                                        np.dtype(dtype).newbyteorder("<")).tobytes()
             for name, dtype in (_ROLLOUT_DTYPES | _RUN_DTYPES | {"consumed": np.int64}).items()}
    return SegmentSummary(count, blobs, columns.engines, columns.drop_reasons,
                          columns.error_kinds, events)


SIDECAR_SUFFIX: Final = ".cols"
_summary_decoder = msgspec.msgpack.Decoder(SegmentSummary)


def sidecar_name(segment: str, size: int, crc: int) -> str:
    """A sidecar is named after the exact bytes it summarizes: used only while the segment
    still has that size and CRC32C (an append, a cut or a flipped byte changes them)."""
    return f"{segment}.{size}.{crc:08x}{SIDECAR_SUFFIX}"


def _sidecars(fs: FileSystem, log_dir: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in fs.list_dir(log_dir):
        if name.endswith(SIDECAR_SUFFIX):
            found.setdefault(name.split(".", 2)[0] + SEGMENT_SUFFIX, []).append(name)
        # (temp files end in .tmp and are ignored)
    return found


def _load_sidecar(fs: FileSystem, log_dir: str, segment: str, data: bytes,
                  candidates: list[str]) -> SegmentSummary | None:
    prefix = f"{segment}.{len(data)}."
    if not any(name.startswith(prefix) for name in candidates):
        return None  # the size alone rules every sidecar out: no need to checksum
    wanted = sidecar_name(segment, len(data), crc32c.crc32c(data))
    if wanted not in candidates:
        return None
    try:
        return _summary_decoder.decode(fs.read_bytes(os.path.join(log_dir, wanted)))
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("replay.sidecar_unreadable", sidecar=wanted, error=str(exc))
        return None


def _write_sidecar(fs: FileSystem, log_dir: str, segment: str, data: bytes,
                   summary: SegmentSummary, stale: list[str]) -> None:
    """Best effort: a log directory we may not write to, or a full disk, costs only speed."""
    write_atomic = getattr(fs, "write_atomic", None)
    if write_atomic is None:
        return
    name = sidecar_name(segment, len(data), crc32c.crc32c(data))
    try:
        write_atomic(os.path.join(log_dir, name), msgspec.msgpack.encode(summary))
        for old in stale:
            if old != name:
                fs.remove(os.path.join(log_dir, old))  # type: ignore[attr-defined]
    except OSError as exc:
        log.warning("replay.sidecar_not_written", segment=segment, error=str(exc))


# --------------------------------------------------------------------------------------------
# Summaries.


def summarize(values: np.ndarray, *, histogram: bool = False) -> dict[str, Any]:
    """count, mean, p50, p90, p99, max (nearest rank), and for integers a value histogram."""
    if len(values) == 0:
        empty: dict[str, Any] = {"count": 0, "mean": None, "p50": None, "p90": None,
                                 "p99": None, "max": None}
        if histogram:
            empty["histogram"] = {}
        return empty
    p50, p90, p99 = np.percentile(values, PERCENTILES, method="inverted_cdf")
    result = {
        "count": len(values),
        "mean": float(values.mean()),
        "p50": _scalar(p50),
        "p90": _scalar(p90),
        "p99": _scalar(p99),
        "max": _scalar(values.max()),
    }
    if histogram:
        result["histogram"] = _value_counts(values)
    return result


def _scalar(value: Any) -> int | float:
    return int(value) if isinstance(value, np.integer) else float(value)


def _value_counts(values: np.ndarray, weights: np.ndarray | None = None) -> dict[str, Any]:
    low, high = int(values.min()), int(values.max())
    if high - low <= 1_000_000:  # bincount is far cheaper than a sort when the range is small
        counts = np.bincount(values - low, weights=weights)
        present = np.flatnonzero(counts)
        keys, totals = present + low, counts[present]
    else:
        keys, inverse = np.unique(values, return_inverse=True)
        totals = np.bincount(inverse, weights=weights)
    cast = int if weights is None else float
    return {str(int(k)): cast(t) for k, t in zip(keys, totals)}


# --------------------------------------------------------------------------------------------
# The statistics.


def rollout_mask(columns: Columns, filters: Filters) -> np.ndarray:
    mask = np.ones(columns.rows, dtype=bool)
    if filters.step_min is not None or filters.step_max is not None:
        mask &= columns.consumed != NOT_CONSUMED
        if filters.step_min is not None:
            mask &= columns.consumed >= filters.step_min
        if filters.step_max is not None:
            mask &= columns.consumed <= filters.step_max
    if filters.engines:
        wanted = [i for i, name in enumerate(columns.engines) if name in filters.engines]
        mask &= np.isin(columns.engine, wanted)
    if filters.statuses:
        mask &= np.isin(columns.status, [STATUS_NAMES.index(s) for s in filters.statuses])
    return mask


def compute_stats(columns: Columns, filters: Filters | None = None) -> dict[str, Any]:
    """Every statistic `inflight stats --json` prints, as JSON-ready values."""
    filters = filters or Filters()
    mask = rollout_mask(columns, filters)
    consumed_rows = mask & (columns.consumed != NOT_CONSUMED)
    staleness = columns.consumed[consumed_rows] - columns.dispatched[consumed_rows]
    in_flight = columns.span_end[consumed_rows] - columns.span_start[consumed_rows]
    with_tokens = mask & (columns.n_tokens > 0)
    multi = columns.n_versions[with_tokens] > 1
    tokens = columns.n_tokens[with_tokens]
    return {
        "filters": msgspec.to_builtins(filters),
        "rollouts": _status_counts(columns, mask),
        "staleness": summarize(staleness, histogram=True),
        "in_flight_lag": summarize(in_flight, histogram=True),
        "queue_lag": summarize(staleness - in_flight, histogram=True),
        "span_lengths": summarize(columns.n_versions[with_tokens].astype(np.int64), histogram=True),
        "multi_version_fraction": _fraction(int(multi.sum()), len(multi)),
        "multi_version_token_fraction": _fraction(int(tokens[multi].sum()), int(tokens.sum())),
        "token_share_by_lag": _token_share_by_lag(columns, consumed_rows),
        "dropped_for_staleness": _dropped_for(columns, mask, DROP_STALE),
        "dropped_by_reason": _detail_counts(columns, mask, 1, columns.drop_reasons),
        "errored_by_kind": _detail_counts(columns, mask, 2, columns.error_kinds),
        "activations": _activation_stats(columns, filters),
        "per_step": _per_step(columns, consumed_rows),
        "unmatched_consumptions": columns.unmatched_consumptions,
    }


def _fraction(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _status_counts(columns: Columns, mask: np.ndarray) -> dict[str, int]:
    counts = np.bincount(columns.status[mask], minlength=len(STATUS_NAMES))
    result = {name: int(counts[i]) for i, name in enumerate(STATUS_NAMES)}
    result["total"] = int(mask.sum())
    return result


def _dropped_for(columns: Columns, mask: np.ndarray, reason: str) -> int:
    if reason not in columns.drop_reasons:
        return 0
    code = columns.drop_reasons.index(reason)
    return int((mask & (columns.status == 1) & (columns.detail == code)).sum())


def _detail_counts(columns: Columns, mask: np.ndarray, status: int, names: list[str]) -> dict[str, int]:
    details = columns.detail[mask & (columns.status == status)]
    counts = np.bincount(details, minlength=len(names)) if len(details) else np.zeros(len(names), int)
    return {name: int(counts[i]) for i, name in enumerate(names) if counts[i]}


def _token_share_by_lag(columns: Columns, consumed_rows: np.ndarray) -> dict[str, float]:
    keep = consumed_rows[columns.seg_row]
    lags = columns.consumed[columns.seg_row[keep]] - columns.seg_version[keep]
    weights = columns.seg_tokens[keep].astype(np.float64)
    total = weights.sum()
    if not total:
        return {}
    return {lag: count / total for lag, count in _value_counts(lags, weights).items()}


def _activation_stats(columns: Columns, filters: Filters) -> dict[str, Any]:
    keep = np.ones(len(columns.act_version), dtype=bool)
    if filters.step_min is not None:
        keep &= columns.act_version >= filters.step_min
    if filters.step_max is not None:
        keep &= columns.act_version <= filters.step_max
    entries = keep[columns.entry_activation] if len(columns.entry_activation) else np.zeros(0, bool)
    if filters.engines:
        wanted = [i for i, name in enumerate(columns.engines) if name in filters.engines]
        entries &= np.isin(columns.entry_engine, wanted)
    outcomes = np.bincount(columns.act_outcome[keep], minlength=len(columns.outcomes))
    return {
        "count": int(keep.sum()),
        "by_outcome": {name: int(outcomes[i]) for i, name in enumerate(columns.outcomes) if outcomes[i]},
        "transfer_s": summarize(columns.entry_transfer_s[entries]),
        "pause_s": summarize(columns.entry_pause_s[entries]),
    }


def _per_step(columns: Columns, consumed_rows: np.ndarray) -> list[dict[str, Any]]:
    steps = columns.consumed[consumed_rows]
    if len(steps) == 0:
        return []
    staleness = steps - columns.dispatched[consumed_rows]
    in_flight = columns.span_end[consumed_rows] - columns.span_start[consumed_rows]
    group, keys = _group_index(steps)
    count = np.bincount(group, minlength=len(keys))
    present = count > 0  # with a dense index some steps may hold no rollout

    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(group, weights=values, minlength=len(keys))[present]

    max_staleness = np.full(len(keys), np.iinfo(np.int64).min)
    np.maximum.at(max_staleness, group, staleness)
    n = count[present]
    series = {
        "step": keys[present].tolist(),
        "rollouts": n.tolist(),
        "tokens": total(columns.n_tokens[consumed_rows]).astype(np.int64).tolist(),
        "staleness_mean": (total(staleness) / n).tolist(),
        "staleness_max": max_staleness[present].tolist(),
        "in_flight_lag_mean": (total(in_flight) / n).tolist(),
        "queue_lag_mean": (total(staleness - in_flight) / n).tolist(),
        "multi_version_fraction": (total(columns.n_versions[consumed_rows] > 1) / n).tolist(),
    }
    names = list(series)
    return [dict(zip(names, row)) for row in zip(*series.values())]


def _group_index(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group of each value, group keys): dense offsets when the range is small (no sort)."""
    low, high = int(values.min()), int(values.max())
    if high - low <= 4 * len(values) + 1024:
        return values - low, np.arange(low, high + 1)
    keys, inverse = np.unique(values, return_inverse=True)
    return inverse, keys


# --------------------------------------------------------------------------------------------
# From the files.


def columns_from_records(records: Iterable[Record]) -> Columns:
    builder = ColumnBuilder()
    for record in records:
        builder.add(record)
    return builder.build()


def stats_from_log(run_dir: str | os.PathLike[str], filters: Filters | None = None, *,
                   lenient: bool = False, fs: FileSystem | None = None,
                   on_record: Callable[[], None] | None = None,
                   sidecars: bool = True) -> dict[str, Any]:
    """Summarize a log, segment by segment. Raises CorruptRecordError / InvalidRecordError
    unless `lenient`. `on_record` is called per record scanned (progress display).

    A segment whose sidecar matches its exact size and CRC32C is read from the sidecar: its
    bytes are still checksummed in full, so it is exactly what was summarized when every
    record in it passed verification. Any other segment is scanned (every frame verified,
    every record decoded and validated) and, if it held no corrupt or invalid record and no
    torn tail, gets a new sidecar. `sidecars=False` (`--verify`) scans every segment.
    """
    reader = LogReader(run_dir, lenient=lenient, fs=fs)
    found = _sidecars(reader.fs, reader.log_dir)
    builder = ColumnBuilder()
    records = 0
    for segment, is_last in reader.segments():
        data = reader.read_segment(segment)
        try:
            summary = (_load_sidecar(reader.fs, reader.log_dir, segment, data, found.get(segment, []))
                       if sidecars else None)
            if summary is None:
                problems = (reader.corrupt_records, reader.invalid_records, reader.torn_tail_bytes)
                summary = summarize_segment(_counted(reader.segment_records(segment, is_last, data),
                                                     on_record))
                if problems == (reader.corrupt_records, reader.invalid_records, reader.torn_tail_bytes):
                    _write_sidecar(reader.fs, reader.log_dir, segment, data, summary,
                                   found.get(segment, []))
            builder.add_summary(summary)
            records += summary.records
        finally:
            reader.release_segment(data)
    stats = compute_stats(builder.build(), filters)
    stats["log"] = {
        "directory": reader.log_dir,
        "records": records,
        "corrupt_records": reader.corrupt_records,
        "invalid_records": reader.invalid_records,
        "torn_tail_bytes": reader.torn_tail_bytes,
    }
    return stats


def _counted(records: Iterator[Record], on_record: Callable[[], None] | None) -> Iterator[Record]:
    if on_record is None:
        return records
    return _each_counted(records, on_record)


def _each_counted(records: Iterator[Record], on_record: Callable[[], None]) -> Iterator[Record]:
    for record in records:
        on_record()
        yield record
