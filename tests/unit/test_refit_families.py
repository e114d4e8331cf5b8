"""Refit maps per model family (dense Qwen2, Qwen3-MoE, Qwen3-Next, Gemma 4), each checked
against transformers' own model class and vLLM's own loader:

* a tiny random model built with the family's transformers config and class; its checkpoint
  (`save_pretrained`) -> the map's loader -> transformers' in-memory `state_dict()`, bit for
  bit; that layout -> refit plan -> the checkpoint, bit for bit;
* every name and shape of `prepare_refit_info()` loads into vLLM's model class for the
  architecture (built on the meta device), and every vLLM parameter is loaded by one;
* where vLLM's CPU build runs the family: a refit into a live engine, whose logprobs then
  match a transformers forward of the new weights within 1e-3 (fp32).
"""

from __future__ import annotations

import gc
import glob
import importlib.util

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import inflight_llm
from transports.errors import RefitMismatchError, TransportConfigError
from transports.factory import create_weight_synchronizer
from transports.refit.families import (
    Gemma4Map,
    HfLayoutMap,
    Qwen3NextMap,
    map_for_config,
)
from transports.refit.maps import FusedDenseMap, Qwen3MoeFusedExpertsMap
from transports.refit.plan import RefitPlan
from transports.staging import materialize

pytestmark = pytest.mark.timeout(300)

FAMILIES = ["qwen2", "qwen3_moe", "qwen3_next", "gemma4"]
PROMPT = [5, 17, 42, 8, 23, 11, 3, 29]


def tiny_config(family: str):
    """1-2 layers, tiny dims; head size 32 (a size vLLM's CPU attention takes, and a multiple
    of 32 as its CPU gated-DeltaNet kernel requires)."""
    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256}
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, head_dim=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                              tie_word_embeddings=False)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig

        # One gated-DeltaNet layer, one gated full-attention layer, both with a sparse MoE block
        # (4 routed experts + a shared expert).
        return Qwen3NextConfig(**common, head_dim=32, layer_types=["linear_attention", "full_attention"],
                               linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                               linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                               tie_word_embeddings=False)
    if family == "gemma4":
        from transformers import Gemma4TextConfig

        # A sliding and a full layer, per-layer embeddings, a MoE block beside each dense MLP,
        # and the input/output embeddings tied (Gemma's default).
        return Gemma4TextConfig(**common, head_dim=32, global_head_dim=32,
                                layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                                hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                                enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                                tie_word_embeddings=True)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32).eval()
    with torch.no_grad():  # norms and scales start at 0 or 1: move every tensor off its init
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def meta_of(state_dict):
    return {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}


