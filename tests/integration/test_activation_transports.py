"""Every transport feeds the coordinated activation: a trainer process publishes versions
through filesystem, ipc, http or collective into two real vLLM engines (in-process AsyncLLM,
`transports.swap.SwapWorkerExtension`) that keep generating; a version goes live through
`Fleet.activate` under one strategy a transport (every strategy under one at least). After each, every token of
every rollout matches a transformers forward under the version the fleet attributes it to
(both sides of the swap), and a fresh request on each engine matches the new version (1e-3,
fp32). A transport failing mid-version (a corrupted bucket, a hung trainer, a dropped
connection) activates on no engine, the old version keeps serving, the next version goes live.
"""

from __future__ import annotations

import anyio
import pytest

from orchestrator.activation import coordinator as act
from orchestrator.engines.base import SamplingSettings
from orchestrator.fleet.fleet import Fleet
from tests.integration.activation_helpers import (
    PROMPTS,
    References,
    attributable,
    load_checkpoint,
    max_err,
    under_load,
)
from transports.bench.end_to_end import TrainerProcess, perturbed_state

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(600)]
TOL = 1e-3
GREEDY = SamplingSettings(temperature=0.0, max_tokens=12, ignore_eos=True)
LOAD = SamplingSettings(temperature=1.0, max_tokens=160, ignore_eos=True)
RECEIVER_TIMEOUT_S = 8.0  # < fleet_faults.HANG_S: a hung trainer fails the stage
# One fault per transport, each a different way to fail mid-version.
FAULTS = {"filesystem": "corrupt", "ipc": "hang", "http": "drop", "collective": "corrupt"}
# What the failed stage reports. A dropped http connection truncates its bucket; the receiver
# may report that, or first time out waiting for the buckets the trainer never sent.
FAULT_ERRORS = {"corrupt": ("ChecksumError",), "hang": ("TransportTimeoutError",),
                "drop": ("TruncatedBucketError", "TransportTimeoutError")}
# (strategy, KV policy, reference): pause_free cannot recompute (nothing pauses). Each transport
# goes live under one strategy, every strategy under at least one transport: what a transport
# hands the fleet (a staged version) is the same whichever strategy then flips it, and the
# strategies themselves are tested apart (test_activation_servers, test_activation_inproc).
STRATEGY_OF = {"filesystem": ("pause_swap", "recompute", "recompute"), "ipc": ("pause_free", "keep", "carried"),
               "http": ("double_buffer", "keep", "carried"), "collective": ("pause_free", "keep", "carried")}


@pytest.fixture(scope="module")
def world(tiny_model_dir):
    base = load_checkpoint(tiny_model_dir)
    refs = References(tiny_model_dir)
    refs.add(0, base)
    return {"base": base, "refs": refs, "live": 0, "seed": 5000}


@pytest.fixture(scope="module")
async def engines(tiny_model_dir):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.inproc import InProcessEngine

    config = EngineConfig(model=str(tiny_model_dir), kind="inproc", max_model_len=512, max_num_seqs=8,
                          worker_extension_cls="transports.swap.SwapWorkerExtension")
    started = []
    try:
        for i in range(2):
            engine = InProcessEngine(config, f"act-tr-{i}")
            await engine.start()
            started.append(engine)
        yield started
    finally:
        for engine in started:
            await engine.shutdown()


async def read(trainer: TrainerProcess, timeout_s: float = 120.0) -> dict:
    return await anyio.to_thread.run_sync(trainer.read, timeout_s, abandon_on_cancel=True)


async def serves(fleet: Fleet, engines, refs: References, version: int) -> None:
    """A fresh greedy request on every engine matches `version` (and is labelled with it)."""
    for engine in engines:
        c = await fleet.generate(PROMPTS[1], GREEDY, engine_id=engine.engine_id)
        assert set(c.versions) == {version}, (engine.engine_id, c.versions)
        assert max_err(c.logprobs, refs.full(version, PROMPTS[1], c.token_ids)) < TOL, engine.engine_id


async def sync_and_activate(fleet: Fleet, trainer: TrainerProcess, version: int, seed: int,
                            fault: str | None = None):
    """Tells the trainer to publish (with `fault`), and activates `version` meanwhile."""
    answer: dict = {}

    async def publish() -> None:
        trainer.send(cmd="sync", seed=seed, fault=fault)
        answer.update(await read(trainer))

    async with anyio.create_task_group() as tg:
        tg.start_soon(publish)
        record = await fleet.activate(version)
    return record, answer


