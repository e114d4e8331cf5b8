"""Columnar summary of a replay log: `ColumnBuilder` turns records (one at a time, or a segment
at a time from a sidecar summary) into numpy `Columns`.

Only a compact summary of each rollout is kept (ids, versions, change points, token counts,
the "reward" reward), never the token blobs, so a million rollouts fit in a few tens of
megabytes. What a trainer step did with each rollout (consumed or discarded) follows the one
rule of `replay.query.ledger`.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from replay.query.ledger import CONSUMED, DISCARDED, Claim, Ledger, claims_of
from replay.query.summary import ROLLOUT_DTYPES, RUN_DTYPES  # noqa: F401 - re-exported
from replay.records import (
    FINISH_LENGTH,
    ActivationRecord,
    Completed,
    ConsumptionRecord,
    DiscardRecord,
    Dropped,
    EvalRecord,
    Errored,
    Record,
    RolloutRecord,
    int32_values,
)

if TYPE_CHECKING:
    from replay.query.summary import SegmentSummary

NOT_CONSUMED: Final = -1
NOT_DISCARDED: Final = -1
NO_FINISH_REASON: Final = -1
REWARD_KEY: Final = "reward"  # the reward component per_step's reward_mean averages
_STATUS_CODE: Final = {Completed: 0, Dropped: 1, Errored: 2}


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
    n_tokens: np.ndarray  # int64 sampled completion tokens (an episode's environment tokens aside)
    consumed: np.ndarray  # int64 consuming step, NOT_CONSUMED (-1) if none
    discarded: np.ndarray  # int32 index into `discard_reasons`, NOT_DISCARDED (-1) if not
    reward: np.ndarray  # float64 rewards["reward"]; NaN (internal only) when it has none
    env_tokens: np.ndarray  # int64 completion tokens an episode's environment wrote (0: single turn)
    turns: np.ndarray  # int32 model turns (1 for a single-turn rollout, 0 with no completion)
    # int8: 1 finish reason "length" (cut by max_tokens or max_episode_tokens), 0 another one,
    # NO_FINISH_REASON (-1) none recorded (no engine answered; a log written before the field)
    truncated: np.ndarray
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
    discard_reasons: list[str] = field(default_factory=list)
    unmatched_consumptions: int = 0  # rollout ids consumed by records naming no rollout seen
    unmatched_discards: int = 0  # the same for discards
    invalid_consumptions: int = 0  # later claims on an already consumed/discarded rollout
    evals: list[EvalRecord] = field(default_factory=list)  # held-out evaluations, in log order
    # step -> the mean of each reward component over the rollouts it consumed ("reward/<name>"
    # metrics of its consumption record; absent for logs written before components existed)
    step_components: dict[int, dict[str, float]] = field(default_factory=dict)
    # step -> how long the trainer waited for its batch (the "wait_s" metric of its consumption
    # record: idle since its previous step; absent for a trainer process's first step and in logs
    # written before the metric)
    step_wait_s: dict[int, float] = field(default_factory=dict)

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


class ColumnBuilder:
    """Accumulates records (in log order) into `Columns`. Cheap per record: no token blobs
    are kept. Consumption and discard records may come before or after the rollouts they name.

    Rows arrive one record at a time (`add`) or a segment at a time from a sidecar summary
    (`add_summary`); both give the same columns. Rows added one by one wait in lists, which
    become a numpy chunk when a summary's chunk follows or at `build`. `build` may be called
    again after more records were added (the live statistics do).
    """

    def __init__(self) -> None:
        self._engines, self._reasons, self._kinds, self._outcomes, self._discards = (
            _Vocabulary(), _Vocabulary(), _Vocabulary(), _Vocabulary(), _Vocabulary())
        # Rows added one by one: a tuple each, in ROLLOUT_DTYPES's order (one append a record,
        # not one per column: the live statistics add every record the run writes).
        self._pending_rows: list[tuple] = []
        self._seg_row: list[int] = []
        self._seg_version: list[int] = []
        self._seg_tokens: list[int] = []
        self._chunks: list[dict[str, np.ndarray]] = []
        self._rows = 0
        # Decisions per row, assigned in place when a claim comes: compact typed arrays (a live
        # run's statistics hold a row per rollout for the whole run: a few bytes each, not objects).
        self._consumed = array("q")
        self._discarded = array("i")
        self._act_version: list[int] = []
        self._act_outcome: list[int] = []
        self._entry: dict[str, list[Any]] = {name: [] for name in (
            "activation", "engine", "transfer_s", "pause_s")}
        self._row_of = _RowIndex()
        self._ledger = Ledger()
        self._evals: list[EvalRecord] = []
        self._step_components: dict[int, dict[str, float]] = {}
        self._step_wait_s: dict[int, float] = {}

    @property
    def rows(self) -> int:
        return self._rows

    def add(self, record: Record) -> None:
        if isinstance(record, RolloutRecord):
            self.add_rollout(record)
        elif isinstance(record, ConsumptionRecord | DiscardRecord):
            self.add_claims(record)
            if isinstance(record, ConsumptionRecord):
                components = {k.removeprefix("reward/"): v for k, v in record.metrics.items()
                              if k.startswith("reward/")}
                if components:
                    self._step_components.setdefault(record.step, components)
                if "wait_s" in record.metrics:
                    self._step_wait_s.setdefault(record.step, record.metrics["wait_s"])
        elif isinstance(record, ActivationRecord):
            self.add_activation(record)
        elif isinstance(record, EvalRecord):
            self._evals.append(record)
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
        env_tokens = 0
        values_blob = rec.version_values
        if len(values_blob) == 4 and not rec.environment_spans:  # one version run: the common case
            first = last = int.from_bytes(values_blob, "little", signed=True)
            n_versions = 1
            self._seg_row.append(row)
            self._seg_version.append(first)
            self._seg_tokens.append(n_tokens)
        elif values_blob:
            values = int32_values(values_blob)
            starts = int32_values(rec.version_starts)
            ends = starts[1:] + [n_tokens]
            n_versions = len(values)
            self._seg_row.extend([row] * n_versions)
            self._seg_version.extend(values)
            if rec.environment_spans:  # token statistics count what was sampled
                sampled = np.concatenate([[0], np.cumsum(rec.sampled_mask())])
                env_tokens = n_tokens - int(sampled[-1])
                self._seg_tokens.extend(int(sampled[end] - sampled[start]) for start, end in zip(starts, ends))
            else:
                self._seg_tokens.extend(end - start for start, end in zip(starts, ends))
            first, last = values[0], values[-1]
        else:
            first = last = rec.dispatched_version
            n_versions = 0
        reward = rec.rewards.get(REWARD_KEY) if rec.rewards else None
        finish = rec.finish_reason
        # In ROLLOUT_DTYPES's order.
        self._pending_rows.append((
            rec.rollout_id, self._engines(rec.engine_id), _STATUS_CODE[type(status)], detail,
            rec.dispatched_version, first, last, n_versions, n_tokens - env_tokens,
            math.nan if reward is None else float(reward), env_tokens, rec.turns,
            NO_FINISH_REASON if finish is None else int(finish == FINISH_LENGTH)))
        self._discarded.append(NOT_DISCARDED)
        if self._ledger.pending:  # a claim may have come before this rollout: the ledger decides
            self._consumed.append(NOT_CONSUMED)
            self._apply(row, self._ledger.arrive(rec.rollout_id, rec.consumed_step))
        else:  # nothing pending: its own consumed_step is the only claim so far
            own = rec.consumed_step
            self._consumed.append(NOT_CONSUMED if own is None else own)
        self._row_of.add(rec.rollout_id, row)
        if len(self._pending_rows) >= _FLUSH_ROWS:
            self._flush()

    def add_claims(self, rec: ConsumptionRecord | DiscardRecord) -> None:
        """A consumption or discard record: the first claim on each rollout wins."""
        consumed, discarded, row_of, ledger = self._consumed, self._discarded, self._row_of, self._ledger
        for rollout_id, claim in claims_of(rec):
            row = row_of.get(rollout_id)
            decided = None if row is None else (consumed[row] != NOT_CONSUMED
                                                 or discarded[row] != NOT_DISCARDED)
            if ledger.claim(rollout_id, claim, decided):
                self._apply(row, claim)  # type: ignore[arg-type]

    add_consumption = add_claims

    def _apply(self, row: int, claim: Claim | None) -> None:
        if claim is None:
            return
        if claim.kind == CONSUMED:
            self._consumed[row] = claim.step  # type: ignore[assignment]
        elif claim.kind == DISCARDED:
            self._discarded[row] = self._discards(claim.reason or "")

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
        by one: rollout rows go in as numpy chunks, between the consumption, discard and
        activation records in the order the segment held them."""
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
        chunk = {name: part[name][lo:hi] for name in ROLLOUT_DTYPES}
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
        own = part["consumed"][lo:hi].tolist()  # the records' own consumed_step, else -1
        discarded = [NOT_DISCARDED] * n
        if self._ledger.pending:  # claims that came before these rollouts: the ledger decides
            consumed = [NOT_CONSUMED] * n
            for i, rollout_id in enumerate(ids):
                claim = self._ledger.arrive(rollout_id, None if own[i] == NOT_CONSUMED else own[i])
                if claim is not None:
                    if claim.kind == CONSUMED:
                        consumed[i] = claim.step  # type: ignore[call-overload]
                    else:
                        discarded[i] = self._discards(claim.reason or "")
        else:  # nothing pending: each rollout's own consumed_step is the only claim so far
            consumed = own
        self._consumed.extend(consumed)
        self._discarded.extend(discarded)
        self._row_of.extend(chunk["rollout_id"], row0)
        self._rows += n

    def _flush(self) -> None:
        """Turn the rows added one by one into a chunk."""
        if not self._pending_rows:
            return
        columns = zip(*self._pending_rows, strict=True)
        chunk = {name: np.array(values, dtype) for (name, dtype), values in zip(ROLLOUT_DTYPES.items(), columns,
                                                                               strict=True)}
        for name, values in (("seg_row", self._seg_row), ("seg_version", self._seg_version),
                             ("seg_tokens", self._seg_tokens)):
            chunk[name] = np.array(values, RUN_DTYPES[name])
            values.clear()
        self._pending_rows.clear()
        self._chunks.append(chunk)

    def build(self) -> Columns:
        self._flush()
        e = self._entry
        names = ROLLOUT_DTYPES | RUN_DTYPES
        if len(self._chunks) > 1:  # one chunk from now on: building again costs no concatenation
            self._chunks = [{name: np.concatenate([chunk[name] for chunk in self._chunks])
                             for name in names}]

        def column(name: str, dtype: Any) -> np.ndarray:
            parts = [chunk[name] for chunk in self._chunks]
            return parts[0].astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        return Columns(
            **{name: column(name, dtype) for name, dtype in names.items()},
            consumed=np.frombuffer(self._consumed, np.int64).copy() if self._consumed else np.zeros(0, np.int64),
            discarded=np.frombuffer(self._discarded, np.int32).copy() if self._discarded else np.zeros(0, np.int32),
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
            discard_reasons=list(self._discards.names),
            unmatched_consumptions=self._ledger.unmatched(CONSUMED),
            unmatched_discards=self._ledger.unmatched(DISCARDED),
            invalid_consumptions=self._ledger.invalid,
            evals=list(self._evals),
            step_components=dict(self._step_components),
            step_wait_s=dict(self._step_wait_s),
        )


