"""Engines that come and go, in the fleet and its coordinator (orchestrator/fleet/membership.py,
orchestrator/activation/rejoin.py), with scripted engines: a joiner's slow transfer delays no
activation, a drain waits for its engine's rollouts (or aborts them past drain_s), an engine that
refuses requests unasked is told apart from an abort, a SIGTERM'd server is leaving, not dead."""

from __future__ import annotations

import json

import anyio
import pytest

from orchestrator.activation import coordinator as act
from orchestrator.engines.base import SamplingSettings, TokenChunk
from orchestrator.fleet.fleet import Fleet, FleetTimeouts
from tests.unit.test_activation_fleet import ScriptedEngine


class HeldStager(ScriptedEngine):
    """Its transfer ends only when the test says (`release`): a new engine pulling the live
    version for as long as the test needs."""

    def __init__(self, engine_id: str):
        super().__init__(engine_id)
        self.release = anyio.Event()

    async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        if method == "swap_stage":
            self.calls.append(method)
            self.state, self.staged_version = "staging", json.loads(args[0])["version"]
            return [{}]
        if method == "swap_status" and self.state == "staging" and self.release.is_set():
            self.state = "staged"
        return await super().collective_rpc(method, args, kwargs, timeout)


def fleet_of(*engines) -> Fleet:
    fleet = Fleet(list(engines), fleet_timeouts=FleetTimeouts(rpc_s=5, poll_s=0.005))
    return fleet


async def set_up(fleet: Fleet) -> None:
    await fleet.setup("{}", "/nonexistent-root")


def test_the_coordinator_adds_fenced_excludes_leaving_and_removes():
    c = act.ActivationCoordinator(["a", "b"])
    c.add_engine("c")
    assert c.engines == ("a", "b", "c") and c.serving == ("a", "b")  # a newcomer serves after its rejoin
    with pytest.raises(act.CoordinatorError):
        c.add_engine("a")
    c.leave("b")
    assert c.serving == ("a",) and not c.may_dispatch("b")
    actions = c.begin(1, 0.0)
    assert {a.engine for a in actions if isinstance(a, act.Stage)} == {"a"}  # no activation waits on b
    c.abandon(0.0)
    with pytest.raises(act.CoordinatorError):
        c.rejoin("b", 0.0)  # leaving: it does not come back
    c.remove_engine("b")
    assert c.engines == ("a", "c") and "b" not in c.leaving and "b" not in c.fenced


async def test_a_joiner_stages_beside_an_activation_that_does_not_wait_for_it():
    a = ScriptedEngine("a")
    fleet = fleet_of(a)
    await set_up(fleet)
    record = await fleet.activate(1)
    assert record.outcome == "activated"
    joiner = HeldStager("j")
    fleet.add(joiner, source="test")
    assert fleet.members["j"].state == "joining" and "j" not in fleet.coordinator.serving
    async with anyio.create_task_group() as tg:
        joined: list[bool] = []

        async def join() -> None:
            joined.append(await fleet.bring_in("j"))

        tg.start_soon(join)
        await anyio.sleep(0.05)
        assert joiner.state == "staging" and joiner.staged_version == 1
        record = await fleet.activate(2)  # while the joiner's transfer goes on
        assert joiner.state == "staging", "the activation waited for the joiner's transfer"
        joiner.release.set()
    assert record.outcome == "activated" and [e.engine for e in record.engines] == ["a"]
    # It staged 1, found 2 live, staged 2, then switched under the lock: serving version 2.
    assert joined == [True] and joiner.calls.count("swap_stage") == 2 and joiner.version == 2
    assert fleet.coordinator.serving == ("a", "j") and fleet.members["j"].state == "serving"


async def test_a_drain_waits_for_its_rollouts_then_the_engine_leaves():
    a, b = ScriptedEngine("a"), ScriptedEngine("b")
    fleet = fleet_of(a, b)
    sampling = SamplingSettings(max_tokens=40)  # 40 x 5 ms
    async with anyio.create_task_group() as tg:
        done: list = []

        async def rollout() -> None:
            done.append(await fleet.generate([1], sampling, engine_id="b", redispatch=False))

        tg.start_soon(rollout)
        await anyio.sleep(0.02)
        aborted = await fleet.drain("b", drain_s=30)
        assert aborted == 0 and done and done[0].status == "completed" and len(done[0].token_ids) == 40
    await fleet.remove("b")
    assert fleet.coordinator.engines == ("a",) and "b" not in fleet.engines
    assert fleet.members["b"].state == "left" and fleet.members["b"].rollouts == 1
    assert fleet.members["b"].tokens == 40