@pytest.mark.parametrize("transport", ["filesystem", "ipc", "http", "collective"])
async def test_every_transport_feeds_the_coordinated_activation(transport, engines, world, tmp_path):
    refs = world["refs"]
    ids = [e.engine_id for e in engines]
    trainer = TrainerProcess({"transport": transport, "model_dir": str(refs.model_dir), "engines": 2,
                              "timeout_s": RECEIVER_TIMEOUT_S, "bucket_bytes": 256 << 10,
                              "root": str(tmp_path / "weights"), "start_version": world["live"],
                              "wrapper": "tests.integration.fleet_faults:wrap"})
    try:
        hello = await read(trainer)
        engine_options = dict(zip(ids, hello["options"], strict=True))
        connected = False
        ok_versions = 0
        for step, (strategy, kv_policy, reference) in enumerate([STRATEGY_OF[transport]]):
            fleet = Fleet(engines, strategy=strategy, kv_policy=kv_policy, live_version=world["live"])
            await fleet.setup(hello["plan"], str(tmp_path / "weights"), timeout_s=RECEIVER_TIMEOUT_S,
                              transport=transport, engine_options=engine_options)
            if not connected:  # the receivers were built by the first setup; the trainer waited
                assert (await read(trainer))["connected"]
                connected = True

            if step == 0:  # the transport fails mid-version: nobody activates it, the old one serves
                old = world["live"]
                world["seed"] += 1
                record, answer = await sync_and_activate(fleet, trainer, old + 1, world["seed"],
                                                         fault=FAULTS[transport])
                assert record.outcome == act.ROLLED_BACK, (record.outcome, record.message)
                assert any(e in record.message for e in FAULT_ERRORS[FAULTS[transport]]), record.message
                assert answer["version"] == old + 1
                if FAULTS[transport] != "corrupt":  # the trainer itself gave the version up
                    assert not answer["ok"] and "fault injection" in answer["error"], answer
                assert fleet.live_version == old
                await serves(fleet, engines, refs, old)
                world["live"] = old + 1  # that number is spent; the next version is old + 2
                fleet = Fleet(engines, strategy=strategy, kv_policy=kv_policy, live_version=old)
                await fleet.setup(hello["plan"], str(tmp_path / "weights"), timeout_s=RECEIVER_TIMEOUT_S,
                                  transport=transport, engine_options=engine_options)
                live = old
            else:
                live = world["live"]

            version = world["live"] + 1
            world["seed"] += 1
            refs.add(version, perturbed_state(world["base"], world["seed"]))
            result: dict = {}

            async def activate(fleet=fleet, result=result, version=version, seed=world["seed"]):
                record, answer = await sync_and_activate(fleet, trainer, version, seed)
                result["answer"] = answer
                return record

            completions, record = await under_load(fleet, activate, n=4, sampling=LOAD, engines=ids)
            assert result["answer"]["ok"] and result["answer"]["version"] == version, result["answer"]
            assert record.outcome == act.ACTIVATED, (strategy, record.outcome, record.message)
            assert fleet.live_version == version
            world["live"] = version
            ok_versions += 1
            switched = [c for c in completions if len(c.change_points()) > 1]
            assert switched, "no rollout was in flight at the swap"
            assert {c.engine_id for c in completions} == set(ids)
            for c in attributable(completions):
                assert set(c.versions) <= {live, version}, c.versions
                expected = getattr(refs, reference)(c.prompt_token_ids, c.token_ids, c.versions)
                assert max_err(c.logprobs, expected) < TOL, (strategy, c.engine_id, c.change_points())
            await serves(fleet, engines, refs, version)
        assert ok_versions == 1
        if transport == "collective":
            await a_broken_group_comes_back_after_a_new_rendezvous(engines, world, trainer, hello["plan"],
                                                                   engine_options)
    finally:
        await anyio.to_thread.run_sync(trainer.close)


