"""Between the NNX model and the HF checkpoint layout, both ways, through the refit seam.

* `load_from_hf(hf_state_dict, config)`: the loader. `FusedDenseMap.load` fuses q|k|v and
  gate|up and transposes the kernels to `[in, out]`; the arrays are then copied into JAX once.
* `trainer_state(model)`: `{trainer name: torch.Tensor}` over the model's own buffers, what a
  `WeightSynchronizer` reads (`state_dict=lambda: trainer_state(model)`) with the plan built on
  `refit_map(cfg)`. Leaving JAX costs no host copy: on a CPU the tensor is a view of the XLA
  buffer (`np.asarray` then `torch.from_numpy`); on a GPU it is a dlpack capsule of the device
  buffer (`torch.from_dlpack`: written, not yet run on a GPU). The plan's views (slice,
  transpose) are read in place from there, so the first copy is the packing into a bucket.
* `to_hf(model)`: the exact inverse of the loader, by running that plan in one process
  (`transports.staging.materialize`, fp32 wire): bit for bit the HF state dict loaded.

The views are only read, never written: XLA buffers are immutable, and the numpy view of one is
marked read-only. A jitted step that *donates* the parameter buffers would free what an earlier
`trainer_state` points at, so take a fresh `trainer_state` after every step (the synchronizer
calls `state_dict()` on every sync) and do not donate while a sync is in flight.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx

from orchestrator.trainer.jax_nnx.model import Qwen2, Qwen2Config
from transports.errors import MissingTensorError, RefitMismatchError
from transports.refit.maps import FusedDenseMap
from transports.refit.plan import RefitPlan
from transports.staging import materialize

TIED_HEAD = "lm_head.weight"


def refit_map(cfg: Qwen2Config) -> FusedDenseMap:
    """The name map between this model's parameter names and the HF checkpoint's."""
    return FusedDenseMap(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size)


def param_items(model: nnx.Module) -> list[tuple[str, jax.Array]]:
    """(trainer name, array) of every parameter, names as dotted paths (`layers.0.attn.qkv.kernel`)."""
    state = nnx.state(model, nnx.Param)
    return [(".".join(str(p) for p in path), var.get_value()) for path, var in nnx.to_flat_state(state)]


def load_from_hf(hf_state_dict: Mapping[str, torch.Tensor], config, *, dtype: str = "float32") -> Qwen2:
    """The NNX model holding `hf_state_dict` (HF names, `[out, in]` weights). `config`: a
    transformers Qwen2 config or a `Qwen2Config`. Every parameter must be present with its
    shape and every HF tensor must be used: a mismatch raises naming the tensor. A tied model's
    `lm_head.weight` (transformers' `state_dict()` lists the shared tensor under both names) is
    accepted only when it equals the embeddings."""
    cfg = config if isinstance(config, Qwen2Config) else Qwen2Config.from_hf(config, dtype=dtype)
    hf = dict(hf_state_dict)
    if cfg.tie_word_embeddings and TIED_HEAD in hf:
        embed = hf.get("model.embed_tokens.weight")
        if embed is None or not torch.equal(hf[TIED_HEAD], embed):
            raise RefitMismatchError(TIED_HEAD, "the config ties the embeddings but lm_head.weight differs from "
                                                "model.embed_tokens.weight")
        del hf[TIED_HEAD]
    name_map = refit_map(cfg)
    trainer = name_map.load(hf)
    # The shapes come from the model definition, traced abstractly: nothing is initialised.
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0))))
    filled = []
    want_dtype = jnp.dtype(cfg.dtype)
    for path, var in nnx.to_flat_state(abstract):
        name = ".".join(str(p) for p in path)
        tensor = trainer.pop(name, None)
        if tensor is None:
            raise MissingTensorError(name, "absent from the HF state dict (after the fused-dense loader)")
        if tuple(tensor.shape) != tuple(var.shape):
            raise RefitMismatchError(name, f"shape {tuple(tensor.shape)} from the HF state dict, the model "
                                           f"wants {tuple(var.shape)}")
        filled.append((path, var.copy(jnp.asarray(_to_numpy(tensor), dtype=want_dtype))))
    if trainer:
        raise RefitMismatchError(min(trainer), "in the HF state dict but not a parameter of the model")
    model = nnx.merge(graphdef, nnx.from_flat_state(filled))
    # The fused-dense loader ignores tensors it has no rule for: refuse them instead, so that
    # `to_hf(load_from_hf(hf))` covering exactly `hf` is checked here, not assumed.
    produced = {engine for engine, _, _ in name_map.refit(trainer_meta(model))}
    extra = sorted(set(hf) - produced)
    if extra:
        raise RefitMismatchError(extra[0], "in the HF state dict but no parameter of the model maps to it")
    return model


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bf16: through its bits
        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_torch(array: jax.Array, name: str = "<array>") -> torch.Tensor:
    """A torch tensor over `array`'s own buffer (no copy). CPU: numpy's view of the XLA buffer;
    GPU: dlpack (written, not yet run on a GPU). A sharded array is refused: gather it first."""
    devices = array.devices()
    if len(devices) != 1:
        raise RefitMismatchError(name, f"sharded over {len(devices)} devices: gather it before the refit")
    if next(iter(devices)).platform != "cpu":
        return torch.from_dlpack(array)
    host = np.asarray(array)  # a read-only view of the CPU buffer, not a copy
    with warnings.catch_warnings():
        # Read-only is what we want: the plan only reads, and XLA buffers are immutable.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if host.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(host.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(host)


def trainer_state(model: nnx.Module) -> dict[str, torch.Tensor]:
    """`{trainer name: tensor}` viewing the model's current parameter buffers (see the module
    docstring); the input of a `RefitPlan` built on `refit_map(cfg)`."""
    return {name: to_torch(array, name) for name, array in param_items(model)}


def trainer_meta(model: nnx.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in trainer_state(model).items()}


def refit_plan(model: Qwen2, **build_kwargs) -> RefitPlan:
    """The plan from this model's parameters to the HF layout (`RefitPlan.build` keywords pass
    through: `wire_dtype`, `bucket_bytes`, ...)."""
    return RefitPlan.build(trainer_meta(model), refit_map(model.cfg), **build_kwargs)


def to_hf(model: Qwen2) -> dict[str, torch.Tensor]:
    """The HF state dict of `model` through the refit plan with an fp32 wire: the exact inverse of
    `load_from_hf` (bit for bit). A tied model has no `lm_head.weight`, as in its checkpoint."""
    return materialize(refit_plan(model, wire_dtype=None), trainer_state(model))
