"""LoRA versions on real vLLM engines (the `adapter` activation strategy): each version is a
PEFT adapter loaded natively beside the serving ones, activated with no pause; every token's
logprob equals a transformers forward of base + that version's adapter; the adapter is read and
built in the worker before the step that makes it live; a load refused on one engine activates
nothing; at most `max_loras` adapters stay loaded while requests under old
adapters finish on them; no prefix-cache entry crosses adapter versions."""

from __future__ import annotations

import anyio
import pytest

from orchestrator.activation import coordinator as act
from orchestrator.config.run import EngineConfig
from orchestrator.engines.base import AdapterRef, SamplingSettings
from orchestrator.errors import EngineGenerateError
from orchestrator.fleet.fleet import Fleet
from orchestrator.fleet.adapters import AdapterStore, adapter_name
from tests.integration.lora_helpers import make_adapter, reference_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]
TOL = 1e-3
SAMPLING = SamplingSettings(temperature=1.0, max_tokens=12, ignore_eos=True, seed=0)
PROMPTS = [[5, 17, 33, 9, 12], [40, 41, 42], [7, 7, 8, 100, 3, 64]]
MAX_LORAS = 3


def lora_engine_config(model_dir, **kw) -> EngineConfig:
    """With the swap extension, as every `inflight run` engine: adapters are staged off the step."""
    kw.setdefault("worker_extension_cls", "transports.swap.SwapWorkerExtension")
    return EngineConfig(model=str(model_dir), kind="inproc", max_model_len=512, max_num_seqs=16,
                        enable_lora=True, max_lora_rank=8, max_loras=MAX_LORAS, **kw)


@pytest.fixture(scope="module")
async def engine(tiny_model_dir):
    from orchestrator.engines.inproc import InProcessEngine

    e = InProcessEngine(lora_engine_config(tiny_model_dir), "lora-inproc")
    await e.start()
    try:
        yield e
    finally:
        await e.shutdown()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-weights")


def fleet_of(engines, root, live: int = 0) -> Fleet:
    return Fleet(engines, strategy="adapter", kv_policy="drain", live_version=live,
                 adapters=AdapterStore(root=root, max_loras=MAX_LORAS))


async def unload_all(engine, root) -> None:
    """The module's engine is shared: a test starts with no adapter loaded."""
    for name in await engine.loaded_adapters():
        await engine.unload_adapter(AdapterStore(root, MAX_LORAS).ref(int(name.removeprefix("inflight-v"))))
    assert await engine.loaded_adapters() == []


def check_against_reference(model_dir, root, completion, version):
    adapter_dir = None if version == 0 else root / f"v{version:08d}"
    ref = reference_logprobs(model_dir, adapter_dir, completion.prompt_token_ids, completion.token_ids)
    err = max(abs(a - b) for a, b in zip(ref, completion.logprobs))
    assert err <= TOL, f"v{version}: max |engine - transformers(base + adapter)| = {err}"


async def test_each_version_is_activated_with_no_pause_and_samples_under_its_adapter(engine, tiny_model_dir, root):
    fleet = fleet_of([engine], root)
    for version in (1, 2):
        make_adapter(tiny_model_dir, root, version, seed=100 + version)
        record = await fleet.activate(version)
        assert record.outcome == act.ACTIVATED, record.message
        assert record.strategy == "adapter"
        assert all(e.pause_s == 0.0 for e in record.engines), "an adapter activation never pauses an engine"
        assert fleet.live_version == version
        for prompt in PROMPTS:
            c = await fleet.generate(prompt, SAMPLING)
            assert c.status == "completed", c.message
            assert c.changes == [(0, version)] and c.dispatched_version == version
            check_against_reference(tiny_model_dir, root, c, version)
    # The adapter really changes what is sampled: version 0 (the base) differs from version 2.
    base = reference_logprobs(tiny_model_dir, None, c.prompt_token_ids, c.token_ids)
    assert max(abs(a - b) for a, b in zip(base, c.logprobs)) > 1e-2
    # Version 1 is retired once version 2 is live and nothing uses it.
    assert await engine.loaded_adapters() == [adapter_name(2)]


