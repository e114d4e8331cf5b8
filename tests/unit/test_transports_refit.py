"""Refit plans and name maps: load -> refit reproduces the HF state dict exactly."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from tests.helpers import load_safetensors_dir
from transports.base import (
    BucketHeader,
    ChecksumError,
    MissingTensorError,
    RefitMismatchError,
    TruncatedBucketError,
)
from transports.refit.maps import FusedDenseMap, IdentityMap, Qwen3MoeFusedExpertsMap
from transports.refit.plan import (
    Fp8BlockQuant,
    RefitPlan,
    Select,
    Slice,
    Transpose,
    apply_views,
    fp8_block_dequantize,
)
from transports.staging import StagingArea, materialize


def meta_of(state_dict):
    return {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}


def assert_same_state_dict(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


def bf16_exact(state_dict):
    return {k: v.to(torch.bfloat16).to(v.dtype) for k, v in state_dict.items()}


@pytest.fixture(scope="module")
def qwen2_hf():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # norms are all ones at init: make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_()
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    out = tmp_path_factory.mktemp("moe")
    model.save_pretrained(out)
    checkpoint = load_safetensors_dir(out)
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}, checkpoint


# -- dense ------------------------------------------------------------------------------------


def test_fused_dense_loader_fuses_and_transposes(qwen2_hf):
    config, hf = qwen2_hf
    trainer = FusedDenseMap.from_hf_config(config).load(hf)
    q = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    assert trainer["layers.0.attn.qkv.kernel"].shape == (config.hidden_size, q + 2 * kv)
    assert trainer["layers.1.mlp.gate_up.kernel"].shape == (config.hidden_size, 2 * config.intermediate_size)
    assert trainer["lm_head.kernel"].shape == (config.hidden_size, config.vocab_size)
    assert not any(k.startswith("model.") for k in trainer)


def test_fused_dense_refit_reproduces_hf_exactly(qwen2_hf):
    config, hf = qwen2_hf
    name_map = FusedDenseMap.from_hf_config(config)
    trainer = name_map.load(hf)
    plan = RefitPlan.build(meta_of(trainer), name_map, wire_dtype=None, bucket_bytes=16 << 10)
    assert plan.bucket_count > 3  # several buckets, so the prefetching packer is exercised
    assert_same_state_dict(materialize(plan, trainer), hf)


def test_bf16_wire_is_exact_for_bf16_values_and_keeps_fp32_tensors_exact(qwen2_hf):
    config, hf = qwen2_hf
    name_map = FusedDenseMap.from_hf_config(config)
    # Matrices rounded to bf16 travel losslessly; norms and biases keep full fp32 precision.
    want = {k: (v if any(s in k for s in ("norm", "bias")) else v.to(torch.bfloat16).float()) for k, v in hf.items()}
    trainer = name_map.load(want)
    plan = RefitPlan.build(meta_of(trainer), name_map, bucket_bytes=32 << 10)
    wire = {e.name: e.wire_dtype for e in plan.spec.entries}
    assert wire["model.layers.0.self_attn.q_proj.weight"] == "bfloat16"
    assert wire["model.layers.0.input_layernorm.weight"] == "float32"
    assert wire["model.layers.0.self_attn.q_proj.bias"] == "float32"
    assert_same_state_dict(materialize(plan, trainer), want)


def test_bf16_wire_rounds_matrices(qwen2_hf):
    config, hf = qwen2_hf
    name_map = FusedDenseMap.from_hf_config(config)
    got = materialize(RefitPlan.build(meta_of(name_map.load(hf)), name_map), name_map.load(hf))
    name = "model.layers.0.mlp.up_proj.weight"
    assert got[name].dtype == torch.float32  # cast back to the engine dtype on arrival
    assert not torch.equal(got[name], hf[name])
    assert torch.equal(got[name], hf[name].to(torch.bfloat16).float())


def test_views_are_read_in_place():
    kernel = torch.randn(8, 12)
    view = apply_views(kernel, (Slice(1, 4, 8), Transpose(0, 1)))
    assert view.untyped_storage().data_ptr() == kernel.untyped_storage().data_ptr()
    assert torch.equal(view, kernel[:, 4:8].T)
    stacked = torch.randn(3, 4, 6)
    assert apply_views(stacked, (Select(0, 2),)).untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()


def test_buckets_are_bounded(qwen2_hf):
    config, hf = qwen2_hf
    name_map = FusedDenseMap.from_hf_config(config)
    bucket = 20 << 10
    plan = RefitPlan.build(meta_of(name_map.load(hf)), name_map, bucket_bytes=bucket)
    largest = max(e.nbytes for e in plan.spec.entries)
    for k, entries in enumerate(plan.by_bucket):
        assert entries, f"bucket {k} is empty"
        assert plan.bucket_nbytes[k] <= bucket or len(entries) == 1
    assert plan.arena_bytes <= max(bucket, largest) + 64


def test_plan_survives_serialisation(qwen2_hf):
    config, hf = qwen2_hf
    name_map = FusedDenseMap.from_hf_config(config)
    plan = RefitPlan.build(meta_of(name_map.load(hf)), name_map, fp8_block=("*mlp.down_proj.weight",))
    again = RefitPlan.decode(plan.encode())
    assert again.spec == plan.spec
    assert again.refit_info() == plan.refit_info()


def test_refit_info_lists_engine_shapes_and_dtypes(qwen2_hf):
    config, hf = qwen2_hf
    name_map = FusedDenseMap.from_hf_config(config)
    info = RefitPlan.build(meta_of(name_map.load(hf)), name_map).refit_info()
    assert info == {k: (tuple(v.shape), v.dtype) for k, v in hf.items()}


def test_fp8_block_quantization_is_replayed_on_arrival():
    torch.manual_seed(1)
    weight = torch.randn(200, 136)
    plan = RefitPlan.build(meta_of({"w": weight}), wire_dtype=None, fp8_block=("w",))
    assert isinstance(plan.spec.entries[0].on_arrival[0], Fp8BlockQuant)
    info = plan.refit_info()
    assert info["w"] == ((200, 136), torch.float8_e4m3fn)
    assert info["w_scale_inv"] == ((2, 2), torch.float32)
    got = materialize(plan, {"w": weight})
    restored = fp8_block_dequantize(got["w"], got["w_scale_inv"], (128, 128))
    assert (restored - weight).abs().max() <= weight.abs().max() * 0.07  # e4m3: 3 mantissa bits


def test_identity_map_strips_wrapper_prefixes():
    name_map = IdentityMap()
    assert name_map.engine_name("_orig_mod.module.model.norm.weight") == "model.norm.weight"


# -- Qwen3-MoE --------------------------------------------------------------------------------


def test_moe_fused_experts_refit_to_the_transformers_checkpoint(qwen3_moe):
    config, in_memory, checkpoint = qwen3_moe
    name_map = Qwen3MoeFusedExpertsMap.from_hf_config(config)
    plan = RefitPlan.build(meta_of(in_memory), name_map, wire_dtype=None, bucket_bytes=8 << 10)
    assert_same_state_dict(materialize(plan, in_memory), checkpoint)


def test_moe_loader_is_the_inverse_of_refit(qwen3_moe):
    config, in_memory, checkpoint = qwen3_moe
    name_map = Qwen3MoeFusedExpertsMap.from_hf_config(config)
    assert_same_state_dict(name_map.load(checkpoint), in_memory)


def test_moe_input_major_layout_round_trips(qwen3_moe):
    config, _, checkpoint = qwen3_moe
    name_map = Qwen3MoeFusedExpertsMap.from_hf_config(config, input_major=True)
    trainer = name_map.load(checkpoint)
    assert trainer["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    assert trainer["model.layers.1.mlp.experts.down_proj"].shape == (4, 16, 32)
    plan = RefitPlan.build(meta_of(trainer), name_map, wire_dtype=None, bucket_bytes=4 << 10)
    assert_same_state_dict(materialize(plan, trainer), checkpoint)


# -- staging validation -----------------------------------------------------------------------


@pytest.fixture()
def small_plan():
    torch.manual_seed(2)
    sd = {"a": torch.randn(4, 8), "b": torch.randn(16), "c": torch.randn(3, 3)}
    return sd, RefitPlan.build(meta_of(sd), wire_dtype=None, bucket_bytes=256)


def _first_bucket(plan, sd):
    header, payload = next(iter(plan.pack(sd, version=1, prefetch=False)))
    return header, bytearray(payload)


def _staging(plan):
    staging = StagingArea(plan)
    staging.begin(1)
    return staging


def test_staging_rejects_wrong_shape_naming_the_tensor(small_plan):
    sd, plan = small_plan
    header, payload = _first_bucket(plan, sd)
    bad = msgspec.structs.replace(header, tensors=(msgspec.structs.replace(header.tensors[0], shape=(8, 4)),))
    with pytest.raises(RefitMismatchError, match="'a'.*shape") as err:
        _staging(plan).accept(bad, memoryview(payload))
    assert err.value.tensor == "a"


def test_staging_rejects_wrong_dtype_naming_the_tensor(small_plan):
    sd, plan = small_plan
    header, payload = _first_bucket(plan, sd)
    bad = msgspec.structs.replace(header, tensors=(msgspec.structs.replace(header.tensors[0], dtype="float16"),))
    with pytest.raises(RefitMismatchError, match="dtype") as err:
        _staging(plan).accept(bad, memoryview(payload))
    assert err.value.tensor == "a"


def test_staging_rejects_truncated_bucket(small_plan):
    sd, plan = small_plan
    header, payload = _first_bucket(plan, sd)
    with pytest.raises(TruncatedBucketError) as err:
        _staging(plan).accept(header, memoryview(payload)[: len(payload) - 8])
    assert err.value.tensor == header.tensors[-1].name


def test_staging_rejects_corrupted_bytes(small_plan):
    sd, plan = small_plan
    header, payload = _first_bucket(plan, sd)
    payload[3] ^= 0xFF
    with pytest.raises(ChecksumError) as err:
        _staging(plan).accept(header, memoryview(payload))
    assert err.value.tensor == "a"


def test_staging_reports_a_missing_tensor(small_plan):
    sd, plan = small_plan
    staging = _staging(plan)
    buckets = [(h, bytes(p)) for h, p in plan.pack(sd, version=1, prefetch=False)]
    for header, payload in buckets[:-1]:
        staging.accept(header, memoryview(payload))
    with pytest.raises(MissingTensorError) as err:
        staging.finish()
    assert err.value.tensor == buckets[-1][0].tensors[0].name


def test_staging_rejects_an_unknown_tensor(small_plan):
    sd, plan = small_plan
    header, payload = _first_bucket(plan, sd)
    bad = BucketHeader(1, 0, header.count, header.nbytes, (msgspec.structs.replace(header.tensors[0], name="zz"),))
    with pytest.raises(RefitMismatchError, match="not in the refit info"):
        _staging(plan).accept(bad, memoryview(payload))


def test_landed_tensors_are_staged_without_a_copy_and_still_checked(small_plan):
    """A streaming receiver reads tensors straight into `landing` views; `accept` stages those
    views as they are, and a corrupted landed tensor is still refused naming it."""
    sd, plan = small_plan
    destination = {k: torch.zeros_like(v) for k, v in sd.items()}
    staging = StagingArea(plan, destination=destination)
    staging.begin(1)
    for header, payload in plan.pack(sd, version=1, prefetch=False):
        landed = staging.landing(header)
        assert set(landed) == {m.name for m in header.tensors}
        for meta in header.tensors:
            landed[meta.name].copy_(torch.frombuffer(bytearray(payload[meta.offset:meta.offset + meta.nbytes]),
                                                     dtype=torch.uint8))
        staging.accept(header, payload, landed)
    staged = staging.finish()
    for name, tensor in sd.items():
        assert staged[name].data_ptr() == destination[name].data_ptr()  # no copy out of an arena
        assert torch.equal(staged[name], tensor)

    staging.begin(2)
    header, payload = next(iter(plan.pack(sd, version=2, prefetch=False)))
    landed = staging.landing(header)
    first = header.tensors[0]
    landed[first.name].copy_(torch.frombuffer(bytearray(payload[first.offset:first.offset + first.nbytes]),
                                              dtype=torch.uint8))
    landed[first.name][0] ^= 0x40
    with pytest.raises(ChecksumError) as err:
        staging.accept(header, payload, landed)
    assert err.value.tensor == first.name
    # A bucket of another attempt gets no landing place.
    assert staging.landing(msgspec.structs.replace(header, attempt=7)) == {}


def test_pack_hold_keeps_a_sent_bucket_intact_until_two_later_buckets_are_asked_for():
    """hold=1 (a sender whose far side still reads bucket k after send(k) returns): the packing
    thread refills bucket k's arena only once bucket k+2 is requested."""
    sd = {f"w{i}": torch.full((64,), float(i)) for i in range(6)}
    plan = RefitPlan.build(meta_of(sd), wire_dtype=None, bucket_bytes=256)
    assert plan.bucket_count == 6
    buckets = plan.pack(sd, version=1, hold=1)
    seen = []
    for header, payload in buckets:
        if seen:  # the previous bucket, still readable while this one is handed out
            prev_header, prev_payload = seen[-1]
            time.sleep(0.05)  # give the packing thread every chance to overwrite it
            values = torch.frombuffer(bytearray(prev_payload), dtype=torch.float32)
            assert torch.all(values == float(prev_header.index)), prev_header.index
        seen.append((header, payload))
    assert [h.index for h, _ in seen] == list(range(6))
