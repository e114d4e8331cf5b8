"""What the run loop keeps per rollout (`InFlight`) and the records it builds from what it observed
(consumption, a rollout lost in a crash, reward components): small pure helpers, apart from the
loop that performs the scheduler's actions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.run.recording import RolloutContext, build_rollout_record
from orchestrator.run.resume import CRASHED, JournalEntry
from orchestrator.scheduling import scheduler as sch
from orchestrator.trainer.link import StepDone


@dataclass
class InFlight:
    """One rollout, from its dispatch until it is settled (consumed or discarded) or ends without
    a sample: everything the loop holds for it, dropped in one place (`RunLoop._forget`)."""

    dispatch: sch.Dispatch | None  # None: restored from a crashed run's log
    dispatched_at: float
    ctx: RolloutContext | None = None  # ids, prompt tokens, engine: built when it is journalled
    completion: object | None = None  # its FleetCompletion, once generation ended
    rewards: dict[str, float] | None = None  # its scores, once completed and scored
    record: object | None = None  # its completed RolloutRecord: the trainer's sample comes from its blobs



def settled(completion):
    """What the loop keeps of a completed rollout's FleetCompletion once its record holds the
    tokens and logprobs (the record's blobs become the trainer's sample): the versions only."""
    if completion is None:
        return None
    completion.token_ids, completion.logprobs, completion.prompt_token_ids = [], [], []
    return completion


def request_id(rollout_id: int) -> str:
    return f"rollout-{rollout_id}"


def reward_components(scores: list[dict[str, float] | None]) -> dict[str, float]:
    """The mean of each reward component (every score key but "reward") over the rollouts that
    have it; a component no rollout reported is absent."""
    sums: dict[str, list[float]] = {}
    for score in scores:
        for name, value in (score or {}).items():
            if name != "reward":
                sums.setdefault(name, []).append(float(value))
    return {name: sum(values) / len(values) for name, values in sums.items()}


def consumption_record(m: StepDone, components: dict[str, float] | None = None):
    from replay.records import ConsumptionRecord

    metrics = {k: float(v) for k, v in m.metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    metrics.update({f"reward/{name}": value for name, value in (components or {}).items()})
    return ConsumptionRecord(step=m.step, rollout_ids=list(m.rollout_ids), advantages=m.advantages,
                             log_ratio_mean=m.log_ratio_mean, log_ratio_max_abs=m.log_ratio_max_abs,
                             reward_mean=m.reward_mean, loss=m.loss, version=m.version, metrics=metrics)


def crashed_record(entry: JournalEntry, prompt, *, identity, sampling):
    """The terminal record of a rollout that was in flight when the orchestrator died: what the
    journal knows (ids, engine, dispatched version and time), no tokens, nothing invented."""
    ctx = RolloutContext(entry.rollout_id, entry.group_id, prompt.prompt_id, tuple(prompt.token_ids), entry.at,
                         entry.version, entry.engine)
    return build_rollout_record(ctx, sch.Terminal(rollout_id=entry.rollout_id, status="dropped", reason=CRASHED),
                                None, None, identity=identity, sampling=sampling)
