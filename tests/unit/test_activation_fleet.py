"""The fleet performer without a real engine: a hand-written fault injector that plays the
worker extension's answers and can hang or fail any step. Checks what the structure
guarantees: resume even when the activation is cancelled or a step hangs, fenced engines get
no new requests, per-token versions follow the swap reports."""

from __future__ import annotations

import functools
import json

import anyio
import anyio.lowlevel
import pytest

from orchestrator.activation import coordinator as act
from orchestrator.engines.base import Engine, SamplingSettings, TokenChunk, VersionSpan
from orchestrator.errors import EngineDeadError, FencedEngineError
from orchestrator.fleet.fleet import Fleet, FleetTimeouts, Track, fleet_request_id

class ScriptedEngine(Engine):
    """Answers like an engine with `transports.swap.SwapWorkerExtension`; `hang` / `fail`
    name calls (pause, resume, swap_apply, swap_stage, ...) that never answer / raise."""

    def __init__(self, engine_id: str, hang: tuple = (), fail: tuple = ()):
        self.engine_id = engine_id
        self.hang, self.fail = set(hang), set(fail)
        self.paused = False
        self.version = 0
        self.calls: list[str] = []
        self.state = "idle"
        self.staged_version: int | None = None

    async def _step(self, name: str) -> None:
        self.calls.append(name)
        if name in self.hang:
            await anyio.sleep_forever()
        if name in self.fail:
            raise EngineDeadError(self.engine_id, f"injected failure in {name}")

    async def start(self): ...

    async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None):
        for i in range(sampling.max_tokens):
            await anyio.sleep(0.005)
            last = i == sampling.max_tokens - 1
            yield TokenChunk([1], [-0.5], finished=last, finish_reason="length" if last else None,
                             version_spans=[VersionSpan(self.version, 0, sampling.max_tokens)] if last else None)

    async def abort(self, request_id): ...

    async def pause(self, mode="keep", clear_cache=True):
        await self._step("pause")
        self.paused = True

    async def resume(self):
        await self._step("resume")
        self.paused = False

    async def is_paused(self):
        return self.paused

    async def healthy(self):
        return True

    async def set_weight_version(self, version):
        await self._step("set_weight_version")
        self.version = version

    async def reset_prefix_cache(self):
        await self._step("reset_prefix_cache")

    async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        await self._step(method)
        if method == "swap_stage":
            self.state, self.staged_version = "staged", json.loads(args[0])["version"]
        if method == "swap_status":
            return [{"state": self.state, "version": self.staged_version}]
        if method == "swap_apply":
            return [{"version": self.staged_version, "requests": {}}]
        return [{}]

    async def shutdown(self): ...


async def test_cancelled_activation_still_resumes_every_paused_engine():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", hang=("swap_apply",))]
    fleet = Fleet(engines)
    with anyio.move_on_after(1.0):
        await fleet.activate(1)
    assert [e.paused for e in engines] == [False, False]
    assert all("resume" in e.calls for e in engines)
    # The attempt is ended, not left in its phase: b's swap was never confirmed (it may hold
    # either version) so b is fenced; a applied v1, which is live; the next activation runs.
    record = fleet.records[-1]
    assert record.outcome == act.ENGINE_FENCED and "cancelled" in record.message
    assert fleet.coordinator.idle and fleet.coordinator.fenced == {"b"} and fleet.live_version == 1
    with anyio.fail_after(10):
        assert (await fleet.activate(2)).outcome == act.ACTIVATED


async def test_a_cancelled_staging_drops_what_was_staged_and_the_version_can_be_retried():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", hang=("swap_stage",))]
    fleet = Fleet(engines)
    with anyio.move_on_after(0.5):
        await fleet.activate(1)
    assert fleet.records[-1].outcome == act.ROLLED_BACK and fleet.live_version == 0
    assert all("swap_drop" in e.calls for e in engines) and not fleet.coordinator.fenced
    engines[1].hang.clear()
    with anyio.fail_after(10):
        assert (await fleet.activate(1)).outcome == act.ACTIVATED


async def test_a_cancelled_rejoin_leaves_the_engine_fenced_and_a_later_rejoin_works():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", fail=("swap_apply",))]
    fleet = Fleet(engines)
    await fleet.activate(1)
    engines[1].fail.clear()
    engines[1].hang = {"swap_stage"}
    with anyio.move_on_after(0.5):
        await fleet.rejoin("b")
    assert fleet.coordinator.fenced == {"b"} and not fleet.coordinator.rejoining
    assert "swap_drop" in engines[1].calls
    engines[1].hang.clear()
    with anyio.fail_after(10):
        assert await fleet.rejoin("b")
    assert fleet.coordinator.serving == ("a", "b")


