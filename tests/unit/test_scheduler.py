"""The scheduler's invariants over random event sequences (a pure state machine: no timing).

A small world performs its actions: dispatched rollouts sit on an engine until the test
finishes them (completed, errored, aborted), engines die and come back, the trainer takes a
batch and steps, versions go live some time after they were published, and the run stops.
Events carry a random, increasing `at` (so just-in-time admission paces on them) and completed
rollouts a majority version between their dispatched version and the live one.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.run import SchedulerConfig
from orchestrator.scheduling.scheduler import (
    Abort,
    Discard,
    Dispatch,
    EngineDown,
    EngineUp,
    Finished,
    RestoredGroup,
    RestoredRollout,
    Scheduler,
    StepDone,
    Stop,
    SubmitBatch,
    Terminal,
    TrainerLost,
    VersionLive,
)

ENGINES = ("e0", "e1")


class World:
    def __init__(self, config: SchedulerConfig, max_steps: int = 6) -> None:
        self.config = config
        self.s = Scheduler(config, ENGINES, max_steps=max_steps)
        self.dispatched: dict[int, Dispatch] = {}
        self.terminal: dict[int, Terminal] = {}
        self.consumed: dict[int, int] = {}
        self.discarded: dict[int, str] = {}
        self.completed: set[int] = set()
        self.inflight: list[int] = []
        self.aborted: set[int] = set()  # abort sent, not yet finished
        self.batch: SubmitBatch | None = None
        self.published: list[int] = [0]
        self.clock = 0.0
        self.majority: dict[int, int] = {}
        self.apply(self.s.start(at=self.clock))

    def at(self, n: int) -> float:
        self.clock += (n % 7) * 0.5
        return self.clock

    def apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, Dispatch):
                assert a.rollout_id not in self.dispatched, "a rollout id was reused"
                assert a.engine in ENGINES and a.engine not in self.s.down
                self.dispatched[a.rollout_id] = a
                self.inflight.append(a.rollout_id)
            elif isinstance(a, Terminal):
                assert a.rollout_id in self.dispatched, "terminal for a rollout never dispatched"
                assert a.rollout_id not in self.terminal, "two terminal records for one rollout"
                self.terminal[a.rollout_id] = a
                if a.status == "completed":
                    self.completed.add(a.rollout_id)
            elif isinstance(a, Abort):
                for rid in a.rollout_ids:
                    assert self.dispatched[rid].engine == a.engine
                    self.aborted.add(rid)
            elif isinstance(a, SubmitBatch):
                assert self.batch is None, "a second batch while the trainer holds one"
                assert len(a.group_ids) == self.config.batch_groups
                assert len(a.rollout_ids) == self.config.batch_size
                for rid in a.rollout_ids:
                    assert rid in self.completed, "a batch holds a rollout that did not complete"
                    assert rid not in self.consumed and rid not in self.discarded
                    staleness = (a.step - 1) - self.dispatched[rid].version
                    assert staleness >= 0, staleness
                    if self.config.staleness_by == "majority":
                        staleness = (a.step - 1) - self.majority[rid]
                    assert staleness <= self.config.max_off_policy_steps, staleness
                    self.consumed[rid] = a.step
                self.batch = a
            elif isinstance(a, Discard):
                for rid in a.rollout_ids:
                    assert rid in self.completed
                    assert rid not in self.consumed or a.reason == "trainer_lost"
                    assert rid not in self.discarded, "discarded twice"
                    self.discarded[rid] = a.reason
            else:
                raise AssertionError(a)
        assert self.s.outstanding <= self.s.admission_bound
        assert self.s.inflight <= self.config.max_inflight
        # the incremental bookkeeping agrees with a full count
        groups = self.s.groups.values()
        assert self.s.outstanding == sum(len(g.live_members()) for g in groups)
        assert self.s._waiting == sum(g.state in ("open", "complete") for g in groups)
        assert set(self.s._complete) == {g.group_id for g in groups if g.state == "complete"}

    def finish(self, index: int, outcome: str) -> None:
        if not self.inflight:
            return
        rid = self.inflight.pop(index % len(self.inflight))
        if outcome == "aborted" and rid not in self.aborted and rid % 3:
            outcome = "completed"  # mostly, only rollouts we aborted come back aborted
        self.aborted.discard(rid)
        version = self.dispatched[rid].version
        self.majority[rid] = version + index % (self.s.live - version + 1)
        self.apply(self.s.handle(Finished(rollout_id=rid, outcome=outcome, kind="engine_died", at=self.at(index),
                                          majority_version=self.majority[rid])))

    def step(self) -> None:
        if self.batch is None:
            return
        step, self.batch = self.batch.step, None
        self.published.append(step)
        self.apply(self.s.handle(StepDone(step=step, version=step, at=self.at(step))))

    def activate(self) -> None:
        newer = [v for v in self.published if v > self.s.live]
        if newer:
            self.apply(self.s.handle(VersionLive(version=newer[0], at=self.at(newer[0]))))


events = st.lists(st.tuples(st.sampled_from(["complete", "complete", "complete", "error", "abort", "step",
                                             "activate", "down", "up", "lost"]),
                            st.integers(0, 1000)), max_size=250)
configs = st.builds(SchedulerConfig, group_size=st.integers(2, 4), batch_groups=st.integers(1, 3),
                    max_off_policy_steps=st.integers(0, 3), max_inflight=st.integers(8, 24),
                    max_retries=st.integers(0, 2), mode=st.sampled_from(["async", "sync"]),
                    admission=st.sampled_from(["just_in_time", "eager"]),
                    staleness_by=st.sampled_from(["dispatch", "majority"]))


@settings(max_examples=300, deadline=None)
@given(config=configs, script=events)
def test_invariants_hold_over_random_event_sequences(config, script):
    world = World(config)
    for kind, n in script:
        if kind == "complete":
            world.finish(n, "completed")
        elif kind == "error":
            world.finish(n, "errored")
        elif kind == "abort":
            world.finish(n, "aborted")
        elif kind == "step":
            world.step()
        elif kind == "activate":
            world.activate()
        elif kind == "down":
            world.apply(world.s.handle(EngineDown(engine=ENGINES[n % 2])))
        elif kind == "up":
            world.apply(world.s.handle(EngineUp(engine=ENGINES[n % 2])))
        elif kind == "lost" and world.batch is not None:
            step, world.batch = world.batch.step, None
            world.apply(world.s.handle(TrainerLost(step=step)))
    # Shut down: every rollout still in flight ends (aborted, or it finished first).
    world.apply(world.s.handle(Stop()))
    while world.inflight:
        world.finish(0, "aborted")
    assert set(world.terminal) == set(world.dispatched), "a dispatched rollout has no terminal record"
    assert world.s.inflight == 0
    assert not set(world.consumed) & {r for r, why in world.discarded.items() if why != "trainer_lost"}


def run_to_the_end(config: SchedulerConfig, max_steps: int, activation_lag: int = 0) -> World:
    """Every rollout completes in dispatch order; the trainer steps whenever it holds a batch;
    each published version goes live `activation_lag` trainer steps later."""
    world = World(config, max_steps=max_steps)
    for _ in range(10_000):
        if world.s.done_steps >= max_steps:
            break
        if world.batch is not None:
            world.step()
            target = world.s.done_steps - activation_lag
            while world.s.live < target:
                world.apply(world.s.handle(VersionLive(version=world.s.live + 1)))
        elif world.inflight:
            world.finish(0, "completed")
        else:
            world.activate()
    assert world.s.done_steps == max_steps
    return world


def staleness_of(world: World) -> list[int]:
    return [(step - 1) - world.dispatched[rid].version for rid, step in world.consumed.items()]


def test_a_synchronous_run_has_staleness_zero():
    world = run_to_the_end(SchedulerConfig(group_size=4, batch_groups=2, mode="sync"), max_steps=5)
    assert set(staleness_of(world)) == {0}
    assert not world.discarded


def test_an_async_run_overlaps_and_stays_within_the_bound():
    config = SchedulerConfig(group_size=4, batch_groups=2, max_off_policy_steps=2, max_inflight=64)
    world = run_to_the_end(config, max_steps=8)
    lags = staleness_of(world)
    assert max(lags) > 0, "async mode never used an older version"
    assert max(lags) <= 2
    # In steady state nothing is dropped for staleness.
    assert not [r for r, why in world.discarded.items() if why == "stale"]


def test_slow_activation_drops_stale_groups_instead_of_training_on_them():
    config = SchedulerConfig(group_size=2, batch_groups=1, max_off_policy_steps=0, max_inflight=8)
    world = World(config, max_steps=4)
    world.finish(0, "completed")
    world.finish(0, "completed")
    world.step()  # step 1 done, version 1 published but not live
    # groups dispatched at version 0 cannot feed step 2 ((2-1) - 0 > 0): dropped, none admitted
    assert world.batch is None
    assert all(why == "stale" for why in world.discarded.values())
    assert not world.inflight or all(rid in world.aborted for rid in world.inflight)
    world.apply(world.s.handle(VersionLive(version=1)))
    assert [world.dispatched[r].version for r in world.inflight if r not in world.aborted] == [1, 1]


def test_errored_rollouts_are_replaced_in_their_group_then_the_group_is_dropped():
    config = SchedulerConfig(group_size=2, batch_groups=1, max_retries=1, max_inflight=2)
    world = World(config, max_steps=2)
    first = world.inflight[0]
    world.finish(0, "errored")
    replacement = world.inflight[-1]
    assert world.dispatched[replacement].group_id == world.dispatched[first].group_id
    world.finish(world.inflight.index(replacement), "errored")  # second failure: past max_retries
    assert world.terminal[first].status == "errored"
    assert world.inflight and all(rid in world.aborted for rid in world.inflight[:1])


def test_dispatch_prefers_the_least_loaded_serving_engine_and_skips_a_dead_one():
    world = World(SchedulerConfig(group_size=4, batch_groups=1, max_inflight=4), max_steps=3)
    engines = [world.dispatched[r].engine for r in world.inflight]
    assert engines.count("e0") == engines.count("e1") == 2
    world.apply(world.s.handle(EngineDown(engine="e0")))
    for _ in range(2):
        world.finish(0, "errored")
    assert all(world.dispatched[r].engine == "e1" for r in world.inflight[-2:])


def test_a_late_abort_of_a_finished_rollout_is_harmless():
    config = SchedulerConfig(group_size=2, batch_groups=1, max_inflight=2)
    world = World(config, max_steps=2)
    world.apply(world.s.handle(Stop()))
    rid = world.inflight.pop(0)
    world.apply(world.s.handle(Finished(rollout_id=rid, outcome="completed")))
    world.apply(world.s.handle(Finished(rollout_id=rid, outcome="aborted")))  # the abort's late echo
    assert world.terminal[rid].status == "completed"


def test_restored_groups_are_refilled_with_new_ids_and_consumed():
    config = SchedulerConfig(group_size=2, batch_groups=1, max_inflight=4)
    s = Scheduler(config, ENGINES, max_steps=3, done_steps=1, live_version=1, next_group_id=5)
    s.restore([RestoredGroup(group_id=4, version=1, completed=(RestoredRollout(rollout_id=40000, version=1),),
                             dispatched=2)])
    actions = s.start()
    refill = [a for a in actions if isinstance(a, Dispatch) and a.group_id == 4]
    assert [a.rollout_id for a in refill] == [40002]
    assert all(a.group_id >= 5 for a in actions if isinstance(a, Dispatch) and a.group_id != 4)
    batch = s.handle(Finished(rollout_id=40002, outcome="completed"))
    submit = [a for a in batch if isinstance(a, SubmitBatch)]
    assert submit and submit[0].step == 2 and set(submit[0].rollout_ids) == {40000, 40002}


@pytest.mark.parametrize("bad", [dict(group_size=1), dict(max_inflight=2, group_size=4), dict(max_retries=-1),
                                 dict(admission="lazy"), dict(staleness_by="median")])
def test_bad_scheduler_settings_are_named(bad):
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        SchedulerConfig(**bad).validate()
    assert info.value.field.startswith("scheduler.")
