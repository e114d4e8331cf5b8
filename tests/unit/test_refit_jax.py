"""The JAX / Flax NNX trainer side of the refit seam: HF state dict -> NNX model (the loader) ->
refit plan -> the same HF state dict, bit for bit; the NNX forward equals transformers'; the
exported tensors are views of the JAX buffers; one optax step moves the weights."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from orchestrator.trainer.jax_nnx import (
    Qwen2Config,
    load_from_hf,
    make_batch,
    make_optimizer,
    refit_plan,
    to_hf,
    train_step,
    trainer_state,
)
from transports.errors import MissingTensorError, RefitMismatchError

pytestmark = [pytest.mark.timeout(120), pytest.mark.light_lane]


def hf_qwen2(tie: bool, seed: int = 0):
    from transformers import Qwen2Config as HFQwen2Config
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = HFQwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                           max_position_embeddings=64)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # norms are ones and biases zeros at init: make every tensor distinct
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
            else:
                p.normal_(std=0.1)
    return config, model


@pytest.fixture(scope="module")
def untied():
    config, model = hf_qwen2(tie=False)
    return config, model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state_dict(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


# -- the round trip ---------------------------------------------------------------------------


def test_round_trip_is_bit_exact(untied):
    config, _, hf = untied
    model = load_from_hf(hf, config)
    cfg = model.cfg
    # Flax layout: fused, kernels [in, out].
    assert model.layers[0].attn.qkv.kernel.shape == (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)
    assert model.layers[1].mlp.gate_up.kernel.shape == (cfg.hidden_size, 2 * cfg.intermediate_size)
    assert model.lm_head.kernel.shape == (cfg.hidden_size, cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(model.layers[0].attn.o.kernel[...]),
                                  hf["model.layers.0.self_attn.o_proj.weight"].T.numpy())
    assert_same_state_dict(to_hf(model), hf)


def test_round_trip_across_several_buckets(untied):
    config, _, hf = untied
    model = load_from_hf(hf, config)
    plan = refit_plan(model, wire_dtype=None, bucket_bytes=16 << 10)
    assert plan.bucket_count > 3  # the prefetching packer runs too
    from transports.staging import materialize

    assert_same_state_dict(materialize(plan, trainer_state(model)), hf)


def test_tied_round_trip_drops_the_shared_head():
    config, model = hf_qwen2(tie=True, seed=1)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in hf  # transformers lists the shared tensor under both names
    nnx_model = load_from_hf(hf, config)
    assert not hasattr(nnx_model, "lm_head")
    want = {k: v for k, v in hf.items() if k != "lm_head.weight"}  # what a checkpoint holds
    assert_same_state_dict(to_hf(nnx_model), want)


def test_bf16_parameters_round_trip_exactly(untied):
    config, _, hf = untied
    hf16 = {k: v.to(torch.bfloat16) for k, v in hf.items()}
    model = load_from_hf(hf16, config, dtype="bfloat16")
    assert model.layers[0].attn.qkv.kernel[...].dtype == jnp.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in trainer_state(model).values())
    assert_same_state_dict(to_hf(model), hf16)


def test_trainer_state_views_the_jax_buffers(untied):
    config, _, hf = untied
    model = load_from_hf(hf, config)
    state = trainer_state(model)
    arrays = {".".join(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model))}
    assert set(state) == set(arrays)
    for name, tensor in state.items():
        # No host copy on the way out of JAX: the tensor starts where the XLA buffer does.
        assert tensor.data_ptr() == arrays[name].unsafe_buffer_pointer(), name


# -- the loader refuses what it cannot place ----------------------------------------------------


def test_loader_names_a_missing_tensor(untied):
    config, _, hf = untied
    broken = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.down_proj.weight"}
    with pytest.raises(MissingTensorError) as err:
        load_from_hf(broken, config)
    assert err.value.tensor == "layers.1.mlp.down.kernel"


def test_loader_names_a_wrong_shape(untied):
    config, _, hf = untied
    broken = dict(hf, **{"model.norm.weight": torch.ones(config.hidden_size + 1)})
    with pytest.raises(RefitMismatchError) as err:
        load_from_hf(broken, config)
    assert err.value.tensor == "final_norm.scale" and "shape" in err.value.reason


def test_loader_names_an_unused_tensor(untied):
    config, _, hf = untied
    broken = dict(hf, **{"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(RefitMismatchError) as err:
        load_from_hf(broken, config)
    assert err.value.tensor == "model.layers.0.mlp.extra_proj.weight"


def test_loader_refuses_a_tied_head_that_differs():
    config, model = hf_qwen2(tie=True, seed=2)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf["lm_head.weight"] = hf["lm_head.weight"] + 1.0
    with pytest.raises(RefitMismatchError) as err:
        load_from_hf(hf, config)
    assert err.value.tensor == "lm_head.weight"


def test_config_refuses_what_the_model_does_not_implement(untied):
    config, _, _ = untied
    other = copy.deepcopy(config)
    other.use_sliding_window = True
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen2Config.from_hf(other)
    other = copy.deepcopy(config)
    other.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act: 'gelu'"):
        Qwen2Config.from_hf(other)


# -- the forward --------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_nnx_logits_match_transformers(tie):
    config, hf_model = hf_qwen2(tie=tie, seed=3)
    model = load_from_hf(hf_model.state_dict(), config)
    ids = torch.tensor([[5, 17, 42, 8, 23, 11, 3, 29, 60, 1], [7, 2, 90, 14, 33, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[1] * 10, [1] * 5 + [0] * 5])
    with torch.no_grad():
        want = hf_model(input_ids=ids, attention_mask=mask).logits.float()
    # Compiled: one XLA program is faster to build than the eager forward's op-by-op dispatch.
    forward = nnx.jit(lambda m, i, a: m(i, a))
    got = torch.from_numpy(np.asarray(forward(model, jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy()))))
    valid = mask.bool()
    err = (got[valid] - want[valid]).abs().max().item()
    assert err <= 1e-4, err
    assert want[valid].abs().max().item() > 0.1  # logits that say something


# -- one optimizer step -------------------------------------------------------------------------


def test_one_step_moves_the_weights_and_lowers_the_loss(untied):
    config, _, hf = untied
    model = load_from_hf(hf, config)
    batch = make_batch(prompts=[[5, 17, 42], [7, 2, 90, 14]], completions=[[8, 23, 11], [33, 4]],
                       advantages=[1.0, -1.0], pad_id=0)
    optimizer = make_optimizer(model, learning_rate=1e-3)
    before = train_step(model, optimizer, batch)  # the loss before the step
    assert int(optimizer.step[...]) == 1
    after = to_hf(model)
    moved = [k for k in hf if not torch.equal(after[k], hf[k])]
    assert len(moved) == len(hf), sorted(set(hf) - set(moved))
    # The same compiled step again: it reports the loss of the weights the first step left.
    assert float(train_step(model, optimizer, batch)) < float(before)


# -- the GPU path (written, not yet run on a GPU) -----------------------------------------------


@pytest.mark.gpu
def test_gpu_trainer_state_shares_the_device_buffers_through_dlpack(untied):
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device seen by both JAX (a CUDA jaxlib) and torch")
    config, _, hf = untied
    model = load_from_hf(hf, config)
    nnx.update(model, jax.device_put(nnx.state(model), gpus[0]))
    state = trainer_state(model)
    arrays = {".".join(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model))}
    for name, tensor in state.items():
        assert tensor.device.type == "cuda", name
        assert tensor.data_ptr() == arrays[name].unsafe_buffer_pointer(), name  # no copy, on the device
    assert_same_state_dict({k: v.cpu() for k, v in to_hf(model).items()}, hf)