_FLUSH_ROWS: Final = 4096  # rows added one by one wait in lists (objects) at most this long


class _RowIndex:
    """rollout id -> row, for claims that come after their rollout: a sorted numpy index with a
    small dict of the newest rows in front (a dict of every rollout cost ~100 bytes each, and a
    live run keeps this for the whole run). A rollout id seen twice maps to its last row."""

    _MERGE: Final = 8192

    def __init__(self) -> None:
        self._recent: dict[int, int] = {}
        self._ids = np.zeros(0, np.int64)
        self._rows = np.zeros(0, np.int64)

    def add(self, rollout_id: int, row: int) -> None:
        self._recent[rollout_id] = row
        if len(self._recent) >= self._MERGE:
            self._merge()

    def extend(self, rollout_ids: np.ndarray, first_row: int) -> None:
        for offset, rollout_id in enumerate(rollout_ids.tolist()):
            self._recent[rollout_id] = first_row + offset
        if len(self._recent) >= self._MERGE:
            self._merge()

    def get(self, rollout_id: int) -> int | None:
        row = self._recent.get(rollout_id)
        if row is not None or not len(self._ids):
            return row
        i = int(np.searchsorted(self._ids, rollout_id, side="right")) - 1
        return int(self._rows[i]) if i >= 0 and self._ids[i] == rollout_id else None

    def _merge(self) -> None:
        ids = np.concatenate([self._ids, np.fromiter(self._recent.keys(), np.int64, len(self._recent))])
        rows = np.concatenate([self._rows, np.fromiter(self._recent.values(), np.int64, len(self._recent))])
        order = np.argsort(ids, kind="stable")  # equal ids keep their order: the last row is rightmost
        self._ids, self._rows = ids[order], rows[order]
        self._recent.clear()


def _recode(codes: np.ndarray, names: list[str], vocabulary: _Vocabulary) -> np.ndarray:
    if len(codes) == 0:
        return codes.astype(np.int32)
    present, first = np.unique(codes, return_index=True)
    table = np.full(len(names), -1, np.int32)
    for code in present[np.argsort(first)]:
        table[code] = vocabulary(names[code])
    return table[codes]


def columns_from_records(records: Any) -> Columns:
    builder = ColumnBuilder()
    for record in records:
        builder.add(record)
    return builder.build()
