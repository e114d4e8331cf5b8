"""Staleness statistics over a replay log, computed on numpy columns.

One implementation serves `inflight stats` (offline, from the files: `stats_from_log`) and
the live `/stats` endpoint (the orchestrator feeds each record it appends to a `LiveStats`,
whose `snapshot` equals what `stats_from_log` gives for the same records).

Definitions, for a rollout consumed by trainer step s (step s trains from version s - 1, so
synchronous RL has staleness 0 everywhere):

    staleness      (s - 1) - dispatched_version
    in_flight_lag  last version of the span - first version of the span   (0 for one version)
    queue_lag      staleness - in_flight_lag, so that the two parts add up to the whole
    token lag      (s - 1) - the version a token was sampled under

What a trainer step did with a rollout (consumed, or discarded by a DiscardRecord) follows one
rule (replay.query.ledger): the first claim in log order wins, later ones are counted as
`invalid_consumptions`. A discarded rollout is not consumed. `dropped_for_staleness` counts
both kinds of stale drops: rollouts dropped in flight (status dropped, reason "stale") and
completed rollouts discarded as stale (`stale.in_flight`, `stale.completed`).

Percentiles are nearest-rank: p50 is the smallest value with at least 50% of the values at or
below it (numpy's "inverted_cdf"), so they are always values that occurred. Histograms of
integer lags map each value (as a string, for JSON) to its count.

Modules: `ledger` (the consumption rule), `columns` (ColumnBuilder, Columns), `sidecars`
(segment summaries on disk), `stats` (compute_stats, Filters), `fromlog` (stats_from_log),
`live` (LiveStats); every name is importable from `replay.query`.
"""

from __future__ import annotations

from replay.query.columns import (
    NOT_CONSUMED,
    NOT_DISCARDED,
    REWARD_KEY,
    ColumnBuilder,
    Columns,
    columns_from_records,
)
from replay.query.fromlog import log_section, stats_from_log
from replay.query.ledger import CONSUMED, DISCARDED, Claim, Ledger, claims_of
from replay.query.live import LiveStats
from replay.query.sidecars import (
    SIDECAR_FORMAT,
    SIDECAR_SUFFIX,
    SegmentKey,
    SegmentSummary,
    SummaryEvent,
    decode_sidecar,
    encode_sidecar,
    sidecar_name,
    summarize_segment,
)
from replay.query.stats import (
    PERCENTILES,
    Filters,
    compute_stats,
    rollout_mask,
    summarize,
)

__all__ = [
    "CONSUMED", "DISCARDED", "NOT_CONSUMED", "NOT_DISCARDED", "PERCENTILES", "REWARD_KEY",
    "SIDECAR_FORMAT", "SIDECAR_SUFFIX", "Claim", "ColumnBuilder", "Columns", "Filters", "Ledger",
    "LiveStats", "SegmentKey", "SegmentSummary", "SummaryEvent", "claims_of",
    "columns_from_records", "compute_stats", "decode_sidecar", "encode_sidecar", "log_section",
    "rollout_mask", "sidecar_name", "stats_from_log", "summarize", "summarize_segment",
]