async def test_requests_in_flight_finish_on_their_adapter_and_at_most_max_loras_stay_loaded(
        engine, tiny_model_dir, root):
    fleet = fleet_of([engine], root, live=2)
    fleet.resident[engine.engine_id] = {2: fleet.request_adapter(2)}  # loaded by the test above
    long = SamplingSettings(temperature=1.0, max_tokens=400, ignore_eos=True, seed=1)
    seen_in_flight: list[int] = []
    most_loaded = 0
    # Every version published before the long requests start, as a trainer ahead of the fleet has:
    # building one (a PEFT model, on this loop) inside the loop below took seconds under load, and
    # the 400-token requests could end before the first activation.
    for version in range(3, 23):
        make_adapter(tiny_model_dir, root, version, seed=100 + version)
    async with anyio.create_task_group() as tg:
        results: list = []

        async def one(prompt):
            results.append(await fleet.generate(prompt, long))

        for prompt in PROMPTS:
            tg.start_soon(one, prompt)
        while len(fleet.tracks) < len(PROMPTS) or not any(t.n_tokens for t in fleet.tracks.values()):
            await anyio.sleep(0.01)
        for version in range(3, 23):
            record = await fleet.activate(version)
            assert record.outcome == act.ACTIVATED, record.message
            loaded = await engine.loaded_adapters()
            most_loaded = max(most_loaded, len(loaded))
            assert len(loaded) <= MAX_LORAS, f"after v{version}: {loaded}"
            if fleet.tracks:
                seen_in_flight.append(version)
                assert adapter_name(2) in loaded, "an adapter a request still uses was unloaded"
            # a request sent now samples under the new version
            c = await fleet.generate(PROMPTS[0], SAMPLING)
            assert c.changes == [(0, version)], c.changes
    assert seen_in_flight, "the long requests ended before the first activation: nothing was shown"
    assert len(results) == len(PROMPTS)
    for c in results:
        assert c.status == "completed" and len(c.token_ids) == 400
        assert c.changes == [(0, 2)], "a request in flight finished on the adapter it began with"
        check_against_reference(tiny_model_dir, root, c, 2)
    make_adapter(tiny_model_dir, root, 23, seed=123)
    assert (await fleet.activate(23)).outcome == act.ACTIVATED
    assert await engine.loaded_adapters() == [adapter_name(23)], "v2 is retired once its requests ended"


