"""Coordinated activation on two real vLLM CPU engines, each a separate server process running
`transports.swap.SwapWorkerExtension`, under continuous streaming load.

Every token's logprob is recomputed by a transformers forward under the version the fleet
attributes it to (full recompute, or with the keys/values carried across the switch for
`keep` / the pause-free flip) and must match within 1e-3; the change point is then at the
exact token. Failures: a stage that fails on one engine, a stage that hangs, an engine killed
during the pause. The module's last test kills an engine; tests run in file order.
"""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from orchestrator.activation import coordinator as act
from orchestrator.engines.base import SamplingSettings
from orchestrator.errors import EngineGenerateError
from orchestrator.fleet.fleet import Fleet
from tests.integration.activation_helpers import (
    LOAD,
    PROMPTS,
    FaultyEngine,
    References,
    attributable,
    explain_mismatch,
    new_world,
    publish_next,
    max_err,
    under_load,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]
TOL = 1e-3
GREEDY = SamplingSettings(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def world(tiny_model_dir, tmp_path_factory):
    return new_world(tiny_model_dir, tmp_path_factory.mktemp("weights"))


def new_version(world) -> int:
    return publish_next(world, seed_base=1000)


@pytest.fixture(scope="module")
async def servers(tiny_model_dir, engine_log_dir):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.server import ServerEngine

    config = EngineConfig(model=str(tiny_model_dir), kind="server", max_model_len=512, max_num_seqs=16,
                          worker_extension_cls="transports.swap.SwapWorkerExtension")
    engines = [ServerEngine(config, f"act-{i}", log_dir=engine_log_dir) for i in range(2)]
    try:
        async with anyio.create_task_group() as tg:
            for e in engines:
                tg.start_soon(e.start)
        yield engines
    finally:
        for e in engines:
            await e.shutdown()


async def make_fleet(engines, world, strategy="pause_swap", kv_policy="recompute", **kw) -> Fleet:
    live = world.get("live", 0)
    world["outcomes"] = []
    fleet = Fleet(engines, strategy=strategy, kv_policy=kv_policy, live_version=live,
                  on_outcome=world["outcomes"].append, **kw)
    await fleet.setup(world["pub"].plan_json, world["pub"].root)
    return fleet


def check_provenance(completions, refs: References, carried: bool = False) -> list[int]:
    """Every token matches its recorded version; returns the interior change points seen."""
    interior = []
    for c in attributable(completions):
        if carried:
            ref = refs.carried(c.prompt_token_ids, c.token_ids, c.versions)
        else:
            ref = refs.recompute(c.prompt_token_ids, c.token_ids, c.versions)
        assert max_err(c.logprobs, ref) < TOL, explain_mismatch(c, refs)
        for k, _v in c.change_points()[1:]:
            interior.append(k)
            # the check discriminates: the token at the change point does not match the old version
            old = c.versions[k - 1]
            wrong = refs.full(old, c.prompt_token_ids, c.token_ids)
            assert max_err(wrong[k:], c.logprobs[k:]) > 10 * TOL
    return interior


async def activate_across_rollouts(fleet, world, *, carried: bool = False, before=None, attempts: int = 3):
    """Activates a new version under load, checking every token's version, until a rollout was
    in flight across the switch (a change point inside its completion); which rollouts cross
    depends on timing (a CI run once saw none), so up to `attempts` versions. `before()`, if
    given, runs before each switch. Returns (the version, its completions, its activation
    record, what the last `before()` returned)."""
    seen = []
    for _ in range(attempts):
        observed = await before() if before is not None else None
        v = new_version(world)
        completions, record = await under_load(fleet, lambda: fleet.activate(v), n=4)
        assert record.outcome == act.ACTIVATED, record
        world["live"] = v
        interior = check_provenance(completions, world["refs"], carried=carried)
        if interior:
            return v, completions, record, observed
        seen.append([(c.engine_id, c.status, len(c.token_ids), c.change_points()) for c in completions])
    raise AssertionError(f"no rollout was in flight across any of {attempts} switches: {seen}")


async def check_serves(engines, refs: References, version: int) -> None:
    for e in engines:
        c = await e.complete(f"probe-{e.engine_id}-{version}-{os.urandom(3).hex()}", PROMPTS[0], GREEDY)
        assert max_err(c.logprobs, refs.full(version, PROMPTS[0], c.token_ids)) < TOL
        assert not await e.is_paused()


async def test_recompute_pause_swap_under_load(servers, world):
    fleet = await make_fleet(servers, world)
    v, completions, record, _ = await activate_across_rollouts(fleet, world)
    assert fleet.live_version == v
    assert {eo.engine for eo in record.engines} == {"act-0", "act-1"}
    assert not record.kv_carried
    assert all(not c.kv_carried_across_versions for c in completions)
    # a request submitted right after the activation (same prompt: the prefix cache is fenced)
    for engine_id in ("act-0", "act-1"):
        c = await fleet.generate(PROMPTS[0], GREEDY, engine_id=engine_id)
        assert set(c.versions) == {v}
        assert max_err(c.logprobs, world["refs"].full(v, PROMPTS[0], c.token_ids)) < TOL


async def test_one_engine_failing_to_stage_activates_neither(servers, world):
    async def refuse(inner, method, args, kwargs, timeout):
        raise EngineGenerateError(inner.engine_id, "injected: staging refused")

    faulty = FaultyEngine(servers[1], swap_stage=refuse)
    fleet = await make_fleet([servers[0], faulty], world)
    live = fleet.live_version
    v = new_version(world)
    completions, record = await under_load(fleet, lambda: fleet.activate(v), n=2)
    assert record.outcome == act.ROLLED_BACK and fleet.live_version == live
    assert all(c.status == "completed" and set(c.versions) == {live} for c in completions), \
        [(c.engine_id, c.status, c.reason, c.message[:300], set(c.versions)) for c in completions]
    check_provenance(completions, world["refs"])
    await check_serves(servers, world["refs"], live)  # both keep generating on v-1
    for e in servers:
        status = (await e.collective_rpc("swap_status"))[0]
        assert status["state"] == "idle"  # the staged copy was dropped
    # the next version tries again and succeeds
    fleet2 = await make_fleet(servers, world)
    v2 = new_version(world)
    record = await fleet2.activate(v2)
    assert record.outcome == act.ACTIVATED
    world["live"] = v2
    await check_serves(servers, world["refs"], v2)


async def test_hanging_stage_times_out_and_old_version_serves(servers, world):
    async def hang(inner, method, args, kwargs, timeout):
        await anyio.sleep_forever()

    faulty = FaultyEngine(servers[0], swap_status=hang)
    fleet = await make_fleet([faulty, servers[1]], world, timeouts=act.PhaseTimeouts(stage_s=3.0))
    live = fleet.live_version
    v = new_version(world)
    with anyio.fail_after(60):
        record = await fleet.activate(v)
    assert record.outcome == act.ROLLED_BACK and "timed out" in record.message
    assert fleet.live_version == live
    await check_serves(servers, world["refs"], live)


async def test_double_buffer_provenance_and_rollback(servers, world):
    fleet = await make_fleet(servers, world, strategy="double_buffer")

    async def probe():  # the version live before a switch (the other buffer after it), its output
        return fleet.live_version, await servers[0].complete(f"db-before-{os.urandom(3).hex()}", PROMPTS[1], GREEDY)

    _v, _completions, _record, (old, probe_before) = await activate_across_rollouts(fleet, world, before=probe)
    # flip back: the old weights, named by a new version number, give the old outputs exactly
    rb = world["next"]
    world["next"] += 1
    world["refs"].models[rb] = world["refs"].models[old]
    record = await fleet.activate(rb, rollback=True)
    assert record.outcome == act.ACTIVATED and fleet.live_version == rb
    world["live"] = rb
    probe_after = await servers[0].complete("db-after", PROMPTS[1], GREEDY)
    assert probe_after.token_ids == probe_before.token_ids
    assert probe_after.logprobs == probe_before.logprobs


async def test_pause_free_flip_provenance(servers, world):
    fleet = await make_fleet(servers, world, strategy="pause_free", kv_policy="keep")
    paused_calls = []

    async def spy_pause(inner, *args):
        paused_calls.append(inner.engine_id)
        return await inner.pause(*args)

    fleet.engines = {e.engine_id: FaultyEngine(e, pause=spy_pause) for e in servers}
    v, completions, record, _ = await activate_across_rollouts(fleet, world, carried=True)
    assert paused_calls == []
    assert record.kv_carried
    carried = [c for c in completions if len(c.change_points()) > 1]
    assert carried and all(c.kv_carried_across_versions for c in carried)
    await check_serves(servers, world["refs"], v)


async def test_engine_killed_during_the_pause_is_fenced(servers, world):
    async def pause_then_die(inner, mode, clear_cache):
        await inner.pause(mode, clear_cache)
        os.killpg(inner.process.pid, signal.SIGKILL)

    faulty = FaultyEngine(servers[1], pause=pause_then_die)
    fleet = await make_fleet([servers[0], faulty], world,
                             timeouts=act.PhaseTimeouts(swap_s=20.0, resume_s=10.0))
    v = new_version(world)
    n = 4
    completions, record = await under_load(fleet, lambda: fleet.activate(v), n=n,
                                           engines=["act-0", "act-1"])
    assert record.outcome == act.ENGINE_FENCED
    assert fleet.live_version == v and fleet.coordinator.fenced == {"act-1"}
    assert fleet.coordinator.serving == ("act-0",)
    # every rollout has exactly one terminal outcome
    outcomes = world["outcomes"]
    assert len({c.request_id for c in outcomes}) == len(outcomes) == len(completions)
    assert not fleet.tracks
    assert any(c.engine_id == "act-1" and c.status == "errored" for c in completions)
    for c in completions:
        if c.engine_id == "act-1":
            assert c.status in ("errored", "completed")
        else:
            assert c.status == "completed"
            check_provenance([c], world["refs"])
    await check_serves([servers[0]], world["refs"], v)  # not paused, serving v
    with pytest.raises(Exception):
        await fleet.generate(PROMPTS[0], GREEDY, engine_id="act-1")