async def test_hanging_swap_fences_that_engine_and_the_other_goes_on():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", hang=("swap_apply",))]
    fleet = Fleet(engines, timeouts=act.PhaseTimeouts(swap_s=0.5))
    record = await fleet.activate(1)
    assert record.outcome == act.ENGINE_FENCED
    assert fleet.live_version == 1 and fleet.coordinator.serving == ("a",)
    assert [e.paused for e in engines] == [False, False]
    with pytest.raises(FencedEngineError):
        await fleet.generate([1, 2], SamplingSettings(max_tokens=3), engine_id="b")
    c = await fleet.generate([1, 2], SamplingSettings(max_tokens=3))
    assert c.engine_id == "a" and c.versions == [1, 1, 1]


async def test_hanging_resume_is_bounded_and_fences():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", hang=("resume",))]
    fleet = Fleet(engines, timeouts=act.PhaseTimeouts(resume_s=5.0),
                  fleet_timeouts=FleetTimeouts(resume_limit_s=0.3))
    with anyio.fail_after(10):
        record = await fleet.activate(1)
    assert record.outcome == act.ENGINE_FENCED and fleet.coordinator.fenced == {"b"}
    assert not engines[0].paused


async def test_an_engine_that_dies_paused_is_not_resumed_and_its_rejoin_resumes_it():
    """A link cut while the engine is paused: its pause never answers, then the fleet hears it died.
    Nothing answers a resume either, and waiting `resume_limit_s` for it held the activation (and
    the next version) that long: a dead engine is left to its rejoin, which resumes it."""
    engines = [ScriptedEngine("a"), ScriptedEngine("b", hang=("pause", "resume"))]
    fleet = Fleet(engines, fleet_timeouts=FleetTimeouts(resume_limit_s=3.0))
    record = None

    async def activate() -> None:
        nonlocal record
        record = await fleet.activate(1)

    with anyio.fail_after(60):  # a hang guard (a shielded resume waits out its own limit)
        async with anyio.create_task_group() as tg:
            tg.start_soon(activate)
            while "pause" not in engines[1].calls:
                await anyio.sleep(0.01)
            await fleet.engine_died("b", "unreachable for 12s")
    assert record.outcome == act.ENGINE_FENCED and fleet.coordinator.fenced == {"b"}
    assert "resume" not in engines[1].calls
    assert not engines[0].paused and fleet.live_version == 1
    engines[1].hang.clear()  # the link is back
    with anyio.fail_after(60):
        assert await fleet.rejoin("b")
    assert engines[1].calls[-1] == "resume" and not engines[1].paused
    assert fleet.coordinator.serving == ("a", "b")
    with anyio.fail_after(60):  # and the next activation runs over both, nothing left behind
        assert (await fleet.activate(2)).outcome == act.ACTIVATED


async def test_in_flight_rollouts_on_a_fenced_engine_end_errored_once():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", fail=("swap_apply",))]
    outcomes: list = []
    fleet = Fleet(engines, on_outcome=outcomes.append)
    results = []

    async def rollout(engine_id):
        results.append(await fleet.generate([1], SamplingSettings(max_tokens=400), engine_id=engine_id))

    async with anyio.create_task_group() as tg:
        tg.start_soon(rollout, "a")
        tg.start_soon(rollout, "b")
        await anyio.sleep(0.05)
        record = await fleet.activate(1)
    assert record.outcome == act.ENGINE_FENCED
    by_engine = {c.engine_id: c for c in results}
    assert by_engine["b"].status == "errored" and by_engine["b"].reason == "engine_fenced"
    assert by_engine["a"].status == "completed"
    assert len(outcomes) == 2


def test_request_ids_and_version_correction():
    assert fleet_request_id("generate-tokens-rabc-1f2e") == "rabc"
    assert fleet_request_id("rabc-1f2e") == "rabc"
    fleet = Fleet([ScriptedEngine("a")], strategy="pause_free", kv_policy="keep")
    track = Track("r", "a", 0, 0.0, switches=[(3, 1)])
    # vLLM labelled the first tokens after the flip with the old version; the report corrects them
    spans = [VersionSpan(0, 0, 5), VersionSpan(1, 5, 6)]
    assert fleet._versions(track, spans, 6) == [0, 0, 0, 1, 1, 1]


