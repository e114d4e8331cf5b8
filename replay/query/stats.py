"""The statistics `inflight stats` prints and the live `/stats` serves, computed on numpy
`Columns` (see replay.query for the definitions)."""

from __future__ import annotations

from typing import Any, Final

import msgspec
import numpy as np

from replay.query.columns import NO_FINISH_REASON, NOT_CONSUMED, NOT_DISCARDED, Columns
from replay.records import DISCARD_STALE, DROP_STALE, STATUS_NAMES

PERCENTILES: Final = (50, 90, 99)


class Filters(msgspec.Struct, frozen=True):
    """Which rollouts (and activations) the statistics cover.

    step_min/step_max bound the consuming trainer step (inclusive; rollouts no step consumed,
    discarded ones included, are then left out) and the version of activations. Empty
    `engines`/`statuses`: all.
    """

    step_min: int | None = None
    step_max: int | None = None
    engines: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.statuses) - set(STATUS_NAMES)
        if unknown:
            raise ValueError(f"unknown status {sorted(unknown)}; expected {list(STATUS_NAMES)}")


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


def _turns(columns: Columns, mask: np.ndarray) -> dict[str, float | int] | None:
    """Model turns per completed rollout (episodes; 1 for single-turn ones); None when none."""
    turns = columns.turns[mask & (columns.status == 0) & (columns.turns > 0)]
    if not len(turns):
        return None
    return {"mean": float(turns.mean()), "max": int(turns.max())}


def _truncated_share(columns: Columns, mask: np.ndarray) -> float | None:
    """The share of completed rollouts cut by a length limit (finish reason "length"), among
    those whose finish reason is recorded; None when none is (logs written before the field)."""
    known = columns.truncated[mask & (columns.status == 0) & (columns.truncated != NO_FINISH_REASON)]
    return _fraction(int((known == 1).sum()), len(known))


def compute_stats(columns: Columns, filters: Filters | None = None) -> dict[str, Any]:
    """Every statistic `inflight stats --json` prints (but `log`), as JSON-ready values."""
    filters = filters or Filters()
    mask = rollout_mask(columns, filters)
    consumed_rows = mask & (columns.consumed != NOT_CONSUMED)
    staleness = _trainer_version(columns, consumed_rows) - columns.dispatched[consumed_rows]
    in_flight = columns.span_end[consumed_rows] - columns.span_start[consumed_rows]
    with_tokens = mask & (columns.n_tokens > 0)
    multi = columns.n_versions[with_tokens] > 1
    tokens = columns.n_tokens[with_tokens]
    stale_in_flight = _dropped_for(columns, mask, DROP_STALE)
    stale_completed = _discarded_for(columns, mask, DISCARD_STALE)
    stale_rows = _stale_rows(columns, mask)
    stale_tokens = int(columns.n_tokens[stale_rows].sum())
    return {
        "filters": msgspec.to_builtins(filters),
        "rollouts": _status_counts(columns, mask),
        "engines": _per_engine(columns, mask),
        "staleness": summarize(staleness, histogram=True),
        "in_flight_lag": summarize(in_flight, histogram=True),
        "queue_lag": summarize(staleness - in_flight, histogram=True),
        "span_lengths": summarize(columns.n_versions[with_tokens].astype(np.int64), histogram=True),
        "multi_version_fraction": _fraction(int(multi.sum()), len(multi)),
        "multi_version_token_fraction": _fraction(int(tokens[multi].sum()), int(tokens.sum())),
        "token_share_by_lag": _token_share_by_lag(columns, consumed_rows),
        "dropped_for_staleness": stale_in_flight + stale_completed,
        "stale": {"in_flight": stale_in_flight, "completed": stale_completed},
        "dropped_stale_tokens": stale_tokens,
        "dropped_stale_token_share": _fraction(stale_tokens, int(columns.n_tokens[mask].sum())),
        "dropped_stale_by_length": _stale_by_length(columns, mask, stale_rows),
        "dropped_by_reason": _detail_counts(columns.detail[mask & (columns.status == 1)],
                                            columns.drop_reasons),
        "discarded_by_reason": _detail_counts(columns.discarded[mask & (columns.discarded != NOT_DISCARDED)],
                                              columns.discard_reasons),
        "errored_by_kind": _detail_counts(columns.detail[mask & (columns.status == 2)],
                                          columns.error_kinds),
        "turns": _turns(columns, mask),
        "truncated_share": _truncated_share(columns, mask),
        "environment_token_share": _fraction(int(columns.env_tokens[with_tokens].sum()),
                                             int(columns.env_tokens[with_tokens].sum() + tokens.sum())),
        "activations": _activation_stats(columns, filters),
        "per_step": _per_step(columns, consumed_rows),
        "trainer_wait_s": summarize(_waits(columns, filters)),
        "unmatched_consumptions": columns.unmatched_consumptions,
        "unmatched_discards": columns.unmatched_discards,
        "invalid_consumptions": columns.invalid_consumptions,
        "eval": _evals(columns, filters),
    }