def assert_same_state_dict(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name


class Family:
    def __init__(self, name: str, model, checkpoint: dict[str, torch.Tensor]):
        self.name, self.model, self.checkpoint = name, model, checkpoint
        self.config = model.config
        self.in_memory = {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Family:
    model = tiny_model(request.param)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    checkpoint = {}
    for f in sorted(glob.glob(str(out / "*.safetensors"))):
        checkpoint.update(load_file(f))
    return Family(request.param, model, checkpoint)


# -- choosing a map ---------------------------------------------------------------------------


def test_map_for_config_picks_each_family():
    assert isinstance(map_for_config(tiny_config("qwen2")), HfLayoutMap)
    assert isinstance(map_for_config(tiny_config("qwen2"), fused_dense=True), FusedDenseMap)
    assert isinstance(map_for_config(tiny_config("qwen3_moe")), Qwen3MoeFusedExpertsMap)
    assert isinstance(map_for_config(tiny_config("qwen3_next")), Qwen3NextMap)
    assert isinstance(map_for_config(tiny_config("gemma4")), Gemma4Map)
    from transformers import GPT2Config

    with pytest.raises(TransportConfigError, match="gpt2"):
        map_for_config(GPT2Config())


# -- loader and refit: bit for bit --------------------------------------------------------------


def test_loader_reproduces_the_transformers_in_memory_layout(family):
    """The map's loader turns the checkpoint into what transformers' own loader holds."""
    name_map = map_for_config(family.config)
    assert_same_state_dict(name_map.load(family.checkpoint), family.in_memory)


def test_refit_reproduces_the_checkpoint_bit_for_bit(family):
    """checkpoint -> loader -> refit plan (views only) -> the checkpoint, same names and dtypes."""
    name_map = map_for_config(family.config)
    trainer = name_map.load(family.checkpoint)
    plan = RefitPlan.build(meta_of(trainer), name_map, wire_dtype=None, bucket_bytes=16 << 10)
    assert plan.bucket_count > 1
    assert_same_state_dict(materialize(plan, trainer), family.checkpoint)
    # The same from the live model's own state dict (tied tensors alias each other there).
    assert_same_state_dict(materialize(plan, family.in_memory), family.checkpoint)


def test_family_specific_tensors_travel_as_the_checkpoint_has_them(family):
    info = RefitPlan.build(meta_of(family.in_memory), map_for_config(family.config), wire_dtype=None).refit_info()
    assert info == {k: (tuple(v.shape), v.dtype) for k, v in family.checkpoint.items()}
    c = family.config
    if family.name == "qwen3_next":
        lin = "model.layers.0.linear_attn."
        assert info[lin + "conv1d.weight"][0] == (2 * 2 * 64 + 4 * 64, 1, 4)  # q, k (2 heads), v (4 heads)
        assert info[lin + "A_log"][0] == info[lin + "dt_bias"][0] == (4,)
        assert info["model.layers.1.mlp.shared_expert_gate.weight"][0] == (1, c.hidden_size)
        assert info["model.layers.1.mlp.experts.3.down_proj.weight"][0] == (c.hidden_size, 32)
        assert not any(k.endswith("experts.gate_up_proj") for k in info)
    if family.name == "gemma4":
        assert info["model.layers.0.experts.gate_up_proj"][0] == (4, 64, c.hidden_size)  # kept fused
        assert info["model.layers.1.router.per_expert_scale"][0] == (4,)
        assert info["model.embed_tokens_per_layer.weight"][0] == (128, 2 * 8)
        assert "lm_head.weight" not in info and "lm_head.weight" in family.in_memory  # tied: never sent


def test_wire_keeps_precision_sensitive_family_tensors_in_fp32(family):
    plan = RefitPlan.build(meta_of(family.in_memory), map_for_config(family.config))  # bf16 wire
    wire = {e.name: e.wire_dtype for e in plan.spec.entries}
    assert wire["model.layers.0.input_layernorm.weight"] == "float32"
    assert wire["model.embed_tokens.weight"] == "bfloat16"
    if family.name == "qwen3_next":
        for name in ("linear_attn.A_log", "linear_attn.dt_bias", "mlp.shared_expert_gate.weight", "mlp.gate.weight"):
            assert wire[f"model.layers.0.{name}"] == "float32", name
        assert wire["model.layers.0.linear_attn.in_proj_qkvz.weight"] == "bfloat16"
    if family.name == "gemma4":
        for name in ("router.scale", "router.per_expert_scale", "router.proj.weight", "layer_scalar"):
            assert wire[f"model.layers.1.{name}"] == "float32", name
        assert wire["model.layers.1.experts.gate_up_proj"] == "bfloat16"


@pytest.mark.parametrize("name", ["qwen3_next", "gemma4"])
def test_input_major_experts_round_trip(name, tmp_path):
    model = tiny_model(name)
    model.save_pretrained(tmp_path)
    checkpoint = load_file(glob.glob(str(tmp_path / "*.safetensors"))[0])
    name_map = map_for_config(model.config, input_major=True)
    trainer = name_map.load(checkpoint)
    key = "model.layers.0.mlp.experts.down_proj" if name == "qwen3_next" else "model.layers.0.experts.down_proj"
    assert trainer[key].shape == (4, 32, 64)  # [E, I, H]
    assert trainer[key].is_contiguous()
    plan = RefitPlan.build(meta_of(trainer), name_map, wire_dtype=None, bucket_bytes=8 << 10)
    assert_same_state_dict(materialize(plan, trainer), checkpoint)


def test_maps_refuse_unknown_tensors_and_wrong_shapes_naming_them():
    nxt = Qwen3NextMap.from_hf_config(tiny_config("qwen3_next"))
    with pytest.raises(RefitMismatchError) as err:
        nxt.refit({"model.layers.0.linear_attn.A_log": ((8,), torch.float32)})
    assert err.value.tensor == "model.layers.0.linear_attn.A_log" and "(4,)" in err.value.reason
    with pytest.raises(RefitMismatchError) as err:
        nxt.refit({"model.layers.0.linear_attn.in_proj_qkv.weight": ((64, 64), torch.float32)})
    assert err.value.tensor == "model.layers.0.linear_attn.in_proj_qkv.weight"
    gemma = Gemma4Map.from_hf_config(tiny_config("gemma4"))
    with pytest.raises(RefitMismatchError) as err:
        gemma.refit({"model.embed_tokens_per_layer.weight": ((128, 8), torch.float32)})
    assert err.value.tensor == "model.embed_tokens_per_layer.weight" and "(128, 16)" in err.value.reason
    with pytest.raises(RefitMismatchError) as err:
        gemma.refit({"model.vision_tower.patch.weight": ((4, 4), torch.float32)})
    assert err.value.tensor == "model.vision_tower.patch.weight"


# -- vLLM's own loader ---------------------------------------------------------------------------


def _refit_info(family: Family, tmp_path):
    """What `prepare_refit_info()` reports for this family's trainer layout."""
    state = family.in_memory
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[], colocated=False, transport="filesystem",
                                      name_map=map_for_config(family.config), wire_dtype=None,
                                      filesystem_root=tmp_path)
    try:
        return sync.prepare_refit_info()
    finally:
        sync.shutdown()


def test_vllm_loader_accepts_every_name_and_loads_every_parameter(family, tmp_path):
    from transports.refit.vllm_check import vllm_accepts

    info = _refit_info(family, tmp_path)
    report = vllm_accepts(family.config, info)
    assert report.ok, report.describe()
    assert sorted(report.accepted) == sorted(info)


def test_vllm_check_reports_wrong_shapes_unknown_names_and_gaps(tmp_path):
    """The checker can fail: a wrong shape and an unknown name are rejected, a missing tensor
    leaves its vLLM parameter unloaded."""
    from transports.refit.vllm_check import vllm_accepts

    config = tiny_config("qwen3_next")
    fam = Family("qwen3_next", tiny_model("qwen3_next"), {})
    info = dict(_refit_info(fam, tmp_path))
    shape, dtype = info["model.layers.0.linear_attn.in_proj_ba.weight"]
    info["model.layers.0.linear_attn.in_proj_ba.weight"] = ((shape[0] + 2, shape[1]), dtype)
    info["model.layers.0.linear_attn.bogus.weight"] = ((64, 64), dtype)
    del info["model.layers.0.linear_attn.A_log"]
    report = vllm_accepts(config, info)
    assert not report.ok
    assert set(report.rejected) == {"model.layers.0.linear_attn.in_proj_ba.weight",
                                    "model.layers.0.linear_attn.bogus.weight"}
    # vLLM's own loader narrowed the too-tall in_proj_ba without an error: counted, not raised.
    assert "values landed" in report.rejected["model.layers.0.linear_attn.in_proj_ba.weight"]
    assert "no module or parameter" in report.rejected["model.layers.0.linear_attn.bogus.weight"]
    assert len(report.accepted) == len(info) - 2
    # A rejected name loads nothing: its parameter counts as never loaded, like A_log's.
    assert set(report.never_loaded) == {"model.layers.0.linear_attn.A_log",
                                        "model.layers.0.linear_attn.in_proj_ba.weight"}


# -- a live engine --------------------------------------------------------------------------------

LIVE = ["qwen3_moe", "qwen3_next", "gemma4"]  # dense Qwen2: tests/integration/test_transports_vllm.py


def _missing_cpu_kernel(exc: BaseException) -> str | None:
    """The reason to skip, only when vLLM failed for want of a CPU kernel (checked on the
    exception itself, at run time); None for any other failure, which then fails the test.
    Recognised: a kernel package this CPU build lacks, and a guard inside vLLM's CPU kernels
    (`.../ops/cpu/...`) refusing the dtype, e.g. "CPU GDN attention requires BF16"."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            package = seen.name.split(".")[0]
            if package in ("triton", "flashinfer", "fla") and importlib.util.find_spec(package) is None:
                return f"vLLM CPU: kernel package {seen.name!r} is not installed ({seen})"
        tb = seen.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = tb.tb_frame.f_code.co_filename if tb is not None else ""
        if isinstance(seen, (AssertionError, NotImplementedError)) and "/ops/cpu/" in where:
            return f"vLLM CPU kernel refuses this: {seen} ({where.split('site-packages/')[-1]})"
        seen = seen.__cause__ or seen.__context__
    return None


def _start_engine(model_dir, dtype: str):
    # No prefix caching: the same prompt is sampled under several versions.
    return inflight_llm(model_dir, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False)


def _round_to_bf16(model) -> None:
    """Every weight made bf16-representable: a bf16 engine then holds exactly the trainer's values."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def _live(family: str, dtype: str, tmp_path_factory):
    model = tiny_model(family, seed=1)
    if dtype == "bfloat16":
        _round_to_bf16(model)
    out = tmp_path_factory.mktemp(f"live-{family}-{dtype}")
    model.save_pretrained(out)
    try:
        engine = _start_engine(out, dtype)
    except Exception as exc:  # classified: only a missing CPU kernel skips, anything else fails
        if (reason := _missing_cpu_kernel(exc)) is None:
            raise
        pytest.skip(reason)
    return model, engine


@pytest.fixture(scope="module", params=LIVE)
def live(request, tmp_path_factory):
    model, engine = _live(request.param, "float32", tmp_path_factory)
    yield request.param, model, engine
    del engine
    gc.collect()


def _sample(llm):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, logprobs=0, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    return tokens, torch.tensor([lp[t].logprob for t, lp in zip(tokens, out.logprobs, strict=True)])


def _hf_logprobs(model, tokens):
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


class RoundTrip:
    """The engine starts on W0 (vLLM's own loader, from the checkpoint); the trainer, holding
    the model as transformers does, refits W1, then W0 again, through the family's map."""

    def __init__(self, llm, model, tmp_path, bf16: bool = False):
        from transports.vllm_backend import LLMControl

        self.tokens0, self.lp0 = _sample(llm)
        self.hf0 = _hf_logprobs(model, self.tokens0)
        w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * p.std().clamp(min=0.05) * torch.randn(p.shape, generator=g))
        if bf16:
            _round_to_bf16(model)
        state = {k: v.detach() for k, v in model.state_dict().items()}  # aliases the live parameters
        sync = create_weight_synchronizer(state_dict=lambda: state, engines=[LLMControl(llm)], colocated=False,
                                          transport="filesystem", name_map=map_for_config(model.config),
                                          wire_dtype=None, filesystem_root=tmp_path, timeout_s=60)
        try:
            sync.init_communicator()
            sync.mark_stale()
            sync.sync_weights()
            self.tokens1, self.lp1 = _sample(llm)
            self.hf1 = _hf_logprobs(model, self.tokens1)
            model.load_state_dict(w0)  # copies into the parameters `state` aliases: W0 again
            self.hf1_under_w0 = _hf_logprobs(model, self.tokens1)
            sync.mark_stale()
            sync.sync_weights()
            self.tokens2, self.lp2 = _sample(llm)
        finally:
            sync.shutdown()
            llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine")