async def test_a_drain_past_drain_s_aborts_what_is_left_as_dropped_not_errored():
    class Forever(ScriptedEngine):
        async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None):
            self.aborted = anyio.Event()
            yield TokenChunk([1], [-0.5])
            await self.aborted.wait()
            yield TokenChunk([], [], finished=True, finish_reason="abort")

        async def abort_many(self, request_ids):
            self.aborted.set()

    b = Forever("b")
    fleet = fleet_of(ScriptedEngine("a"), b)
    async with anyio.create_task_group() as tg:
        done: list = []

        async def rollout() -> None:
            done.append(await fleet.generate([1], SamplingSettings(max_tokens=5), engine_id="b", redispatch=False))

        tg.start_soon(rollout)
        await anyio.sleep(0.02)
        assert await fleet.drain("b", drain_s=0.1) == 1
    assert done[0].status == "dropped" and done[0].reason == "aborted" and "left the fleet" in done[0].message


async def test_an_abort_nobody_asked_for_is_the_engine_refusing():
    class Refuses(ScriptedEngine):
        async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None):
            yield TokenChunk([], [], finished=True, finish_reason="abort")

    fleet = fleet_of(Refuses("a"))
    c = await fleet.generate([1], SamplingSettings(max_tokens=3), redispatch=False)
    assert (c.status, c.reason) == ("dropped", "aborted") and c.refused


async def test_an_abort_while_an_activation_ran_is_not_a_refusal():
    """An activation's pause or abort policy can end a request before its first token."""
    class AbortsLater(ScriptedEngine):
        async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None):
            await self.go.wait()
            yield TokenChunk([], [], finished=True, finish_reason="abort")

    engine = AbortsLater("a")
    engine.go = anyio.Event()
    fleet = fleet_of(engine)
    await set_up(fleet)
    async with anyio.create_task_group() as tg:
        done: list = []

        async def rollout() -> None:
            done.append(await fleet.generate([1], SamplingSettings(max_tokens=3), redispatch=False))

        tg.start_soon(rollout)
        await anyio.sleep(0.01)
        await fleet.activate(1)
        engine.go.set()
    assert done[0].status == "dropped" and not done[0].refused


@pytest.mark.parametrize("error", ["shutting down", "reset", "dead"])
async def test_a_server_shutting_down_is_leaving_not_fenced_and_keeps_its_rollouts(error):
    """A SIGTERM'd vLLM server answers every control call 'Server shutting down' while it
    drains: an activation's call failing so marks it leaving; its rollout finishes. A call
    caught as the signal lands may fail otherwise (a reset connection, a dead engine core's
    error): the server is asked whether it is leaving before it is taken for failed."""
    from orchestrator.errors import EngineDeadError, EngineGenerateError

    class Stopping(ScriptedEngine):
        async def pause(self, mode="keep", clear_cache=True):
            if error == "reset":
                raise EngineGenerateError(self.engine_id, "POST /pause: ReadError: connection reset by peer")
            if error == "dead":
                raise EngineDeadError(self.engine_id, "EngineCore shut down")
            raise EngineGenerateError(self.engine_id, 'POST /pause answered 500: {"error": {"message": '
                                                      '"Server shutting down"}}')

        async def leaving(self) -> bool:
            return True

    a, b = ScriptedEngine("a"), Stopping("b")
    fleet = fleet_of(a, b)
    await set_up(fleet)
    changes: list = []
    fleet.on_member_change = lambda e, s: changes.append((e, s))
    async with anyio.create_task_group() as tg:
        done: list = []

        async def rollout() -> None:
            done.append(await fleet.generate([1], SamplingSettings(max_tokens=30), engine_id="b", redispatch=False))

        tg.start_soon(rollout)
        await anyio.sleep(0.02)
        record = await fleet.activate(1)
    assert record.outcome == "engine_fenced"  # the version went live on a
    assert ("b", "draining") in changes and "b" in fleet.coordinator.leaving
    assert done[0].status == "completed"  # not cancelled as a fenced engine's would be


def _answer(c: act.ActivationCoordinator, actions: list) -> list:
    """Answer every engine action as a healthy engine would, until the record."""
    answers = {act.Stage: lambda a: act.Staged(engine=a.engine, at=0.0, version=a.version),
               act.Pause: lambda a: act.Paused(engine=a.engine, at=0.0),
               act.Swap: lambda a: act.Swapped(engine=a.engine, at=0.0, version=a.version, requests={}),
               act.FenceCache: lambda a: act.CacheFenced(engine=a.engine, at=0.0),
               act.SetVersion: lambda a: act.VersionSet(engine=a.engine, at=0.0, version=a.version, requests={}),
               act.Resume: lambda a: act.Resumed(engine=a.engine, at=0.0)}
    seen, queue = [], list(actions)
    while queue:
        a = queue.pop(0)
        seen.append(a)
        if type(a) in answers:
            queue += c.handle(answers[type(a)](a))
    return seen


