"""Coordinated activation on the in-process engine (vLLM AsyncLLM) with the swap worker
extension, and the KV policies for requests in flight at the swap: recompute, keep, drain,
abort. Every token is checked against a transformers forward under its recorded version."""

from __future__ import annotations

import pytest

from orchestrator.activation import coordinator as act
from orchestrator.engines.base import SamplingSettings
from orchestrator.fleet.fleet import Fleet
from tests.integration.activation_helpers import (
    PROMPTS,
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
    return new_world(tiny_model_dir, tmp_path_factory.mktemp("weights-inproc"))


def new_version(world) -> int:
    return publish_next(world, seed_base=2000)


@pytest.fixture(scope="module")
async def engine(tiny_model_dir):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.inproc import InProcessEngine

    e = InProcessEngine(EngineConfig(model=str(tiny_model_dir), kind="inproc", max_model_len=512, max_num_seqs=16,
                                     worker_extension_cls="transports.swap.SwapWorkerExtension"), "act-inproc")
    await e.start()
    try:
        yield e
    finally:
        await e.shutdown()


async def activate_under_load(engine, world, strategy, kv_policy, **kw):
    fleet = Fleet([engine], strategy=strategy, kv_policy=kv_policy, live_version=world["live"],
                  on_outcome=world.setdefault("outcomes", []).append, **kw)
    world["outcomes"].clear()
    await fleet.setup(world["pub"].plan_json, world["pub"].root)
    v = new_version(world)
    completions, record = await under_load(fleet, lambda: fleet.activate(v), n=3)
    if record.outcome == act.ACTIVATED:
        world["live"] = v
    return fleet, v, completions, record


def switched(completions):
    return [c for c in completions if len(c.change_points()) > 1]


async def test_recompute_every_token_matches_its_version(engine, world):
    fleet, v, completions, record = await activate_under_load(engine, world, "pause_swap", "recompute")
    assert record.outcome == act.ACTIVATED and not record.kv_carried
    refs = world["refs"]
    assert switched(completions)
    for c in completions:
        assert max_err(c.logprobs, refs.recompute(c.prompt_token_ids, c.token_ids, c.versions)) < TOL
        assert not c.kv_carried_across_versions
    c = await fleet.generate(PROMPTS[0], GREEDY)  # right after: the new weights, no stale prefix
    assert set(c.versions) == {v}
    assert max_err(c.logprobs, refs.full(v, PROMPTS[0], c.token_ids)) < TOL
    assert not await engine.is_paused()


async def test_keep_marks_carried_kv(engine, world):
    fleet, v, completions, record = await activate_under_load(engine, world, "double_buffer", "keep")
    assert record.outcome == act.ACTIVATED and record.kv_carried
    refs = world["refs"]
    moved = switched(completions)
    assert moved and all(c.kv_carried_across_versions for c in moved)
    for c in completions:
        assert max_err(c.logprobs, refs.carried(c.prompt_token_ids, c.token_ids, c.versions)) < TOL
    for c in moved:  # kept keys/values are not what a full recompute under the new weights gives
        assert max_err(c.logprobs, refs.recompute(c.prompt_token_ids, c.token_ids, c.versions)) > TOL


async def test_drain_finishes_in_flight_on_the_old_weights(engine, world):
    fleet, v, completions, record = await activate_under_load(
        engine, world, "double_buffer", "drain", timeouts=act.PhaseTimeouts(drain_s=60.0))
    assert record.outcome == act.ACTIVATED and "drain timed out" not in record.message
    assert not switched(completions)  # nothing was in flight at the swap
    refs = world["refs"]
    for c in completions:
        assert c.status == "completed"
        assert max_err(c.logprobs, refs.recompute(c.prompt_token_ids, c.token_ids, c.versions)) < TOL
    assert any(set(c.versions) == {v} for c in completions)


async def test_abort_drops_and_redispatches(engine, world):
    fleet, v, completions, record = await activate_under_load(engine, world, "pause_swap", "abort")
    assert record.outcome == act.ACTIVATED
    outcomes = world["outcomes"]  # every terminal outcome the fleet saw, redispatched attempts included
    dropped = [c for c in outcomes if c.status == "dropped"]
    assert dropped and all(c.reason == "aborted" for c in dropped)
    assert all(c.status == "completed" for c in completions)
    assert any(c.attempts > 1 for c in completions)  # dispatched again after the abort
    refs = world["refs"]
    for c in outcomes:
        assert len(c.change_points()) <= 1  # aborted ones end on the old version, retries start on v
        if c.token_ids:
            assert max_err(c.logprobs, refs.recompute(c.prompt_token_ids, c.token_ids, c.versions)) < TOL
    assert len({c.request_id for c in outcomes}) == len(outcomes)


def make_adapter(directory, base, rank: int = 4, alpha: float = 8.0, seed: int = 7):
    """A PEFT-format LoRA adapter on every q_proj and v_proj, big enough to change outputs."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, w in base.items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            module = name[: -len(".weight")]
            out_f, in_f = w.shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": alpha,
                                                                "target_modules": ["q_proj", "v_proj"]}))
    return tensors, alpha / rank


def adapter_reference(model_dir, tensors, scale):
    """The adapter's own forward: base linear plus scale * x A^T B^T (unmerged)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        module = modules[key.split(".lora_A.")[0][len("base_model.model."):]]
        module.register_forward_hook(lambda _m, inputs, out, a=a, b=b: out + scale * (inputs[0] @ a.T @ b.T))
    return model


async def test_lora_swap_between_steps_without_pause(engine, world, tiny_model_dir, tmp_path):
    from tests.integration.activation_helpers import FaultyEngine

    tensors, scale = make_adapter(tmp_path / "adapter", world["base"])
    v = world["next"]
    world["next"] += 1
    refs = world["refs"]
    refs.models[v] = adapter_reference(tiny_model_dir, tensors, scale)
    pauses = []

    async def spy_pause(inner, *args):
        pauses.append(args)
        return await inner.pause(*args)

    fleet = Fleet([FaultyEngine(engine, pause=spy_pause)], strategy="pause_free", kv_policy="keep",
                  live_version=world["live"])
    await fleet.setup(world["pub"].plan_json, world["pub"].root)
    source = {"base_dir": str(tiny_model_dir), "lora_dir": str(tmp_path / "adapter")}
    completions, record = await under_load(fleet, lambda: fleet.activate(v, source=source), n=3)
    assert record.outcome == act.ACTIVATED and pauses == []
    world["live"] = v
    for c in completions:
        assert max_err(c.logprobs, refs.carried(c.prompt_token_ids, c.token_ids, c.versions)) < TOL
    c = await fleet.generate(PROMPTS[2], GREEDY)
    assert set(c.versions) == {v}
    assert max_err(c.logprobs, refs.full(v, PROMPTS[2], c.token_ids)) < TOL
    # and the adapter really changed the outputs
    assert max_err(c.logprobs, refs.full(0, PROMPTS[2], c.token_ids)) > 10 * TOL