async def test_no_prefix_cache_entry_crosses_adapter_versions(engine, tiny_model_dir, root):
    """Straight to vLLM, without the fleet's version salt: the adapter's name alone fences."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    await unload_all(engine, root)
    for version in (30, 31):
        path = make_adapter(tiny_model_dir, root, version, seed=version)
        await engine.load_adapter(AdapterStore(root, MAX_LORAS).ref(version))
        assert str(path) == AdapterStore(root, MAX_LORAS).ref(version).path
    prompt = {"prompt_token_ids": [(i * 7) % 300 + 3 for i in range(300)]}
    params = SamplingParams(max_tokens=1, temperature=0.0)

    async def cached_tokens(version: int, rid: str) -> int:
        ref = AdapterStore(root, MAX_LORAS).ref(version)
        out = None
        async for out in engine.llm.generate(prompt, params, rid, lora_request=LoRARequest(ref.name, ref.int_id, ref.path)):
            pass
        return out.num_cached_tokens or 0

    await engine.reset_prefix_cache()
    assert await cached_tokens(30, "pc-a") == 0
    assert await cached_tokens(30, "pc-b") > 0, "the same prompt under the same adapter hits the cache"
    assert await cached_tokens(31, "pc-c") == 0, "another version's adapter must not read v30's blocks"
    for version in (30, 31):
        await engine.unload_adapter(AdapterStore(root, MAX_LORAS).ref(version))


class RefusesVersion:
    """Fault injection: an engine whose adapter load of one version fails (a disk error)."""

    def __init__(self, engine, version: int) -> None:
        self._engine, self.version = engine, version
        self.engine_id = engine.engine_id

    async def load_adapter(self, adapter):
        if adapter.int_id == self.version:
            raise EngineGenerateError(self.engine_id, f"injected: cannot load {adapter.name}")
        return await self._engine.load_adapter(adapter)

    def __getattr__(self, name):
        return getattr(self._engine, name)


async def test_a_load_refused_on_one_engine_activates_nothing_then_the_next_version_does(
        engine, tiny_model_dir, root, engine_log_dir):
    """Two engines, one a vLLM server (its adapters load over HTTP): the server refuses v41."""
    from orchestrator.engines.server import ServerEngine

    server = ServerEngine(EngineConfig(model=str(tiny_model_dir), kind="server", max_model_len=512, max_num_seqs=16,
                                       enable_lora=True, max_lora_rank=8, max_loras=MAX_LORAS,
                                       worker_extension_cls="transports.swap.SwapWorkerExtension",
                                       control_timeout_s=300.0), "lora-server", log_dir=engine_log_dir)
    await server.start()
    try:
        await unload_all(engine, root)
        faulty = RefusesVersion(server, 41)
        fleet = fleet_of([engine, faulty], root)
        make_adapter(tiny_model_dir, root, 40, seed=40)
        assert (await fleet.activate(40)).outcome == act.ACTIVATED
        make_adapter(tiny_model_dir, root, 41, seed=41)
        record = await fleet.activate(41)
        assert record.outcome == act.ROLLED_BACK, record
        assert "injected" in record.message
        assert fleet.live_version == 40
        assert adapter_name(41) not in await engine.loaded_adapters(), "the engine that loaded v41 dropped it"
        for prompt in PROMPTS:  # both engines still serve v40
            for target in (engine.engine_id, server.engine_id):
                c = await fleet.generate(prompt, SAMPLING, engine_id=target)
                assert c.status == "completed" and c.changes == [(0, 40)]
                check_against_reference(tiny_model_dir, root, c, 40)
        make_adapter(tiny_model_dir, root, 42, seed=42)
        assert (await fleet.activate(42)).outcome == act.ACTIVATED
        c = await fleet.generate(PROMPTS[0], SAMPLING, engine_id=server.engine_id)
        assert c.changes == [(0, 42)]
        check_against_reference(tiny_model_dir, root, c, 42)
        assert await server.loaded_adapters() == [adapter_name(42)]
        # The next run attaches to this server: it starts from version 0, no adapter of ours left.
        attached = ServerEngine(EngineConfig(model=str(tiny_model_dir), kind="server", url=server.url,
                                             enable_lora=True, max_lora_rank=8, max_loras=MAX_LORAS,
                                             worker_extension_cls="transports.swap.SwapWorkerExtension",
                                             control_timeout_s=300.0), "lora-attached")
        await attached.start()
        try:
            assert await attached.loaded_adapters() == []
        finally:
            await attached.shutdown()
    finally:
        await server.shutdown()


async def test_a_corrupt_adapter_fails_the_stage_naming_the_tensor(engine, tiny_model_dir, root):
    await unload_all(engine, root)
    fleet = fleet_of([engine], root)
    path = make_adapter(tiny_model_dir, root, 50, seed=50)
    data = bytearray((path / "adapter_model.safetensors").read_bytes())
    data[-8:] = b"\xff" * 8  # the last tensor's last values become NaN
    (path / "adapter_model.safetensors").write_bytes(bytes(data))
    record = await fleet.activate(50)
    assert record.outcome == act.ROLLED_BACK
    assert "AdapterError" in record.message and "lora_" in record.message, record.message
    assert fleet.live_version == 0


async def test_targets_the_engine_cannot_serve_are_refused_at_start_naming_the_field(engine, tiny_model_dir, tmp_path):
    from orchestrator.config.run import LoraConfig
    from orchestrator.errors import ConfigError
    from orchestrator.fleet.adapters import probe_targets

    await probe_targets([engine], str(tiny_model_dir), LoraConfig(rank=8, target_modules=["q_proj", "down_proj"]),
                        tmp_path)
    assert not (tmp_path / "lora-probe").exists(), "the probe adapter is removed"
    with pytest.raises(ConfigError) as err:
        await probe_targets([engine], str(tiny_model_dir), LoraConfig(rank=8, target_modules=["q_proj", "lm_head"]),
                            tmp_path)
    assert err.value.field == "trainer.lora.target_modules" and "lm_head" in str(err.value)
    assert "inflight-probe" not in await engine.loaded_adapters()


async def test_the_adapter_is_read_and_built_before_the_step_that_makes_it_live(engine, tiny_model_dir, root):
    """Staged in the worker (read, built and packed on a thread beside generation), the adapter's
    files may be gone by the time vLLM's add_lora runs: that step takes the staged adapter and
    reads nothing. An adapter loaded without staging is read in the step (the worker says so)."""
    from vllm.lora.request import LoRARequest

    from orchestrator.engines.adapter_stage import stage_adapter

    await unload_all(engine, root)
    store = AdapterStore(root, MAX_LORAS)
    path = make_adapter(tiny_model_dir, root, 60, seed=60)
    assert await stage_adapter(engine, store.ref(60), 60.0) > 0.0
    assert await engine.loaded_adapters() == [], "staged is not loaded: vLLM holds nothing yet"
    # ... but its tensors are in a slot already, reserved from vLLM's own activations
    assert await slots(engine) == ["reserved", None, None, "kept_empty"]
    hidden = path.with_name(path.name + ".hidden")
    path.rename(hidden)
    try:
        await engine.load_adapter(store.ref(60))  # vLLM's add_lora, with no file to read
        assert await engine.loaded_adapters() == [adapter_name(60)]
        fleet = fleet_of([engine], root, live=60)
        fleet.resident[engine.engine_id] = {60: store.ref(60)}
        completions = [await fleet.generate(prompt, SAMPLING) for prompt in PROMPTS]
    finally:
        hidden.rename(path)
    for c in completions:
        assert c.status == "completed" and c.changes == [(0, 60)], c.message
        check_against_reference(tiny_model_dir, root, c, 60)  # the staged tensors are the adapter's
    events = await stage_events(engine, path)
    # The step that made it live took the slot the staging filled: no copy in the step.
    assert [e["event"] for e in events] == ["staged", "taken", "live_from_slot"], events
    assert events[0]["slot"] == events[2]["slot"] == 0
    assert await slots(engine) == [store.ref(60).int_id, None, None, "kept_empty"]

    # The worker's record can tell the other way: without a stage, add_lora reads the files itself.
    other = make_adapter(tiny_model_dir, root, 61, seed=61)
    ref = store.ref(61)
    await engine.llm.add_lora(LoRARequest(ref.name, ref.int_id, ref.path))
    assert [e["event"] for e in await stage_events(engine, other)] == ["loaded_in_step"]
    await engine.unload_adapter(ref)

    # A stage that cannot read its adapter refuses the load, naming it, and nothing is held.
    missing = AdapterRef(name="inflight-v62", int_id=62, path=str(root / "v00000062"))
    with pytest.raises(EngineGenerateError) as err:
        await engine.load_adapter(missing)
    assert "inflight-v62" in str(err.value)
    assert await engine.loaded_adapters() == [adapter_name(60)]
    await engine.unload_adapter(store.ref(60))


async def slots(engine) -> list:
    return (await engine.collective_rpc("lora_slots"))[0]


async def stage_events(engine, path) -> list[dict]:
    return [e for e in (await engine.collective_rpc("lora_stage_events"))[0] if e["path"] == str(path)]


async def test_stages_holding_every_slot_give_them_back_to_a_load_vllm_makes_itself(engine, tiny_model_dir, root):
    """Three stages fill the engine's three slots off the step. vLLM's own load of another adapter
    (no stage) then finds none free: the stages give theirs back (never while one copies into it),
    that load takes a slot, and a staged adapter made live after it is copied in its step instead
    of taken from a slot. Every token is still its adapter's; an unstage frees nothing twice."""
    from vllm.lora.request import LoRARequest

    from orchestrator.engines.adapter_stage import stage_adapter, unstage_adapter

    await unload_all(engine, root)
    store = AdapterStore(root, MAX_LORAS)
    paths = {v: make_adapter(tiny_model_dir, root, v, seed=v) for v in (70, 71, 72, 73)}
    for v in (70, 71, 72):
        await stage_adapter(engine, store.ref(v), 60.0)
    assert await slots(engine) == ["reserved"] * MAX_LORAS + ["kept_empty"]
    filled = [e["slot"] for v in (70, 71, 72) for e in (await stage_events(engine, paths[v]))]  # one "staged" each
    assert sorted(filled) == [0, 1, 2], filled

    ref = store.ref(73)
    await engine.llm.add_lora(LoRARequest(ref.name, ref.int_id, ref.path))  # vLLM's own load, no stage
    assert await slots(engine) == [ref.int_id, None, None, "kept_empty"]
    await engine.load_adapter(store.ref(70))  # staged, its slot given back: copied in the step
    assert [e["event"] for e in await stage_events(engine, paths[70])] == ["staged", "taken"]
    assert await slots(engine) == [ref.int_id, store.ref(70).int_id, None, "kept_empty"]
    for v in (71, 72):
        await unstage_adapter(engine, store.ref(v), 60.0)
    assert await slots(engine) == [ref.int_id, store.ref(70).int_id, None, "kept_empty"]

    for version in (70, 73):
        fleet = fleet_of([engine], root, live=version)
        fleet.resident[engine.engine_id] = {version: store.ref(version)}
        for prompt in PROMPTS:
            c = await fleet.generate(prompt, SAMPLING)
            assert c.status == "completed" and c.changes == [(0, version)], c.message
            check_against_reference(tiny_model_dir, root, c, version)
    # A stage now finds the last slot free and fills it; its load then copies nothing.
    await stage_adapter(engine, store.ref(72), 60.0)
    assert await slots(engine) == [ref.int_id, store.ref(70).int_id, "reserved", "kept_empty"]
    await engine.load_adapter(store.ref(72))
    assert [e["event"] for e in await stage_events(engine, paths[72])][-2:] == ["taken", "live_from_slot"]
    fleet = fleet_of([engine], root, live=72)
    fleet.resident[engine.engine_id] = {72: store.ref(72)}
    c = await fleet.generate(PROMPTS[0], SAMPLING)
    check_against_reference(tiny_model_dir, root, c, 72)
    for v in (70, 72, 73):
        await engine.unload_adapter(store.ref(v))
    assert await slots(engine) == [None] * MAX_LORAS + ["kept_empty"]