@pytest.mark.parametrize("when", ["staging", "pausing"])
def test_an_engine_leaving_mid_activation_drops_out_and_the_version_goes_live(when):
    c = act.ActivationCoordinator(["a", "b"])
    actions = c.begin(1, 0.0)
    seen = _answer(c, [x for x in actions if getattr(x, "engine", None) == "a"])
    if when == "pausing":
        b_actions = c.handle(act.Staged(engine="b", at=0.0, version=1))  # both staged: both asked to pause
        assert any(isinstance(x, act.Pause) and x.engine == "b" for x in b_actions)
        seen += _answer(c, [x for x in b_actions if x.engine == "a"])
    out = c.handle(act.EngineLeaving(engine="b", at=0.0))
    if when == "staging":
        assert any(isinstance(x, act.DropStaged) and x.engine == "b" for x in out)
    else:
        assert any(isinstance(x, act.Resume) and x.engine == "b" for x in out)  # never left paused
    seen += _answer(c, [x for x in out if getattr(x, "engine", None) != "b"])
    records = [x for x in seen + out if isinstance(x, act.Record)]
    assert c.live_version == 1 and records and records[-1].outcome != "rolled_back"
    assert not any(isinstance(x, (act.Swap, act.SetVersion)) and x.engine == "b" for x in seen)
    assert "b" in c.leaving and "b" not in c.serving


def test_the_coordinator_keeps_a_bounded_history_of_its_activations():
    """A run activates every step for days: the coordinator keeps its last records only (the
    replay log holds every one)."""
    c = act.ActivationCoordinator(["a"])
    for version in range(1, act.HISTORY_KEPT + 11):
        _answer(c, c.begin(version, 0.0))
        assert c.live_version == version
    assert len(c.history) == act.HISTORY_KEPT
    assert [r.version for r in c.history][-1] == act.HISTORY_KEPT + 10


async def test_an_engine_that_leaves_while_its_pause_is_on_the_way_ends_unpaused():
    """`fleet drain` mid-activation: the coordinator owes the leaver a Resume for the Pause it
    emitted, which may still be on its way (a slow control call on a busy server). The Resume
    must not overtake it: seen in test_fleet_elastic, where the engine was resumed, then paused,
    and stayed paused until the drain gave up."""

    class SlowPause(ScriptedEngine):
        def __init__(self, engine_id):
            super().__init__(engine_id)
            self.pausing = anyio.Event()

        async def pause(self, mode="keep", clear_cache=True):
            self.pausing.set()
            with anyio.CancelScope(shield=True):  # sent: it reaches the server, late, whatever the client does
                await anyio.sleep(0.2)
                await super().pause(mode, clear_cache)

    a, b = ScriptedEngine("a"), SlowPause("b")
    fleet = fleet_of(a, b)
    await set_up(fleet)
    async with anyio.create_task_group() as tg:
        done: list = []

        async def activation() -> None:
            done.append(await fleet.activate(1))

        tg.start_soon(activation)
        await b.pausing.wait()
        await fleet.mark_leaving("b")
    assert done and fleet.live_version == 1
    assert "b" in fleet.coordinator.leaving
    assert not b.paused, b.calls


async def test_a_rollout_dispatched_to_an_engine_that_left_before_it_started_is_dropped_not_errored():
    """The scheduler chose b; b was drained before the rollout's request started (the dispatcher
    journals a batch first): the fleet refuses it (FencedEngineError), and the loop ends it
    dropped, to be sampled again elsewhere, never errored(engine_fenced) (seen in
    test_fleet_elastic: 24 of the drained engine's rollouts errored). A fenced engine's stay errored."""
    from types import SimpleNamespace

    from orchestrator.errors import FencedEngineError
    from orchestrator.run.loop import RunLoop
    from orchestrator.scheduling.scheduler import Dispatch

    fleet = fleet_of(ScriptedEngine("a"), ScriptedEngine("b"), ScriptedEngine("c"))
    ended: list = []
    loop = SimpleNamespace(run=SimpleNamespace(fleet=fleet),
                           _finished=lambda d, completion, outcome, kind="", message="": ended.append(
                               (d.engine, outcome, kind, message)))
    await fleet.mark_leaving("b")
    fleet.coordinator.fenced.add("c")
    for engine in ("b", "c"):
        with pytest.raises(FencedEngineError) as refused:
            await fleet.generate([1], SamplingSettings(max_tokens=4), engine_id=engine, redispatch=False)
        d = Dispatch(rollout_id=1, group_id=0, engine=engine, version=0)
        assert RunLoop.left_before_start(loop, d, refused.value) is (engine == "b")
    assert ended == [("b", "aborted", "", "b left the fleet before this rollout started: sampled again elsewhere")]