async def test_rejoin_resyncs_a_fenced_engine_before_it_serves():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", fail=("swap_apply",))]
    fleet = Fleet(engines)
    await fleet.activate(1)
    assert fleet.coordinator.fenced == {"b"}
    engines[1].fail.clear()
    engines[1].calls.clear()
    assert await fleet.rejoin("b")
    assert fleet.coordinator.serving == ("a", "b")
    calls = engines[1].calls
    # staged, swapped and labelled with the live version before it was resumed into the fleet
    assert calls.index("swap_stage") < calls.index("swap_apply") < calls.index("set_weight_version") \
        < calls.index("resume")
    assert engines[1].version == 1 and not engines[1].paused


@pytest.mark.parametrize("strategy,kv_policy", [("pause_swap", "recompute"), ("pause_free", "keep")])
async def test_join_next_brings_a_fenced_engine_back_with_the_next_version(strategy, kv_policy):
    engines = [ScriptedEngine("a"), ScriptedEngine("b", fail=("swap_apply",))]
    fleet = Fleet(engines, strategy=strategy, kv_policy=kv_policy)
    await fleet.activate(1)
    assert fleet.coordinator.fenced == {"b"}
    engines[1].fail.clear()
    engines[1].calls.clear()
    fleet.join_next("b")
    with pytest.raises(FencedEngineError):  # no request before the version it comes back with
        await fleet.generate([1, 2], SamplingSettings(max_tokens=2), engine_id="b")
    record = await fleet.activate(2)
    assert record.outcome == act.ACTIVATED
    assert {eo.engine: eo.outcome for eo in record.engines} == {"a": act.ACTIVATED, "b": act.ACTIVATED}
    assert fleet.coordinator.serving == ("a", "b") and fleet.live_version == 2
    calls = engines[1].calls
    assert calls.index("swap_stage") < calls.index("swap_apply") < calls.index("set_weight_version")
    assert engines[1].version == 2 and engines[1].staged_version == 2 and not engines[1].paused
    c = await fleet.generate([1, 2], SamplingSettings(max_tokens=2), engine_id="b")
    assert set(c.versions) == {2}


async def test_a_joiner_that_fails_to_stage_stays_fenced_and_the_version_goes_live():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", fail=("swap_apply",))]
    fleet = Fleet(engines)
    await fleet.activate(1)
    engines[1].fail = {"swap_stage"}
    engines[1].calls.clear()
    fleet.join_next("b")
    record = await fleet.activate(2)
    assert record.outcome == act.ACTIVATED and fleet.live_version == 2
    assert fleet.coordinator.fenced == {"b"} and "b did not join" in record.message
    # Its stage raised EngineDeadError: dead, it is sent no drop (nothing answers it; its rejoin
    # re-syncs whatever it holds) and no pause.
    assert engines[1].calls == ["swap_stage"]


class DisagreeingEngine(ScriptedEngine):
    """Two tensor-parallel workers; the second one's flip did not happen."""

    async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        answers = await super().collective_rpc(method, args, kwargs, timeout)
        if method == "swap_apply":
            return answers + [{"version": 0, "requests": {}}]
        return answers * 2


async def test_every_worker_answer_counts_and_a_partial_flip_fences_the_engine():
    engines = [ScriptedEngine("a"), DisagreeingEngine("b")]
    fleet = Fleet(engines)
    record = await fleet.activate(1)
    assert record.outcome == act.ENGINE_FENCED
    assert fleet.coordinator.fenced == {"b"}
    assert "disagree" in record.message


async def test_a_failed_staging_sends_its_drops_even_though_the_activation_ends_at_once():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", fail=("swap_stage",))]
    fleet = Fleet(engines)
    record = await fleet.activate(1)
    assert record.outcome == act.ROLLED_BACK
    # a's drop reached it: the activation's task group was cancelled right after it asked for
    # it, and an unshielded drop was never sent. b died while staging (EngineDeadError): it is
    # fenced and sent none (over a cut link it would hold the rollback up to its limit).
    assert "swap_drop" in engines[0].calls and "swap_drop" not in engines[1].calls, [e.calls for e in engines]
    assert fleet.coordinator.fenced == {"b"}


