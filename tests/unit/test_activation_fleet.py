"""The fleet performer without a real engine: a hand-written fault injector that plays the
worker extension's answers and can hang or fail any step. Checks what the structure
guarantees: resume even when the activation is cancelled or a step hangs, fenced engines get
no new requests, per-token versions follow the swap reports."""

from __future__ import annotations

import functools

import anyio
import pytest

from orchestrator import activation as act
from orchestrator.engines.base import Engine, SamplingSettings, TokenChunk, VersionSpan
from orchestrator.errors import EngineDeadError, FencedEngineError
from orchestrator.fleet import Fleet, FleetTimeouts, Track, fleet_request_id

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
            self.state = "staged"
        if method == "swap_status":
            return [{"state": self.state, "version": 1}]
        if method == "swap_apply":
            return [{"version": 1, "requests": {}}]
        return [{}]

    async def shutdown(self): ...


async def test_cancelled_activation_still_resumes_every_paused_engine():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", hang=("swap_apply",))]
    fleet = Fleet(engines)
    with anyio.move_on_after(1.0):
        await fleet.activate(1)
    assert [e.paused for e in engines] == [False, False]
    assert all("resume" in e.calls for e in engines)


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


async def test_in_flight_rollouts_on_a_fenced_engine_end_errored_once():
    engines = [ScriptedEngine("a"), ScriptedEngine("b", fail=("swap_apply",))]
    fleet = Fleet(engines)
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
    assert len(fleet.completions) == 2


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


async def test_records_reach_the_replay_log(tmp_path):
    from replay.log import ReplayLog, read_records
    from replay.records import ActivationRecord, RolloutRecord

    engines = [ScriptedEngine("a"), ScriptedEngine("b", fail=("swap_apply",))]
    with ReplayLog.open(tmp_path) as log:
        fleet = Fleet(engines, replay_log=log)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(fleet.generate, [1], SamplingSettings(max_tokens=400), engine_id="b"))
            await anyio.sleep(0.05)
            await fleet.activate(1)
        await fleet.generate([1], SamplingSettings(max_tokens=3))
    records = list(read_records(tmp_path))
    activations = [r for r in records if isinstance(r, ActivationRecord)]
    rollouts = [r for r in records if isinstance(r, RolloutRecord)]
    assert [a.outcome for a in activations] == [act.ENGINE_FENCED]
    assert {e.engine_id: e.outcome for e in activations[0].engines} == {"a": "activated", "b": "engine_fenced"}
    assert sorted(r.status_name for r in rollouts) == ["completed", "errored"]
    done = [r for r in rollouts if r.status_name == "completed"][0]
    assert done.change_points() == [(0, 1)]
