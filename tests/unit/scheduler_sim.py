"""A small deterministic simulator of a run around the pure scheduler: simulated time, engines,
a trainer, activations. Not a test module itself (tests/unit/test_scheduler_jit.py uses it).

Engines share their generation rate among the rollouts they hold (processor sharing, as a CPU
engine does: `engine_tokens_s` in all, at most `seq_tokens_s` per rollout, so with a large total
a rollout's time does not depend on how many run at once, as on a GPU engine below its batch
limit). A rollout's length is drawn from `lengths` by its id (deterministic). The trainer takes
`step_s` per step and publishes at its end; the newest published version goes live
`activation_s` later (one activation at a time). Every event reaches the scheduler with its
simulated time as `at`, and completions carry their majority version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from orchestrator.config.run import SchedulerConfig
from orchestrator.scheduling.scheduler import (
    Abort,
    Discard,
    Dispatch,
    Finished,
    Scheduler,
    StepDone,
    SubmitBatch,
    Terminal,
    VersionLive,
)
from orchestrator.scheduling.messages import majority_version

EPS = 1e-9


@dataclass(frozen=True)
class World:
    step_s: float
    activation_s: float
    engine_tokens_s: float
    seq_tokens_s: float
    lengths: tuple[int, ...] = (8, 16, 16, 24, 32, 64)
    engines: int = 1
    seed: int = 0

    def length(self, rollout_id: int) -> int:
        # A fixed integer hash (Python's hash of ints is the identity: spread it).
        h = (rollout_id * 2654435761 + self.seed * 97) % 2**32
        return self.lengths[h % len(self.lengths)]

    def round_s(self, batch_size: int) -> float:
        """One generation round: the longest a batch can take on otherwise idle engines."""
        longest = max(self.lengths)
        per_engine = math.ceil(batch_size / self.engines)
        return max(longest / self.seq_tokens_s, per_engine * longest / self.engine_tokens_s)


@dataclass
class _Rollout:
    rollout_id: int
    engine: str
    version: int
    length: int
    done: float = 0.0
    changes: list[tuple[int, int]] = field(default_factory=list)
    aborted: bool = False


@dataclass
class Result:
    waits: list[float]  # trainer idle before each step (step 1: from the start)
    staleness: list[int]  # (step - 1) - dispatched version, per consumed sample
    majority_staleness: list[int]  # (step - 1) - majority version, per consumed sample
    stale_dropped: int  # rollouts dropped or discarded for staleness
    stale_tokens: float  # their tokens (generated before the drop)
    generated_tokens: float
    peak_outstanding: int
    bound: int
    end_s: float


def simulate(config: SchedulerConfig, world: World, max_steps: int) -> Result:
    engines = [f"e{i}" for i in range(world.engines)]
    s = Scheduler(config, engines, max_steps=max_steps)
    now = 0.0
    running: dict[int, _Rollout] = {}
    finished_queue: list[tuple[int, str]] = []  # (rollout id, outcome) to report at `now`
    trainer: tuple[int, float, tuple[int, ...]] | None = None  # (step, ends at, rollout ids)
    trainer_free_since = 0.0
    live, published, activating = 0, 0, None  # activating: (version, live at)
    dispatched: dict[int, int] = {}
    majority: dict[int, int] = {}
    result = Result([], [], [], 0, 0.0, 0.0, 0, s.admission_bound, 0.0)
    tokens_of: dict[int, float] = {}

    def perform(actions) -> None:
        nonlocal trainer
        for a in actions:
            if isinstance(a, Dispatch):
                running[a.rollout_id] = _Rollout(a.rollout_id, a.engine, live, world.length(a.rollout_id),
                                                 changes=[(0, live)])
                dispatched[a.rollout_id] = live
            elif isinstance(a, Abort):
                for rid in a.rollout_ids:
                    r = running.get(rid)
                    if r is not None and not r.aborted:
                        r.aborted = True
                        finished_queue.append((rid, "aborted"))
            elif isinstance(a, SubmitBatch):
                assert trainer is None
                result.waits.append(now - trainer_free_since)
                for rid in a.rollout_ids:
                    result.staleness.append((a.step - 1) - dispatched[rid])
                    result.majority_staleness.append((a.step - 1) - majority[rid])
                trainer = (a.step, now + world.step_s, a.rollout_ids)
            elif isinstance(a, Terminal):
                if a.status == "dropped" and a.reason == "stale":
                    result.stale_dropped += 1
                    result.stale_tokens += tokens_of.get(a.rollout_id, 0.0)
            elif isinstance(a, Discard) and a.reason == "stale":
                result.stale_dropped += len(a.rollout_ids)
                result.stale_tokens += sum(tokens_of.get(rid, 0.0) for rid in a.rollout_ids)
        result.peak_outstanding = max(result.peak_outstanding, s.outstanding)

    def rates() -> dict[int, float]:
        load = {e: 0 for e in engines}
        for r in running.values():
            if not r.aborted:
                load[r.engine] += 1
        return {rid: min(world.seq_tokens_s, world.engine_tokens_s / load[r.engine])
                for rid, r in running.items() if not r.aborted}

    perform(s.start(at=now))
    for _ in range(200_000):
        if s.done_steps >= max_steps:
            break
        if finished_queue:
            rid, outcome = finished_queue.pop(0)
            r = running.pop(rid)
            tokens_of[rid] = r.done if outcome == "aborted" else r.length
            result.generated_tokens += tokens_of[rid]
            if outcome == "completed":
                majority[rid] = majority_version(r.changes, r.length)
            perform(s.handle(Finished(rollout_id=rid, outcome=outcome, at=now, majority_version=majority.get(rid))))
            continue
        rate = rates()
        candidates = [(math.inf, "none", None)]
        for rid, v in rate.items():
            r = running[rid]
            candidates.append((now + (r.length - r.done) / v, "rollout", rid))
        if trainer is not None:
            candidates.append((trainer[1], "step", None))
        if activating is not None:
            candidates.append((activating[1], "live", None))
        when, kind, rid = min(candidates, key=lambda c: (c[0], c[1], c[2] or 0))
        assert when < math.inf, "nothing can happen: the run is stuck"
        for other, v in rate.items():
            running[other].done = min(running[other].length, running[other].done + v * (when - now))
        now = when
        if kind == "rollout":
            running[rid].done = running[rid].length
            finished_queue.append((rid, "completed"))
        elif kind == "step":
            step, _, _ = trainer
            trainer = None
            trainer_free_since = now
            published = step
            if activating is None:
                activating = (published, now + world.activation_s)
            perform(s.handle(StepDone(step=step, version=step, at=now)))
        elif kind == "live":
            live = activating[0]
            for r in running.values():
                r.changes.append((math.floor(r.done + EPS), live))
            activating = (published, now + world.activation_s) if published > live else None
            perform(s.handle(VersionLive(version=live, at=now)))
    assert s.done_steps >= max_steps, "the simulated run did not finish"
    result.end_s = now
    return result