async def test_a_request_without_an_adapter_beside_one_with_an_adapter_samples_the_base_with_every_slot_full(
        engine, tiny_model_dir, root):
    """vLLM's CPU LoRA kernels read the last slot for the tokens of a request without an adapter in a
    batch beside one with an adapter (index -1 into the stacked weights): with that slot filled, its
    logprobs were the filling adapter's, 3.7 nats off the base's (measured 2026-12-05 on vLLM 0.32).
    The engine has a slot past `max_loras`, kept empty: with every slot it serves full, a request
    of version 0 beside requests under adapters still samples the base."""
    from orchestrator.engines.adapter_stage import stage_adapter

    await unload_all(engine, root)
    store = AdapterStore(root, MAX_LORAS)
    for v in (80, 81, 82):
        make_adapter(tiny_model_dir, root, v, seed=v)
        await stage_adapter(engine, store.ref(v), 60.0)  # what the fleet does first: the spare is kept
        await engine.load_adapter(store.ref(v))
    assert await slots(engine) == [store.ref(v).int_id for v in (80, 81, 82)] + ["kept_empty"]
    base = fleet_of([engine], root, live=0)
    adapted = fleet_of([engine], root, live=82)
    adapted.resident[engine.engine_id] = {82: store.ref(82)}
    long = SamplingSettings(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    async with anyio.create_task_group() as tg:
        out: dict = {}

        async def one(name, fleet, prompt):
            out[name] = await fleet.generate(prompt, long)

        tg.start_soon(one, "base", base, PROMPTS[2])
        for i, prompt in enumerate(PROMPTS):
            tg.start_soon(one, f"adapted-{i}", adapted, prompt)
    check_against_reference(tiny_model_dir, root, out["base"], 0)
    for i in range(len(PROMPTS)):
        check_against_reference(tiny_model_dir, root, out[f"adapted-{i}"], 82)
    # vLLM's own load of a fourth (no stage, past what the engine serves): its LRU rule at the
    # served capacity takes the oldest's slot, never the spare.
    from vllm.lora.request import LoRARequest

    make_adapter(tiny_model_dir, root, 83, seed=83)
    ref = store.ref(83)
    await engine.llm.add_lora(LoRARequest(ref.name, ref.int_id, ref.path))
    assert await slots(engine) == [ref.int_id] + [store.ref(v).int_id for v in (81, 82)] + ["kept_empty"]
    for v in (80, 81, 82, 83):
        await engine.unload_adapter(store.ref(v))