@pytest.mark.engine
@pytest.mark.slow
def test_refit_into_a_live_engine_matches_transformers(live, tmp_path):
    """fp32 engine: after the refit its logprobs match transformers' forward of the new weights
    within 1e-3; refitting the old weights restores its first answer exactly."""
    _, model, llm = live
    try:
        tokens, lp = _sample(llm)
    except Exception as exc:  # classified: only a missing CPU kernel skips, anything else fails
        if (reason := _missing_cpu_kernel(exc)) is None:
            raise
        pytest.skip(reason)
    assert torch.allclose(lp, _hf_logprobs(model, tokens), atol=1e-3)
    rt = RoundTrip(llm, model, tmp_path)
    assert torch.allclose(rt.lp1, rt.hf1, atol=1e-3), (rt.lp1 - rt.hf1).abs().max()
    assert (rt.lp1 - rt.hf1_under_w0).abs().max() > 1e-2  # the refit changed what the engine serves
    assert rt.tokens2 == rt.tokens0
    assert torch.allclose(rt.lp2, rt.lp0, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def live_qwen3_next_bf16(tmp_path_factory):
    model, engine = _live("qwen3_next", "bfloat16", tmp_path_factory)
    yield model, engine
    del engine
    gc.collect()


#: bf16 activations against transformers' fp32 forward of the same (bf16-representable)
#: weights; measured on this tiny model: under 0.01.
BF16_ATOL = 0.03


@pytest.mark.engine
@pytest.mark.slow
def test_refit_into_a_live_bf16_qwen3_next_engine(live_qwen3_next_bf16, tmp_path):
    """vLLM's CPU gated-DeltaNet kernel runs in bf16 only: the refit through `Qwen3NextMap` into
    a bf16 engine moves its logprobs to transformers' forward of the new weights (within bf16
    error, far from the old weights'), and refitting the old weights restores its first
    answer exactly."""
    model, llm = live_qwen3_next_bf16
    rt = RoundTrip(llm, model, tmp_path, bf16=True)
    assert (rt.lp0 - rt.hf0).abs().max() < BF16_ATOL
    assert (rt.lp1 - rt.hf1).abs().max() < BF16_ATOL, (rt.lp1 - rt.hf1).abs().max()
    assert (rt.lp1 - rt.hf1_under_w0).abs().max() > 4 * BF16_ATOL  # the refit changed what the engine serves
    assert rt.tokens2 == rt.tokens0
    assert torch.allclose(rt.lp2, rt.lp0, atol=1e-6, rtol=0)