@pytest.mark.parametrize("transport", ["ipc", "http"])
async def test_a_fenced_engine_comes_back_with_the_next_pushed_version(transport, engines, world, tmp_path):
    """A push trainer never resends the live version, so a fenced engine comes back with the
    next one: engine 1 is fenced and left out by the trainer, version v goes live on engine 0
    alone (engine 1 gets no request meanwhile); the trainer takes engine 1 back, the fleet
    `join_next`s it, and v + 1 goes live on both at one instant, engine 1 serving it."""
    refs = world["refs"]
    ids = [e.engine_id for e in engines]
    trainer = TrainerProcess({"transport": transport, "model_dir": str(refs.model_dir), "engines": 2,
                              "timeout_s": RECEIVER_TIMEOUT_S, "bucket_bytes": 256 << 10,
                              "root": str(tmp_path / "weights"), "start_version": world["live"]})
    try:
        hello = await read(trainer)
        fleet = Fleet(engines, strategy="pause_free", kv_policy="keep", live_version=world["live"])
        await fleet.setup(hello["plan"], None, timeout_s=RECEIVER_TIMEOUT_S, transport=transport,
                          engine_options=dict(zip(ids, hello["options"], strict=True)))
        assert (await read(trainer))["connected"]
        old = world["live"]
        await fleet.engine_died(ids[1], "injected: taken out of service")
        assert fleet.coordinator.fenced == {ids[1]}
        trainer.send(cmd="exclude", engine=1)
        assert (await read(trainer))["ok"]

        alone = old + 1
        world["seed"] += 1
        refs.add(alone, perturbed_state(world["base"], world["seed"]))
        record, answer = await sync_and_activate(fleet, trainer, alone, world["seed"])
        assert answer["ok"] and answer["version"] == alone, answer
        assert record.outcome == act.ACTIVATED and [eo.engine for eo in record.engines] == [ids[0]]
        world["live"] = alone
        await serves(fleet, engines[:1], refs, alone)
        # Straight to the engine, unsalted: a prompt of its own, so no cached block of other weights
        prompt = [*PROMPTS[1], 900 + len(transport)]
        left_out = await engines[1].complete(f"left-out-{transport}", prompt, GREEDY)
        assert set(left_out.versions) == {old}
        assert max_err(left_out.logprobs, refs.full(old, prompt, left_out.token_ids)) < TOL

        trainer.send(cmd="include", engine=1)
        assert (await read(trainer))["ok"]
        fleet.join_next(ids[1])
        both = alone + 1
        world["seed"] += 1
        refs.add(both, perturbed_state(world["base"], world["seed"]))
        record, answer = await sync_and_activate(fleet, trainer, both, world["seed"])
        assert answer["ok"] and answer["version"] == both, answer
        assert record.outcome == act.ACTIVATED, record.message
        assert {eo.engine: eo.outcome for eo in record.engines} == {i: act.ACTIVATED for i in ids}
        assert fleet.coordinator.serving == tuple(ids)
        world["live"] = both
        await serves(fleet, engines, refs, both)
    finally:
        await anyio.to_thread.run_sync(trainer.close)


async def a_broken_group_comes_back_after_a_new_rendezvous(engines, world, trainer, plan_json,
                                                            engine_options) -> None:
    """A trainer that hangs mid-version breaks the collective group (the engines' broadcast
    times out): that version activates nowhere, and so does the next one while the group is
    broken (the stage fails at once, naming the rendezvous it needs). The trainer reconnects
    (a fresh store and group), the fleet hands the engines the new options, and the next
    version goes live."""
    refs = world["refs"]
    ids = [e.engine_id for e in engines]
    old = world["live"]
    fleet = Fleet(engines, strategy="pause_free", kv_policy="keep", live_version=old)
    await fleet.setup(plan_json, None, timeout_s=RECEIVER_TIMEOUT_S, transport="collective",
                      engine_options=engine_options)
    world["seed"] += 1
    record, answer = await sync_and_activate(fleet, trainer, old + 1, world["seed"], fault="hang")
    assert record.outcome == act.ROLLED_BACK and "TransportTimeoutError" in record.message, record.message
    assert not answer["ok"]
    record = await fleet.activate(old + 2)  # nothing sent: the broken group refuses at once
    assert record.outcome == act.ROLLED_BACK and "fresh rendezvous" in record.message, record.message
    await serves(fleet, engines, refs, old)

    trainer.send(cmd="reconnect")
    options = (await read(trainer))["options"]
    await fleet.setup(plan_json, None, timeout_s=RECEIVER_TIMEOUT_S, transport="collective",
                      engine_options=dict(zip(ids, options, strict=True)))
    assert (await read(trainer))["connected"]
    version = old + 2  # the trainer's failed version stays stale; this sync marks old + 2
    world["seed"] += 1
    refs.add(version, perturbed_state(world["base"], world["seed"]))
    record, answer = await sync_and_activate(fleet, trainer, version, world["seed"])
    assert answer["ok"] and answer["version"] == version, answer
    assert record.outcome == act.ACTIVATED, record.message
    world["live"] = version
    await serves(fleet, engines, refs, version)