async def test_rejoin_and_activation_never_run_at_once():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", fail=("swap_apply",))]
    fleet = Fleet(engines)
    await fleet.activate(1)
    engines[1].fail.clear()
    order: list[str] = []

    async def activate():
        record = await fleet.activate(2)
        assert record.outcome == act.ACTIVATED, record
        order.append("activate")

    async def rejoin():
        await fleet.rejoin("b")
        order.append("rejoin")

    before = len(engines[0].calls)
    async with anyio.create_task_group() as tg:
        tg.start_soon(rejoin)
        while not fleet._activation_lock.locked():  # the rejoin holds the lock
            await anyio.lowlevel.checkpoint()
        tg.start_soon(activate)
        # Until the rejoin is done, nothing of the activation reaches engine a (event order,
        # not time: each step yields to every other task).
        while not order:
            assert "swap_stage" not in engines[0].calls[before:]
            await anyio.lowlevel.checkpoint()
    assert order == ["rejoin", "activate"]
    assert "swap_stage" in engines[0].calls[before:]
    assert not any(e.paused for e in engines)


async def test_a_cancelled_rollout_aborts_its_request_and_records_nothing_itself():
    aborted: list[str] = []

    class Recording(ScriptedEngine):
        async def abort(self, request_id):
            aborted.append(request_id)

    outcomes: list = []
    fleet = Fleet([Recording("a")], on_outcome=outcomes.append)
    with anyio.move_on_after(0.05):
        await fleet.generate([1], SamplingSettings(max_tokens=400), request_id="r-cancel")
    assert aborted == ["r-cancel"]
    assert not fleet.tracks and not outcomes  # a cancelled rollout has no outcome here: its caller records it


async def test_aborts_wait_for_a_paused_engine_to_resume():
    aborted: list[str] = []

    class Recording(ScriptedEngine):
        async def abort(self, request_id):
            assert not self.paused, "an abort reached a paused engine"
            aborted.append(request_id)

    engine = Recording("a")
    fleet = Fleet([engine])
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(fleet.generate, [1], SamplingSettings(max_tokens=400), request_id="r1",
                                        redispatch=False))
        await anyio.sleep(0.02)
        fleet._paused.add("a")
        engine.paused = True
        await fleet.abort_many(["r1", "finished-long-ago"])
        assert aborted == []
        engine.paused = False
        await fleet._resume(engine)
        assert aborted == ["r1"]
        tg.cancel_scope.cancel()


async def test_an_aborted_rollout_is_redispatched_at_most_max_redispatch_times():
    class AlwaysAborts(ScriptedEngine):
        async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None):
            yield TokenChunk([], [], finished=True, finish_reason="abort")

    fleet = Fleet([AlwaysAborts("a")], max_redispatch=2)
    c = await fleet.generate([1], SamplingSettings(max_tokens=3))
    assert c.status == "dropped" and c.attempts == 3
    assert c.dispatched_at is not None and c.finished_at >= c.dispatched_at


def test_pause_free_drain_that_times_out_records_old_keys_values_as_carried():
    coord = act.ActivationCoordinator(["a"], strategy="pause_free", kv_policy="drain",
                                      timeouts=act.PhaseTimeouts(drain_s=1.0))
    actions = coord.begin(1, 0.0)
    actions = coord.handle(act.Staged(engine="a", at=0.1, version=1))
    timer = [a for a in actions if isinstance(a, act.StartTimer)][0]
    actions = coord.handle(act.Timeout(engine=None, at=1.2, phase=timer.phase, token=timer.token))
    actions = coord.handle(act.Swapped(engine="a", at=1.3, version=1, requests={}))
    actions = coord.handle(act.CacheFenced(engine="a", at=1.4))
    actions = coord.handle(act.VersionSet(engine="a", at=1.5, version=1, requests={}))
    record = [a for a in actions if isinstance(a, act.Record)][0]
    assert record.outcome == act.ACTIVATED
    assert record.kv_carried is True
    assert "recomputed" not in record.message


class LateReportEngine(ScriptedEngine):
    """A pause-free flip whose report comes back only after the rollout it concerns ended: the
    worker swaps between two steps, the rollout finishes its tokens (labelled with the old
    version: the label moves later), and then the answer to swap_apply arrives. Optionally the
    confirm names a request first scheduled after the flip, or never comes (`fail`)."""

    def __init__(self, engine_id: str, **kw):
        super().__init__(engine_id, **kw)
        self.counts: dict[str, int] = {}
        self.ended = anyio.Event()
        self.salts: list[str | None] = []

    async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None):
        self.salts.append(cache_salt)
        self.counts[request_id] = 0
        for i in range(sampling.max_tokens):
            await anyio.sleep(0.002)
            self.counts[request_id] += 1
            last = i == sampling.max_tokens - 1
            yield TokenChunk([1], [-0.5], finished=last, finish_reason="length" if last else None,
                             version_spans=[VersionSpan(self.version, 0, sampling.max_tokens)] if last else None)
        self.ended.set()

    async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        if method == "swap_apply":
            await self._step(method)
            at_swap = dict(self.counts)
            await self.ended.wait()  # the rollout streams to its end before the report is back
            return [{"version": self.staged_version, "requests": at_swap}]
        return await super().collective_rpc(method, args, kwargs, timeout)


