"""Invariants of the pure activation coordinator under random event orders and failures.

A small simulator plays the engines: every action the coordinator emits becomes pending, and
hypothesis picks which pending action completes next, whether it succeeds, fails or never
answers, when engines die and when timers fire. After every step the invariants are checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.activation.coordinator import (
    ACTIVATED,
    ENGINE_FENCED,
    FAILED,
    ROLLED_BACK,
    AbortInflight,
    ActivationCoordinator,
    CacheFenced,
    CoordinatorError,
    Drain,
    Drained,
    DropStaged,
    EngineDied,
    Fence,
    FenceCache,
    Pause,
    Paused,
    Record,
    Resume,
    Resumed,
    SetVersion,
    Stage,
    Staged,
    StageFailed,
    StartTimer,
    StepFailed,
    Swap,
    Swapped,
    Timeout,
    Unfence,
    VersionSet,
)

ENGINES = ("a", "b", "c")


@dataclass
class SimEngine:
    paused: bool = False
    dead: bool = False
    weights: int = 0  # the version its weights hold
    label: int = 0  # the version its tokens are labelled with
    staged: int | None = None
    held: set = field(default_factory=lambda: {0})  # adapter strategy: versions loaded (0: the base)


@dataclass
class Sim:
    coord: ActivationCoordinator
    engines: dict[str, SimEngine] = field(default_factory=lambda: {e: SimEngine() for e in ENGINES})
    pending: list = field(default_factory=list)  # actions awaiting an answer
    timers: list = field(default_factory=list)
    records: list = field(default_factory=list)
    clock: float = 0.0
    stage_failed: bool = False
    swaps_this_activation: list = field(default_factory=list)
    pauses_owed: dict[str, int] = field(default_factory=dict)
    work_after_fence: list = field(default_factory=list)

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def apply(self, actions) -> None:
        for action in actions:
            self.check_action(action)
            if isinstance(action, StartTimer):
                self.timers.append(action)
            elif isinstance(action, Record):
                self.records.append(action)
            elif isinstance(action, Fence | Unfence | DropStaged | AbortInflight):
                # Like the worker's swap_drop(version): only the named version is dropped.
                if isinstance(action, DropStaged) and self.engines[action.engine].staged == action.version:
                    self.engines[action.engine].staged = None
                if isinstance(action, DropStaged) and action.version != self.coord.live_version:
                    self.engines[action.engine].held.discard(action.version)
            else:
                if isinstance(action, Pause):
                    self.pauses_owed[action.engine] = self.pauses_owed.get(action.engine, 0) + 1
                if isinstance(action, Resume):
                    self.pauses_owed[action.engine] = 0
                self.pending.append(action)

    def check_action(self, action) -> None:
        coord = self.coord
        if isinstance(action, Swap) and action.engine not in coord.rejoining:  # a rejoin swaps the live version
            assert not self.stage_failed, "a Swap after a failed stage"
            # The coordinator only asks for a swap of what the engine has staged.
            assert self.engines[action.engine].staged == action.version or action.rollback
            self.swaps_this_activation.append(action.engine)
        if isinstance(action, Stage | Swap | Pause | SetVersion | Drain | FenceCache):
            run = coord.runs.get(action.engine)
            joining = run is not None and run.joining and not run.failed
            if action.engine in coord.fenced and action.engine not in coord.rejoining and not joining:
                self.work_after_fence.append(action)

    def answer(self, action, outcome: str):
        """outcome: ok / fail / die; returns the event for the coordinator."""
        e = self.engines[action.engine]
        at = self.tick()
        if outcome == "die" or e.dead:
            e.dead = True
            e.paused = False  # a dead engine holds nobody
            return EngineDied(engine=action.engine, at=at, error="killed")
        if outcome == "fail":
            if isinstance(action, Stage):
                return StageFailed(engine=action.engine, at=at, version=action.version, error="injected")
            step = {Pause: "pause", Swap: "swap", FenceCache: "fence_cache", SetVersion: "set_version",
                    Resume: "resume", Drain: "drain"}[type(action)]
            return StepFailed(engine=action.engine, at=at, step=step, error="injected")
        if isinstance(action, Stage):
            e.staged = action.version
            e.held.add(action.version)  # an adapter is loaded beside the others
            return Staged(engine=action.engine, at=at, version=action.version)
        if isinstance(action, Drain):
            return Drained(engine=action.engine, at=at)
        if isinstance(action, Pause):
            e.paused = True
            return Paused(engine=action.engine, at=at)
        if isinstance(action, Swap):
            if e.staged != action.version and not action.rollback:
                # Dropped while the swap was in flight (the coordinator gave up on it, e.g. a
                # rejoin timed out): the worker refuses to swap in nothing.
                return StepFailed(engine=action.engine, at=at, step="swap", error="nothing staged")
            e.weights = action.version
            return Swapped(engine=action.engine, at=at, version=action.version, requests={})
        if isinstance(action, FenceCache):
            return CacheFenced(engine=action.engine, at=at)
        if isinstance(action, SetVersion):
            e.label = action.version
            return VersionSet(engine=action.engine, at=at, version=action.version, requests={})
        if isinstance(action, Resume):
            e.paused = False
            return Resumed(engine=action.engine, at=at)
        raise AssertionError(action)

    def feed(self, event) -> None:
        before = self.coord.live_version
        self.apply(self.coord.handle(event))
        after = self.coord.live_version
        if after != before:
            # the live version changes only once every engine still in the fleet applied it
            for name in self.coord.engines:
                if name not in self.coord.fenced and self.coord.strategy == "adapter":
                    assert after in self.engines[name].held, (name, self.engines[name])
                elif name not in self.coord.fenced:
                    assert self.engines[name].weights == after, (name, self.engines[name])
                    assert self.engines[name].label == after


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(),
       strategy=st.sampled_from(["pause_swap", "double_buffer", "pause_free", "adapter"]),
       policy=st.sampled_from(["recompute", "keep", "drain", "abort"]))
def test_random_orders_and_failures_keep_the_invariants(data, strategy, policy):
    if strategy == "pause_free" and policy == "recompute":
        policy = "keep"
    if strategy == "adapter":
        policy = "drain"  # what the fleet runs it with (nothing is drained: requests keep their adapter)
    sim = Sim(ActivationCoordinator(ENGINES, strategy=strategy, kv_policy=policy))
    version = 0
    for _activation in range(data.draw(st.integers(1, 3), label="activations")):
        version += 1
        sim.stage_failed = False
        sim.swaps_this_activation = []
        n_records = len(sim.records)
        for e in sorted(sim.coord.fenced):
            way = data.draw(st.sampled_from(["stay", "rejoin", "join_next"]), label=f"back {e}")
            if way == "rejoin" and not sim.engines[e].dead:
                sim.apply(sim.coord.rejoin(e, sim.tick()))
            elif way == "join_next" and e not in sim.coord.rejoining:
                sim.apply(sim.coord.join_next(e))
        sim.apply(sim.coord.begin(version, sim.tick()))
        steps = 0
        while not sim.coord.idle or sim.pending or sim.coord.rejoining:
            steps += 1
            assert steps < 500, "no progress"
            choices = ["answer"] * 6 * bool(sim.pending) + ["timer"] * 2 * bool(sim.timers) \
                + ["abandon"] * (not sim.coord.idle)
            if not choices:
                break
            kind = data.draw(st.sampled_from(choices), label="kind")
            if kind == "abandon":  # the performer is cancelled: its tasks and timers die with it
                runs = set(sim.coord.runs)
                sim.apply(sim.coord.abandon(sim.tick()))
                sim.pending = [a for a in sim.pending if a.engine not in runs]
                sim.timers = [t for t in sim.timers if t.engine is not None]
                for name in runs:  # and it resumes whatever it paused (`_resume_leftovers`)
                    sim.engines[name].paused = False
                    sim.pauses_owed[name] = 0
                continue
            if kind == "timer":
                timer = sim.timers.pop(data.draw(st.integers(0, len(sim.timers) - 1), label="timer"))
                sim.feed(Timeout(engine=timer.engine, at=sim.tick(), phase=timer.phase, token=timer.token))
                continue
            action = sim.pending.pop(data.draw(st.integers(0, len(sim.pending) - 1), label="which"))
            outcome = data.draw(st.sampled_from(["ok"] * 6 + ["fail", "die", "hang"]), label="outcome")
            if outcome == "hang":
                continue  # never answers: only a timer gets the coordinator further
            event = sim.answer(action, outcome)
            # A serving engine's failure while staging rolls the version back (a joiner's fails only it).
            run = sim.coord.runs.get(action.engine)
            if isinstance(event, StageFailed | EngineDied) and sim.coord.phase == "staging" \
                    and run is not None and not run.joining:
                sim.stage_failed = True
            sim.feed(event)
        # one record per activation
        assert len(sim.records) == n_records + 1
        record = sim.records[-1]
        assert record.version == version
        if sim.stage_failed:
            assert record.outcome in (ROLLED_BACK, FAILED)
            assert sim.swaps_this_activation == []
        if record.outcome in (ACTIVATED, ENGINE_FENCED):
            assert sim.coord.live_version == version
        else:
            assert sim.coord.live_version < version
        # nobody is left paused: every alive engine that was paused got a Resume that answered
        for name, eng in sim.engines.items():
            if not eng.dead:
                assert not eng.paused or sim.pauses_owed.get(name, 0) == 0, (name, eng)
        assert sim.work_after_fence == []
        for name in sim.coord.fenced:
            assert name not in sim.coord.serving
            assert not sim.coord.may_dispatch(name)
        # every engine that serves (a joiner included, once unfenced) holds the live version
        for name in sim.coord.serving:
            if strategy == "adapter":  # nothing paused, swapped or labelled: it holds the adapter
                assert not sim.engines[name].paused and sim.pauses_owed.get(name, 0) == 0
                assert sim.engines[name].dead or sim.coord.live_version in sim.engines[name].held, name
            elif not sim.engines[name].dead:
                assert (sim.engines[name].weights, sim.engines[name].label) == (sim.coord.live_version,) * 2, name


def drive_ok(coord: ActivationCoordinator, version: int, fail: dict | None = None):
    """Answer every action successfully (or as `fail` says), in order; returns all actions."""
    return answer_all(coord, coord.begin(version, 0.0), version, fail)


def answer_all(coord: ActivationCoordinator, actions, version: int, fail: dict | None = None):
    """Answer `actions` and all that follow them, as `drive_ok` does."""
    fail = fail or {}
    seen = []
    queue = list(actions)
    t = 0.0
    while queue:
        action = queue.pop(0)
        seen.append(action)
        t += 1
        if isinstance(action, StartTimer | Record | Fence | DropStaged | Unfence | AbortInflight):
            continue
        e = action.engine
        kind = type(action).__name__
        if fail.get((e, kind)) == "fail":
            event = (StageFailed(engine=e, at=t, version=version, error="injected") if kind == "Stage"
                     else StepFailed(engine=e, at=t, step=kind.lower(), error="injected"))
        elif fail.get((e, kind)) == "die":
            event = EngineDied(engine=e, at=t, error="killed")
        elif fail.get((e, kind)) == "hang":
            continue
        else:
            event = {"Stage": lambda: Staged(engine=e, at=t, version=version), "Pause": lambda: Paused(engine=e, at=t),
                     "Swap": lambda: Swapped(engine=e, at=t, version=version, requests={"r1": 3}),
                     "FenceCache": lambda: CacheFenced(engine=e, at=t), "SetVersion": lambda: VersionSet(engine=e, at=t, version=version, requests={}),
                     "Resume": lambda: Resumed(engine=e, at=t), "Drain": lambda: Drained(engine=e, at=t)}[kind]()
        queue.extend(coord.handle(event))
    return seen


def test_happy_path_order_and_record():
    coord = ActivationCoordinator(["a", "b"])
    actions = drive_ok(coord, 1)
    kinds = [type(a).__name__ for a in actions if not isinstance(a, StartTimer)]
    assert kinds[:2] == ["Stage", "Stage"]
    # no engine pauses before both staged; no resume before both applied
    assert kinds.index("Pause") > max(i for i, k in enumerate(kinds) if k == "Stage")
    last_set = max(i for i, k in enumerate(kinds) if k == "SetVersion")
    assert kinds.index("Resume") > last_set
    record = [a for a in actions if isinstance(a, Record)][-1]
    assert record.outcome == ACTIVATED and coord.live_version == 1
    assert {eo.engine: eo.swapped_requests for eo in record.engines} == {"a": {"r1": 3}, "b": {"r1": 3}}
    pauses = [a for a in actions if isinstance(a, Pause)]
    assert all(p.mode == "keep" and p.clear_cache for p in pauses)


def test_one_engine_failing_to_stage_activates_none():
    coord = ActivationCoordinator(["a", "b"])
    actions = drive_ok(coord, 1, fail={("b", "Stage"): "fail"})
    assert not any(isinstance(a, Pause | Swap | SetVersion) for a in actions)
    assert {a.engine for a in actions if isinstance(a, DropStaged)} == {"a", "b"}
    assert coord.live_version == 0 and coord.idle and not coord.fenced
    assert [a for a in actions if isinstance(a, Record)][-1].outcome == ROLLED_BACK
    # the next version tries again
    drive_ok(coord, 2)
    assert coord.live_version == 2


def test_hanging_stage_times_out_and_the_old_version_stays():
    coord = ActivationCoordinator(["a", "b"])
    actions = drive_ok(coord, 1, fail={("a", "Stage"): "hang"})
    assert coord.phase == "staging"
    timer = [a for a in actions if isinstance(a, StartTimer)][0]
    out = coord.handle(Timeout(engine=None, at=99.0, phase=timer.phase, token=timer.token))
    assert [a.outcome for a in out if isinstance(a, Record)] == [ROLLED_BACK]
    assert coord.live_version == 0 and coord.idle
    # a late answer of the hung engine changes nothing
    assert coord.handle(Staged(engine="a", at=100.0, version=1)) == []


def test_engine_dying_during_the_pause_is_fenced_and_the_other_activates():
    coord = ActivationCoordinator(["a", "b"])
    actions = drive_ok(coord, 1, fail={("b", "Swap"): "die"})
    assert coord.live_version == 1
    assert coord.fenced == {"b"} and coord.serving == ("a",)
    assert [a.outcome for a in actions if isinstance(a, Record)] == [ENGINE_FENCED]
    assert any(isinstance(a, Resume) and a.engine == "a" for a in actions)


def test_rejoin_resyncs_to_the_live_version_before_serving():
    coord = ActivationCoordinator(["a", "b"])
    drive_ok(coord, 1, fail={("b", "SetVersion"): "fail"})
    assert coord.fenced == {"b"}
    out = coord.rejoin("b", 10.0)
    assert isinstance(out[0], Stage) and out[0].version == 1
    events = [Staged(engine="b", at=11, version=1), Paused(engine="b", at=12), Swapped(engine="b", at=13, version=1, requests={}),
              CacheFenced(engine="b", at=14), VersionSet(engine="b", at=15, version=1, requests={}), Resumed(engine="b", at=16)]
    emitted = []
    for ev in events:
        emitted += coord.handle(ev)
    assert isinstance(emitted[-1], Unfence) and coord.fenced == set()


def test_pause_free_never_pauses_and_keep_marks_carried_kv():
    coord = ActivationCoordinator(["a", "b"], strategy="pause_free", kv_policy="keep")
    actions = drive_ok(coord, 1)
    assert not any(isinstance(a, Pause | Resume) for a in actions)
    assert all(a.between_steps for a in actions if isinstance(a, Swap))
    record = [a for a in actions if isinstance(a, Record)][-1]
    assert record.outcome == ACTIVATED and record.kv_carried


@pytest.mark.parametrize("policy,mode,clear", [("recompute", "keep", True), ("keep", "keep", False),
                                                ("abort", "abort", True), ("drain", "keep", True)])
def test_kv_policy_shapes_the_pause(policy, mode, clear):
    coord = ActivationCoordinator(["a"], kv_policy=policy)
    actions = drive_ok(coord, 1)
    pause = [a for a in actions if isinstance(a, Pause)][0]
    assert (pause.mode, pause.clear_cache) == (mode, clear)
    kinds = [type(a).__name__ for a in actions]
    if policy == "drain":
        assert kinds.index("Drain") < kinds.index("Pause")
    if policy == "abort":
        assert kinds.index("AbortInflight") < kinds.index("Pause")


def test_bad_calls_are_refused():
    with pytest.raises(ValueError):
        ActivationCoordinator(["a"], strategy="pause_free", kv_policy="recompute")
    coord = ActivationCoordinator(["a"])
    with pytest.raises(CoordinatorError):
        coord.begin(0, 0.0)
    coord.begin(1, 0.0)
    with pytest.raises(CoordinatorError):
        coord.begin(2, 0.0)
    with pytest.raises(CoordinatorError):
        ActivationCoordinator(["a"]).begin(1, 0.0, rollback=True)


# ---------------------------------------------------------------------------------------------
# the messages themselves


def test_messages_are_keyword_only_and_required_fields_have_no_default():
    import dataclasses

    from orchestrator.activation import messages as msgs

    # A missing version is a TypeError, never version 0; positional arguments are refused.
    with pytest.raises(TypeError):
        Stage(engine="a")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Stage("a", 1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        Staged(engine="a", version=1)  # type: ignore[call-arg] - no `at`
    assert Stage(engine="a", version=3).version == 3
    # Only the optional flags may have defaults; everything else must be passed.
    flags = {"rollback", "between_steps"}
    classes = [c for c in vars(msgs).values()
               if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == msgs.__name__]
    assert len(classes) > 20
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert f.kw_only, f"{cls.__name__}.{f.name} is not keyword-only"
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            assert has_default == (f.name in flags), f"{cls.__name__}.{f.name}: default only for optional flags"


# -- join_next: a fenced engine comes back with the next version (push transports) -------------

def fenced_b(strategy: str = "pause_swap", kv_policy: str = "recompute") -> ActivationCoordinator:
    coord = ActivationCoordinator(["a", "b"], strategy=strategy, kv_policy=kv_policy)
    drive_ok(coord, 1, fail={("b", "SetVersion"): "fail"})
    assert coord.fenced == {"b"} and coord.live_version == 1
    return coord


@pytest.mark.parametrize("strategy,policy", [("pause_swap", "recompute"), ("double_buffer", "keep"),
                                             ("pause_free", "keep")])
def test_a_joiner_stages_flips_and_is_unfenced_with_the_next_version(strategy, policy):
    coord = fenced_b(strategy, policy)
    assert coord.join_next("b") == []
    assert coord.fenced == {"b"} and not coord.may_dispatch("b")  # nothing changes before the version
    actions = drive_ok(coord, 2)
    for kind in (Stage, Swap, SetVersion):
        assert {a.engine for a in actions if isinstance(a, kind)} == {"a", "b"}, kind
    unfence = [a for a in actions if isinstance(a, Unfence)]
    assert [(u.engine, u.version) for u in unfence] == [("b", 2)]
    # unfenced only after every engine applied the version (and, pausing, resumed)
    last_step = max(i for i, a in enumerate(actions) if isinstance(a, SetVersion | Resume))
    assert actions.index(unfence[0]) > last_step
    record = [a for a in actions if isinstance(a, Record)][-1]
    assert record.outcome == ACTIVATED and {eo.engine: eo.outcome for eo in record.engines} == {"a": ACTIVATED, "b": ACTIVATED}
    assert coord.live_version == 2 and coord.fenced == set() and coord.joining == set()
    assert coord.serving == ("a", "b")


@pytest.mark.parametrize("step,how", [("Stage", "fail"), ("Stage", "die"), ("Swap", "fail"), ("SetVersion", "die")])
def test_a_joiner_that_fails_stays_fenced_and_the_version_goes_live_without_it(step, how):
    coord = fenced_b()
    coord.join_next("b")
    actions = drive_ok(coord, 2, fail={("b", step): how})
    record = [a for a in actions if isinstance(a, Record)][-1]
    assert record.outcome == ACTIVATED and coord.live_version == 2  # the joiner fails only itself
    assert {eo.engine: eo.outcome for eo in record.engines}["b"] == ENGINE_FENCED
    assert "b did not join" in record.message
    assert coord.fenced == {"b"} and coord.joining == set()
    assert not any(isinstance(a, Fence | Unfence) for a in actions)  # fenced it was, fenced it stays
    assert not any(isinstance(a, Swap | Pause) and a.engine == "b" for a in actions if step == "Stage")
    if step == "Stage":  # what it staged is dropped; a dead one is sent nothing (its rejoin re-syncs it)
        assert [a.engine for a in actions if isinstance(a, DropStaged)] == (["b"] if how == "fail" else [])
    # a's pause was resumed; b, if it was paused, too
    assert {a.engine for a in actions if isinstance(a, Resume)} >= {"a"}


def test_a_serving_engine_failing_to_stage_rolls_back_and_the_joiner_waits_for_the_next():
    coord = fenced_b()
    coord.join_next("b")
    actions = drive_ok(coord, 2, fail={("a", "Stage"): "fail"})
    assert [a.outcome for a in actions if isinstance(a, Record)] == [ROLLED_BACK]
    assert {a.engine for a in actions if isinstance(a, DropStaged)} == {"a", "b"}
    assert coord.live_version == 1 and coord.fenced == {"b"} and coord.joining == {"b"}
    drive_ok(coord, 3)
    assert coord.live_version == 3 and coord.fenced == set() and coord.joining == set()


def test_an_engine_that_dies_while_staging_rolls_back_and_is_sent_no_drop():
    """Over a cut link a drop waits out its limit, and the rollback with it (the cluster test's
    next version waited 50 s): the dead engine is fenced, the others drop what they staged."""
    coord = ActivationCoordinator(["a", "b", "c"], live_version=1)
    actions = drive_ok(coord, 2, fail={("b", "Stage"): "die"})
    assert [a.outcome for a in actions if isinstance(a, Record)] == [ROLLED_BACK]
    assert {a.engine for a in actions if isinstance(a, DropStaged)} == {"a", "c"}
    assert [a.engine for a in actions if isinstance(a, Fence)] == ["b"] and coord.fenced == {"b"}
    assert coord.live_version == 1
    # It comes back: the rejoin stages the live version over whatever it held, then swaps.
    rejoin = answer_all(coord, coord.rejoin("b", 10.0), 1)
    assert [type(a).__name__ for a in rejoin if a.engine == "b" and isinstance(a, Stage | Swap)] == ["Stage", "Swap"]
    assert coord.fenced == set()


def test_a_late_joiner_is_left_behind_when_staging_times_out():
    coord = fenced_b()
    coord.join_next("b")
    actions = drive_ok(coord, 2, fail={("b", "Stage"): "hang"})
    assert coord.phase == "staging"
    timer = [a for a in actions if isinstance(a, StartTimer)][0]
    rest = answer_all(coord, coord.handle(Timeout(engine=None, at=50.0, phase=timer.phase, token=timer.token)), 2)
    assert [(a.engine, a.version) for a in rest if isinstance(a, DropStaged)] == [("b", 2)]
    assert {a.engine for a in rest if isinstance(a, Swap)} == {"a"}
    assert [a.outcome for a in rest if isinstance(a, Record)] == [ACTIVATED]
    assert coord.live_version == 2 and coord.fenced == {"b"} and coord.joining == set()


def test_join_next_needs_a_fenced_engine_and_a_rollback_leaves_joiners_out():
    coord = ActivationCoordinator(["a", "b"], strategy="double_buffer", kv_policy="keep")
    with pytest.raises(CoordinatorError, match="not fenced"):
        coord.join_next("a")
    drive_ok(coord, 1)
    drive_ok(coord, 2, fail={("b", "SetVersion"): "fail"})
    coord.join_next("b")
    actions = answer_all(coord, coord.begin(3, 0.0, rollback=True), 3)
    assert {a.engine for a in actions if isinstance(a, Stage)} == {"a"}  # b's other buffer holds nothing of it
    assert coord.fenced == {"b"} and coord.joining == {"b"}
    # a rejoin to the live version takes over from joining
    coord.rejoin("b", 10.0)
    assert coord.joining == set() and "b" in coord.rejoining
    with pytest.raises(CoordinatorError, match="already rejoining"):
        coord.join_next("b")


# -- abandon: the performer gave up on an activation or a rejoin (cancelled) ---------------------

def test_an_abandoned_staging_drops_everything_rolls_back_and_the_next_begins():
    coord = ActivationCoordinator(["a", "b"])
    drive_ok(coord, 1, fail={("b", "Stage"): "hang"})
    assert coord.phase == "staging"
    out = coord.abandon(5.0)
    assert {a.engine for a in out if isinstance(a, DropStaged)} == {"a", "b"}
    (record,) = [a for a in out if isinstance(a, Record)]
    assert record.outcome == ROLLED_BACK and "cancelled in phase staging" in record.message
    assert coord.idle and coord.live_version == 0 and not coord.fenced
    assert coord.abandon(6.0) == []  # nothing under way
    drive_ok(coord, 2)
    assert coord.live_version == 2


def test_an_abandoned_swap_fences_the_engines_that_did_not_confirm_it():
    coord = ActivationCoordinator(["a", "b"])
    drive_ok(coord, 1, fail={("b", "Swap"): "hang"})  # a applied v1, b's swap never answered
    assert coord.phase == "swapping"
    out = coord.abandon(5.0)
    assert [a.engine for a in out if isinstance(a, Fence)] == ["b"]  # may hold either version
    assert not any(isinstance(a, DropStaged | Resume) for a in out)  # resumes are the performer's
    (record,) = [a for a in out if isinstance(a, Record)]
    assert record.outcome == ENGINE_FENCED and coord.live_version == 1 and coord.serving == ("a",)
    assert coord.idle


def test_an_abandoned_swap_that_nobody_confirmed_leaves_the_live_version():
    coord = ActivationCoordinator(["a", "b"], strategy="pause_free", kv_policy="keep")
    drive_ok(coord, 1, fail={("a", "Swap"): "hang", ("b", "Swap"): "hang"})
    out = coord.abandon(5.0)
    assert {a.engine for a in out if isinstance(a, Fence)} == {"a", "b"}
    assert [a.outcome for a in out if isinstance(a, Record)] == [FAILED] and coord.live_version == 0


def test_an_abandoned_rejoin_leaves_the_engine_fenced_and_free_to_rejoin():
    coord = ActivationCoordinator(["a", "b"])
    drive_ok(coord, 1, fail={("b", "SetVersion"): "fail"})
    coord.rejoin("b", 10.0)
    assert coord.abandon_rejoin("b") == [DropStaged(engine="b", version=1)]
    assert coord.fenced == {"b"} and not coord.rejoining
    assert coord.abandon_rejoin("b") == []
    assert isinstance(coord.rejoin("b", 11.0)[0], Stage)


def test_a_rejoin_that_ends_during_an_activation_joins_it_rather_than_serve_the_old_version():
    coord = ActivationCoordinator(["a", "b", "c"])
    drive_ok(coord, 1, fail={("c", "SetVersion"): "fail"})
    coord.rejoin("c", 10.0)
    begun = coord.begin(2, 11.0)  # without c, which is still rejoining at v1
    assert {a.engine for a in begun if isinstance(a, Stage)} == {"a", "b"}
    out = []
    for event in (Staged(engine="c", at=12, version=1), Paused(engine="c", at=13),
                  Swapped(engine="c", at=14, version=1, requests={}), CacheFenced(engine="c", at=15),
                  VersionSet(engine="c", at=16, version=1, requests={}), Resumed(engine="c", at=17)):
        out += coord.handle(event)
    # unfenced now, c would keep v1 once v2 goes live on a and b: it stages v2 with them instead
    assert [(a.engine, a.version) for a in out if isinstance(a, Stage)] == [("c", 2)]
    assert not any(isinstance(a, Unfence) for a in out) and coord.fenced == {"c"}
    rest = answer_all(coord, [a for a in begun if isinstance(a, Stage)] + [Stage(engine="c", version=2)], 2)
    assert [(a.engine, a.version) for a in rest if isinstance(a, Unfence)] == [("c", 2)]
    assert [a.outcome for a in rest if isinstance(a, Record)] == [ACTIVATED]
    assert coord.live_version == 2 and coord.serving == ("a", "b", "c")