def _evals(columns: Columns, filters: Filters) -> list[dict[str, Any]]:
    """One object per held-out evaluation (eval records), within the step filter."""
    out = []
    for e in columns.evals:
        if (filters.step_min is not None and e.step < filters.step_min) or (
                filters.step_max is not None and e.step > filters.step_max):
            continue
        out.append({"step": e.step, "version": e.version, "task": e.task, "k": e.k, "mean_at_k": e.mean_at_k,
                    "pass_at_k": e.pass_at_k, "prompts": e.prompts, "pass_threshold": e.pass_threshold,
                    "components": dict(e.components),
                    # a log written before versions were recorded: one version per evaluation
                    "versions": list(e.versions) or [e.version], "mixed": e.mixed, "due_version": e.due_version})
    return out


def _waits(columns: Columns, filters: Filters) -> np.ndarray:
    """The trainer's wait for each step's batch (seconds), within the step filter."""
    return np.array([w for step, w in sorted(columns.step_wait_s.items())
                     if (filters.step_min is None or step >= filters.step_min)
                     and (filters.step_max is None or step <= filters.step_max)], np.float64)


def _trainer_version(columns: Columns, rows: np.ndarray) -> np.ndarray:
    """The version the trainer held when it ran the consuming step s: s - 1."""
    return columns.consumed[rows] - 1


