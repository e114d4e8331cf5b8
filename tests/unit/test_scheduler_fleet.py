"""The scheduler with a fleet that changes under it (issue 31): engines join (`EngineUp` of an
engine it does not know), go down, leave (`EngineLeft`), have capacities (max_num_seqs), and a
minimum number of serving engines gates admission. Pure: events in, actions out.

A small world performs the actions and keeps its own account of the fleet (which engines serve,
which rollouts each holds since it last joined), so the scheduler is checked against a count it
did not make.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.run import SchedulerConfig
from orchestrator.scheduling.scheduler import (
    ROLLOUT_ID_STRIDE,
    Abort,
    Discard,
    Dispatch,
    EngineDown,
    EngineLeft,
    EngineUp,
    Finished,
    Scheduler,
    SchedulerError,
    StepDone,
    Stop,
    SubmitBatch,
    Terminal,
    VersionLive,
)


class FleetWorld:
    def __init__(self, config: SchedulerConfig, engines=("e0", "e1"), max_steps: int = 50, **kwargs) -> None:
        self.config = config
        self.s = Scheduler(config, engines, max_steps=max_steps, **kwargs)
        self.serving: set[str] = set(engines)  # the world's own account
        self.known: set[str] = set(engines)
        self.on: dict[str, set[int]] = {e: set() for e in engines}  # rollouts dispatched since it joined
        self.joined = list(engines)  # known engines, in the order they (last) joined
        self.dispatched: dict[int, Dispatch] = {}
        self.terminal: dict[int, Terminal] = {}
        self.consumed: dict[int, int] = {}
        self.discarded: dict[int, str] = {}
        self.inflight: list[int] = []
        self.aborted: set[int] = set()
        self.batch: SubmitBatch | None = None
        self.published = [0]
        self.groups_seen: set[int] = set()
        self.admitted_while_short = 0
        self.apply(self.s.start())

    def apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, Dispatch):
                assert a.rollout_id not in self.dispatched, "a rollout id was reused"
                assert a.engine in self.serving, f"dispatch to {a.engine}, which does not serve"
                # the lowest rollouts in flight / capacity; ties to the engine that joined first
                load = {e: len(self.on[e] & set(self.inflight)) / self.s.placement.capacity[e] for e in self.serving}
                best = min(load.values())
                assert a.engine == next(e for e in self.joined if e in self.serving and load[e] == best)
                if a.group_id not in self.groups_seen:
                    self.groups_seen.add(a.group_id)
                    if len(self.serving) < self.s.min_engines:
                        self.admitted_while_short += 1
                self.dispatched[a.rollout_id] = a
                self.on[a.engine].add(a.rollout_id)
                self.inflight.append(a.rollout_id)
            elif isinstance(a, Terminal):
                assert a.rollout_id in self.dispatched, "terminal for a rollout never dispatched"
                assert a.rollout_id not in self.terminal, "two terminal records for one rollout"
                self.terminal[a.rollout_id] = a
            elif isinstance(a, Abort):
                for rid in a.rollout_ids:
                    assert self.dispatched[rid].engine == a.engine
                    self.aborted.add(rid)
            elif isinstance(a, SubmitBatch):
                assert self.batch is None
                for rid in a.rollout_ids:
                    assert self.terminal[rid].status == "completed"
                    staleness = (a.step - 1) - self.dispatched[rid].version
                    assert 0 <= staleness <= self.config.max_off_policy_steps
                    self.consumed[rid] = a.step
                self.batch = a
            elif isinstance(a, Discard):
                for rid in a.rollout_ids:
                    assert rid not in self.discarded
                    self.discarded[rid] = a.reason
        assert self.s.outstanding <= self.s.admission_bound
        assert self.s.inflight <= self.config.max_inflight
        # The scheduler's per-engine count is the world's: rollouts in flight dispatched to the
        # engine since it last joined (one that left and came back starts from nothing).
        in_flight = set(self.inflight)
        assert self.s.engines == {e: len(self.on[e] & in_flight) for e in self.known}
        assert self.s.down == self.known - self.serving

    # -- the fleet changes -------------------------------------------------------------------
    def up(self, engine: str, capacity: int | None = None) -> None:
        if engine not in self.known:
            self.known.add(engine)
            self.on[engine] = set()
            self.joined.append(engine)
        self.serving.add(engine)
        self.apply(self.s.handle(EngineUp(engine=engine, capacity=capacity)))

    def down(self, engine: str) -> None:
        if engine in self.known:
            self.serving.discard(engine)
        self.apply(self.s.handle(EngineDown(engine=engine)))

    def left(self, engine: str) -> None:
        if engine in self.known:
            self.joined.remove(engine)
        self.known.discard(engine)
        self.serving.discard(engine)
        self.on.pop(engine, None)
        self.apply(self.s.handle(EngineLeft(engine=engine)))

    # -- rollouts and the trainer ------------------------------------------------------------
    def finish(self, rid: int, outcome: str, kind: str = "") -> None:
        self.inflight.remove(rid)
        self.aborted.discard(rid)
        self.apply(self.s.handle(Finished(rollout_id=rid, outcome=outcome, kind=kind)))

    def finish_at(self, index: int, outcome: str) -> None:
        if not self.inflight:
            return
        rid = self.inflight[index % len(self.inflight)]
        if outcome == "aborted" and rid not in self.aborted:
            outcome = "completed"
        self.finish(rid, outcome, "engine_died" if outcome == "errored" else "")

    def step(self) -> None:
        if self.batch is None:
            return
        step, self.batch = self.batch.step, None
        self.published.append(step)
        self.apply(self.s.handle(StepDone(step=step, version=step)))

    def activate(self) -> None:
        newer = [v for v in self.published if v > self.s.live]
        if newer:
            self.apply(self.s.handle(VersionLive(version=newer[0])))

    def on_engine(self, engine: str) -> list[int]:
        return [rid for rid in self.inflight if self.dispatched[rid].engine == engine]


def config(**kw) -> SchedulerConfig:
    base = dict(group_size=2, batch_groups=2, max_off_policy_steps=2, max_inflight=8)
    return SchedulerConfig(**(base | kw))


def test_an_engine_that_joins_mid_run_gets_dispatches():
    world = FleetWorld(config(), engines=("e0",))
    assert {world.dispatched[r].engine for r in world.inflight} == {"e0"}
    world.up("e9", capacity=4)
    assert world.s.placement.capacity["e9"] == 4
    for _ in range(8):  # completions make room; the next dispatches go to the idle newcomer first
        world.finish_at(0, "completed")
        world.step()
        world.activate()
    assert world.on["e9"], "an engine that joined got no rollout"
    assert world.s.engines["e9"] == len(world.on_engine("e9"))


def test_an_engine_that_joins_without_a_capacity_gets_the_mean():
    s = Scheduler(config(), ["a", "b"], max_steps=2, capacities={"a": 2, "b": 6})
    s.handle(EngineUp(engine="c"))
    assert s.placement.capacity["c"] == 4
    s.handle(EngineUp(engine="a", capacity=3))  # known: its capacity changes, nothing else
    assert s.placement.capacity["a"] == 3 and list(s.engines) == ["a", "b", "c"]


def test_a_group_whose_rollouts_were_on_a_lost_engine_is_completed_on_the_others():
    world = FleetWorld(config(group_size=4, batch_groups=1, max_inflight=4, max_retries=4))
    lost = world.on_engine("e0")
    assert lost, "nothing was dispatched to e0"
    world.down("e0")
    for rid in lost:
        world.finish(rid, "errored", "engine_died")
    assert all(world.dispatched[r].engine == "e1" for r in world.inflight)
    while world.inflight:
        world.finish(world.inflight[0], "completed")
    assert world.batch is not None, "the group was not completed on the engine left"
    group = world.batch.group_ids[0]
    assert {world.dispatched[r].group_id for r in world.batch.rollout_ids} == {group}
    assert all(world.terminal[r].status == "errored" for r in lost)


def test_a_drained_engine_receives_nothing_more_and_its_late_finish_is_handled():
    world = FleetWorld(config(group_size=4, batch_groups=1, max_inflight=8))
    late = world.on_engine("e1")
    assert late
    world.down("e1")
    world.left("e1")
    assert "e1" not in world.s.engines and "e1" not in world.s.down
    world.finish(late[0], "completed")  # ended after its engine left: no KeyError, counted once
    assert world.terminal[late[0]].status == "completed"
    for _ in range(20):
        world.finish_at(0, "errored")
    assert all(world.dispatched[r].engine == "e0" for r in world.inflight)
    # A namesake joins: its count starts from nothing, the old rollouts' ends are not its own.
    world.up("e1")
    for rid in [r for r in late if r in world.inflight]:
        world.finish(rid, "completed")
    assert world.s.engines["e1"] == len(world.on_engine("e1")) >= 0


def test_capacity_two_to_one_gives_about_two_to_one_dispatches():
    rng = random.Random(7)
    world = FleetWorld(config(group_size=4, batch_groups=2, max_off_policy_steps=1000, max_inflight=24, admission="eager"),
                       engines=("big", "small"), max_steps=10_000, capacities={"big": 16, "small": 8})
    for _ in range(3000):
        world.finish(world.inflight[rng.randrange(len(world.inflight))], "completed")
        world.step()
        world.activate()
    counts = {e: sum(d.engine == e for d in world.dispatched.values()) for e in ("big", "small")}
    assert 1.8 <= counts["big"] / counts["small"] <= 2.2, counts


def test_with_equal_capacities_ties_go_to_the_engine_added_first():
    s = Scheduler(config(group_size=3, batch_groups=1, max_inflight=3), ["x", "y", "z"], max_steps=2)
    assert [a.engine for a in s.start() if isinstance(a, Dispatch)] == ["x", "y", "z"]


def test_min_engines_pauses_admission_and_names_why_then_resumes():
    world = FleetWorld(config(group_size=2, batch_groups=1, max_inflight=8, max_retries=5),
                       engines=("e0", "e1"), min_engines=2)
    assert world.s.admission_paused is None
    world.down("e1")
    assert world.s.admission_paused == "admission paused: 1 engine serves, fleet.min_engines = 2"
    groups = set(world.groups_seen)
    # Refills of groups already admitted go on, on the engine that serves.
    rid = world.inflight[0]
    world.finish(rid, "errored", "engine_died")
    refill = world.inflight[-1]
    assert world.dispatched[refill].group_id == world.dispatched[rid].group_id
    assert world.dispatched[refill].engine == "e0"
    for _ in range(10):  # completions and steps would admit new groups: none while paused
        world.finish_at(0, "completed")
        world.step()
        world.activate()
    assert world.groups_seen == groups
    world.down("e0")
    assert world.s.admission_paused == "admission paused: 0 engines serve, fleet.min_engines = 2"
    world.up("e0")
    world.up("e1")
    assert world.s.admission_paused is None
    assert world.groups_seen > groups, "admission did not resume when the engines came back"
    assert world.admitted_while_short == 0


@pytest.mark.parametrize("bad", [dict(capacities={"e0": 0}), dict(capacities={"nope": 2}), dict(min_engines=0)])
def test_bad_fleet_settings_are_refused(bad):
    with pytest.raises(SchedulerError):
        Scheduler(config(), ["e0"], max_steps=2, **bad)


POOL = ("e0", "e1", "e2", "e3")
fleet_events = st.lists(st.tuples(
    st.sampled_from(["complete", "complete", "complete", "error", "abort", "step", "activate",
                     "down", "up", "left", "join"]),
    st.integers(0, 1000)), max_size=250)
fleet_configs = st.builds(SchedulerConfig, group_size=st.integers(2, 4), batch_groups=st.integers(1, 3),
                          max_off_policy_steps=st.integers(0, 3), max_inflight=st.integers(8, 24),
                          max_retries=st.integers(0, 3), mode=st.sampled_from(["async", "sync"]),
                          admission=st.sampled_from(["just_in_time", "eager"]))


@settings(max_examples=300, deadline=None)
@given(config=fleet_configs, script=fleet_events, min_engines=st.integers(1, 3),
       capacities=st.lists(st.integers(1, 8), min_size=2, max_size=2))
def test_invariants_hold_with_engines_coming_and_going(config, script, min_engines, capacities):
    world = FleetWorld(config, engines=("e0", "e1"), max_steps=6, min_engines=min_engines,
                       capacities=dict(zip(("e0", "e1"), capacities)))
    for kind, n in script:
        engine = POOL[n % len(POOL)]
        if kind in ("complete", "error", "abort"):
            world.finish_at(n, {"complete": "completed", "error": "errored", "abort": "aborted"}[kind])
        elif kind == "step":
            world.step()
        elif kind == "activate":
            world.activate()
        elif kind == "down":
            world.down(engine)
            # A lost engine's rollouts end errored (not all at once: some still run when it leaves).
            for rid in world.on_engine(engine)[: n % 3]:
                world.finish(rid, "errored", "engine_died")
        elif kind == "up":
            world.up(engine)
        elif kind == "join":
            world.up(engine, capacity=1 + n % 8)
        elif kind == "left":
            world.left(engine)
    world.apply(world.s.handle(Stop()))
    while world.inflight:
        world.finish_at(0, "aborted")
    assert set(world.terminal) == set(world.dispatched), "a dispatched rollout has no terminal record"
    assert world.s.inflight == 0 and not world.s._departed
    assert world.admitted_while_short == 0, "a new group was admitted while too few engines served"
    assert all(rid // ROLLOUT_ID_STRIDE == d.group_id for rid, d in world.dispatched.items())
