"""A JAX / Flax NNX trainer side of the refit seam (the optional extra `inflight-rl[jax]`).

    model.py  `Qwen2Config`, `Qwen2`: the Qwen2 architecture in NNX, kernels stored `[in, out]`
              under the fused dense trainer names
    refit.py  `load_from_hf` (HF state dict -> model), `trainer_state` (model -> torch tensors over
              the JAX buffers, no copy), `refit_map` / `refit_plan` (the `FusedDenseMap` plan),
              `to_hf` (the loader's exact inverse)
    step.py   `make_batch`, `policy_gradient_loss`, `make_optimizer`, `train_step` (optax)

Importing this package imports JAX; nothing on the default paths (`inflight run`, the torch
trainer) imports it. docs/jax.md shows a refit from JAX into a live engine.
"""

from orchestrator.trainer.jax_nnx.model import Qwen2, Qwen2Config
from orchestrator.trainer.jax_nnx.refit import (
    load_from_hf,
    refit_map,
    refit_plan,
    to_hf,
    to_torch,
    trainer_state,
)
from orchestrator.trainer.jax_nnx.step import (
    JaxBatch,
    make_batch,
    make_optimizer,
    policy_gradient_loss,
    token_logprobs,
    train_step,
)

__all__ = [
    "JaxBatch",
    "Qwen2",
    "Qwen2Config",
    "load_from_hf",
    "make_batch",
    "make_optimizer",
    "policy_gradient_loss",
    "refit_map",
    "refit_plan",
    "to_hf",
    "to_torch",
    "token_logprobs",
    "train_step",
    "trainer_state",
]