def _fraction(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _per_engine(columns: Columns, mask: np.ndarray) -> dict[str, dict[str, Any]]:
    """Per engine: rollouts that ended on it, completed ones, completion tokens it sampled, and
    the first and last policy version its tokens came from (None: it sampled no token)."""
    out: dict[str, dict[str, Any]] = {}
    for code, name in enumerate(columns.engines):
        rows = mask & (columns.engine == code)
        n = int(rows.sum())
        if not n:
            continue
        sampled = rows & (columns.n_tokens > 0)
        out[name] = {"rollouts": n, "completed": int((rows & (columns.status == 0)).sum()),
                     "tokens": int(columns.n_tokens[rows].sum()),
                     "first_version": int(columns.span_start[sampled].min()) if sampled.any() else None,
                     "last_version": int(columns.span_end[sampled].max()) if sampled.any() else None}
    return out


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


def _discarded_for(columns: Columns, mask: np.ndarray, reason: str) -> int:
    if reason not in columns.discard_reasons:
        return 0
    code = columns.discard_reasons.index(reason)
    return int((mask & (columns.discarded == code)).sum())


def _stale_rows(columns: Columns, mask: np.ndarray) -> np.ndarray:
    """Rollouts dropped in flight for staleness or completed and discarded as stale."""
    rows = np.zeros(columns.rows, dtype=bool)
    if DROP_STALE in columns.drop_reasons:
        rows |= (columns.status == 1) & (columns.detail == columns.drop_reasons.index(DROP_STALE))
    if DISCARD_STALE in columns.discard_reasons:
        rows |= columns.discarded == columns.discard_reasons.index(DISCARD_STALE)
    return rows & mask


def _stale_by_length(columns: Columns, mask: np.ndarray, stale_rows: np.ndarray) -> list[dict[str, Any]]:
    """Per bucket of completion length (0, then powers of two: 1, 2-3, 4-7, ...): rollouts and
    completion tokens generated, and those dropped or discarded for staleness. A rollout dropped
    in flight counts with the tokens it had when it was cut."""
    lengths = columns.n_tokens[mask]
    if len(lengths) == 0:
        return []
    buckets = np.zeros(len(lengths), np.int64)
    positive = lengths > 0
    buckets[positive] = np.floor(np.log2(lengths[positive])).astype(np.int64) + 1
    dropped = stale_rows[mask]
    width = int(buckets.max()) + 1

    def count(weights: np.ndarray | None = None, where: np.ndarray | None = None) -> list[int]:
        keys = buckets if where is None else buckets[where]
        w = None if weights is None else (weights if where is None else weights[where]).astype(np.float64)
        return np.bincount(keys, weights=w, minlength=width).astype(np.int64).tolist()

    rollouts, tokens = count(), count(lengths)
    dropped_rollouts, dropped_tokens = count(where=dropped), count(lengths, dropped)
    out = []
    for b in range(width):
        if not rollouts[b]:
            continue
        low, high = (0, 0) if b == 0 else (2 ** (b - 1), 2 ** b - 1)
        out.append({"min_tokens": low, "max_tokens": high, "rollouts": rollouts[b], "tokens": tokens[b],
                    "dropped_rollouts": dropped_rollouts[b], "dropped_tokens": dropped_tokens[b],
                    "dropped_token_share": _fraction(dropped_tokens[b], tokens[b])})
    return out


def _detail_counts(details: np.ndarray, names: list[str]) -> dict[str, int]:
    counts = np.bincount(details, minlength=len(names)) if len(details) else np.zeros(len(names), int)
    return {name: int(counts[i]) for i, name in enumerate(names) if counts[i]}


def _token_share_by_lag(columns: Columns, consumed_rows: np.ndarray) -> dict[str, float]:
    keep = consumed_rows[columns.seg_row]
    lags = (columns.consumed[columns.seg_row[keep]] - 1) - columns.seg_version[keep]
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
    staleness = (steps - 1) - columns.dispatched[consumed_rows]
    in_flight = columns.span_end[consumed_rows] - columns.span_start[consumed_rows]
    group, keys = _group_index(steps)
    count = np.bincount(group, minlength=len(keys))
    present = count > 0  # with a dense index some steps may hold no rollout

    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(group, weights=values, minlength=len(keys))[present]

    max_staleness = np.full(len(keys), np.iinfo(np.int64).min)
    np.maximum.at(max_staleness, group, staleness)
    n = count[present]
    reward = columns.reward[consumed_rows]
    has_reward = ~np.isnan(reward)  # NaN: the rollout has no "reward"; never averaged in
    rewarded = total(has_reward)
    reward_sum = total(np.where(has_reward, reward, 0.0))
    series = {
        "step": keys[present].tolist(),
        "rollouts": n.tolist(),
        "tokens": total(columns.n_tokens[consumed_rows]).astype(np.int64).tolist(),
        "staleness_mean": (total(staleness) / n).tolist(),
        "staleness_max": max_staleness[present].tolist(),
        "in_flight_lag_mean": (total(in_flight) / n).tolist(),
        "queue_lag_mean": (total(staleness - in_flight) / n).tolist(),
        "multi_version_fraction": (total(columns.n_versions[consumed_rows] > 1) / n).tolist(),
        "reward_mean": [float(s / c) if c else None for s, c in zip(reward_sum.tolist(),
                                                                     rewarded.tolist())],
    }
    names = list(series)
    rows = [dict(zip(names, row)) for row in zip(*series.values())]
    for row in rows:
        components = columns.step_components.get(row["step"])
        if components:
            row["reward_components"] = dict(components)
        if row["step"] in columns.step_wait_s:
            row["trainer_wait_s"] = columns.step_wait_s[row["step"]]
    return rows


def _group_index(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group of each value, group keys): dense offsets when the range is small (no sort)."""
    low, high = int(values.min()), int(values.max())
    if high - low <= 4 * len(values) + 1024:
        return values - low, np.arange(low, high + 1)
    keys, inverse = np.unique(values, return_inverse=True)
    return inverse, keys
