"""The rollouts an analysis replays, read from the log once: tokens, sampled logprobs, per-token
versions, and what the run's other records say about them (consuming step, activations, the
trainer's own log-ratio statistics, the run's meta record)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from replay.log import LogReader
from replay.records import (
    ACTIVATED,
    ActivationRecord,
    ConsumptionRecord,
    DiscardRecord,
    RolloutRecord,
    RunMetaRecord,
)

RAW, PROCESSED = "raw_logprobs", "processed_logprobs"


@dataclass
class Rollout:
    rollout_id: int
    status: str
    prompt: np.ndarray  # int32
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, as sampled
    versions: np.ndarray  # int32, per token
    dispatched_version: int
    kv_carried: bool
    temperature: float  # what the recorded logprobs were scaled by (1.0 for raw logprobs)
    consumed_step: int | None = None
    serving_precision: str = ""
    # Per token: sampled by the model (an episode's environment tokens are not, and have no
    # logprob: NaN); None: every token was sampled.
    sampled: np.ndarray | None = None

    def sampled_versions(self) -> np.ndarray:
        return self.versions if self.sampled is None else self.versions[self.sampled]

    @property
    def multi_version(self) -> bool:
        return len(self.versions) > 0 and int(self.versions[0]) != int(self.versions[-1])


@dataclass
class StepTrainerStats:
    """What trainer step `step` recorded about its own logprobs against the sampled ones."""

    step: int
    rollout_ids: list[int]
    log_ratio_mean: np.ndarray | None
    log_ratio_max_abs: np.ndarray | None


@dataclass
class Dataset:
    run_dir: str
    meta: RunMetaRecord | None = None
    rollouts: list[Rollout] = field(default_factory=list)
    activated: list[int] = field(default_factory=list)  # versions activated, in log order
    kv_policies: set[str] = field(default_factory=set)  # of the activations
    steps: list[StepTrainerStats] = field(default_factory=list)
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # every rollout: (first, last) version
    precisions: set[str] = field(default_factory=set)  # serving precisions of the rollouts
    logprobs_modes: set[str] = field(default_factory=set)
    rollouts_seen: int = 0  # rollout records in the log, before filters
    rollouts_without_tokens: int = 0
    corrupt_records: int = 0
    invalid_records: int = 0

    @property
    def latest_version(self) -> int:
        """The newest version activated in the log (0 when none was)."""
        return max(self.activated, default=0)

    def by_id(self) -> dict[int, Rollout]:
        return {r.rollout_id: r for r in self.rollouts}


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """'A:B' (inclusive, either end open: 'A:' or ':B'), or 'A' for one step."""
    if not text:
        return None, None
    if ":" not in text:
        step = int(text)
        return step, step
    low, high = text.split(":", 1)
    return (int(low) if low.strip() else None), (int(high) if high.strip() else None)


def _temperature(record: RolloutRecord) -> float:
    mode = record.identity.logprobs_mode
    temperature = float(record.sampling.temperature)
    return temperature if mode == PROCESSED and temperature > 0 else 1.0


def load_dataset(run_dir: str | os.PathLike[str], *, limit: int | None = None,
                 steps: tuple[int | None, int | None] = (None, None), lenient: bool = False,
                 on_record: Callable[[], None] | None = None) -> Dataset:
    """Read the log: rollouts with at least one completion token (any status), their consuming
    step by the log's one rule (the first claim in log order wins; see replay.query.ledger),
    filtered to consuming steps in `steps` (inclusive; a rollout with no consuming step is
    left out when a range is given), then the first `limit` of them in log order."""
    reader = LogReader(run_dir, lenient=lenient)
    data = Dataset(run_dir=os.fspath(run_dir))
    claimed: dict[int, int | None] = {}  # rollout id -> consuming step (None: discarded)
    rollouts: list[Rollout] = []
    for record in reader:
        if on_record is not None:
            on_record()
        if isinstance(record, RolloutRecord):
            data.rollouts_seen += 1
            data.spans.setdefault(record.rollout_id, record.version_span)
            data.precisions.add(record.identity.serving_precision)
            data.logprobs_modes.add(record.identity.logprobs_mode or "unknown")
            if record.consumed_step is not None and record.rollout_id not in claimed:
                claimed[record.rollout_id] = record.consumed_step
            if record.num_completion_tokens == 0:
                data.rollouts_without_tokens += 1
                continue
            rollouts.append(Rollout(
                rollout_id=record.rollout_id, status=record.status_name,
                prompt=record.prompt_tokens(), tokens=record.completion_tokens(),
                logprobs=record.logprobs(), versions=record.expand_versions(),
                dispatched_version=record.dispatched_version,
                kv_carried=record.kv_carried_across_versions, temperature=_temperature(record),
                serving_precision=record.identity.serving_precision,
                sampled=record.sampled_mask() if record.environment_spans else None))
        elif isinstance(record, ConsumptionRecord):
            for rollout_id in record.rollout_ids:
                claimed.setdefault(rollout_id, record.step)
            data.steps.append(StepTrainerStats(record.step, list(record.rollout_ids),
                                               record.values("log_ratio_mean"),
                                               record.values("log_ratio_max_abs")))
        elif isinstance(record, DiscardRecord):
            for rollout_id in record.rollout_ids:
                claimed.setdefault(rollout_id, None)
        elif isinstance(record, ActivationRecord):
            if record.outcome == ACTIVATED:
                data.activated.append(record.version)
            if record.kv_policy:
                data.kv_policies.add(record.kv_policy)
        elif isinstance(record, RunMetaRecord) and data.meta is None:
            data.meta = record
    data.corrupt_records, data.invalid_records = reader.corrupt_records, reader.invalid_records
    low, high = steps
    for rollout in rollouts:
        rollout.consumed_step = claimed.get(rollout.rollout_id)
        if low is not None or high is not None:
            step = rollout.consumed_step
            if step is None or (low is not None and step < low) or (high is not None and step > high):
                continue
        data.rollouts.append(rollout)
        if limit is not None and len(data.rollouts) >= limit:
            break
    return data