async def activate_mid_rollout(engine: ScriptedEngine, max_tokens: int = 60):
    """A pause-free activation of version 1 once a rollout on `engine` has 3 tokens; returns
    the activation's record and the rollout's completion."""
    fleet = Fleet([engine], strategy="pause_free", kv_policy="keep")
    done = []

    async def rollout():
        done.append(await fleet.generate([1], SamplingSettings(max_tokens=max_tokens)))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rollout)
            while max(engine.counts.values(), default=0) < 3:
                await anyio.sleep(0.001)
            record = await fleet.activate(1)
    (completion,) = done
    return record, completion


async def test_a_rollout_that_ends_before_its_swap_report_waits_for_it():
    record, c = await activate_mid_rollout(LateReportEngine("a"))
    assert record.outcome == act.ACTIVATED
    # the tokens after the swap are version 1 although the engine labelled every one 0
    assert c.status == "completed" and len(c.change_points()) == 2 and c.change_points()[0] == (0, 0)
    switch, version = c.change_points()[1]
    assert 3 <= switch < 60 and version == 1
    assert c.kv_carried_across_versions


async def test_a_flip_that_is_never_reported_leaves_its_rollouts_versions_unknown():
    # the swap's report comes, the confirm (the requests first scheduled after the flip) not
    _record, c = await activate_mid_rollout(LateReportEngine("a", fail=("swap_confirm",)))
    # its stream had ended before the engine was fenced: not engine_fenced, and no version is
    # invented for its tokens
    assert c.status == "errored" and c.reason == "version_unknown", (c.status, c.reason)
    assert c.token_ids == [] and c.logprobs == [] and c.change_points() == []


async def test_requests_sent_while_an_engine_swaps_share_no_prefix_cache():
    engine = LateReportEngine("a")
    fleet = Fleet([engine], strategy="pause_free", kv_policy="keep")
    done = []

    async def rollout(n):
        done.append(await fleet.generate([1], SamplingSettings(max_tokens=n)))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rollout, 60)
            while not engine.counts:
                await anyio.sleep(0.001)
            tg.start_soon(fleet.activate, 1)
            while "swap_apply" not in engine.calls:
                await anyio.sleep(0.001)
            tg.start_soon(rollout, 5)  # sent while the engine may be flipping
            tg.start_soon(rollout, 5)
    assert engine.salts[0] == "inflight-v0"
    unsettled = engine.salts[1:3]
    assert len(set(unsettled)) == 2 and all(s.startswith("inflight-v0-") for s in unsettled)
    await fleet.generate([1], SamplingSettings(max_tokens=2))
    assert engine.salts[-1] == "inflight-v1"


async def test_a_prompt_from_the_prefix_cache_after_a_flip_is_not_attributed():
    class CacheHit(ScriptedEngine):
        """Its confirm names one request as first scheduled after the flip with 16 prompt
        tokens from the prefix cache (its salt was the old version's)."""

        rid: str | None = None

        async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None):
            self.rid = request_id
            async for chunk in super().generate(request_id, prompt_token_ids, sampling, cache_salt):
                yield chunk

        async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
            if method == "swap_confirm":
                await self._step(method)
                return [{"requests": {self.rid: 0}, "cached": {self.rid: 16}}]
            return await super().collective_rpc(method, args, kwargs, timeout)

    engine = CacheHit("a")
    fleet = Fleet([engine], strategy="pause_free", kv_policy="keep")
    done = []

    async def rollout():
        done.append(await fleet.generate([1] * 20, SamplingSettings(max_tokens=100)))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rollout)
            while engine.rid is None:
                await anyio.sleep(0.001)
            record = await fleet.activate(1)
    assert record.outcome == act.ACTIVATED
    (c,) = done
    assert c.status == "errored" and c.reason == "version_unknown" and "16 prompt tokens" in c.message
    assert c.token_ids == [] and c.logprobs == [] and c.change_points() == []
