"""One optimizer step of the NNX model on a batch of (prompt, completion, advantage) samples.

The loss is the `plain` policy gradient of `orchestrator.trainer.loss`:
-mean(A * logp_new) over the completion tokens of the batch (at one optimizer step per batch
with fresh samples the `tis` loss reduces to it: r = 1). Sequences are packed by the torch
trainer's own `PackedBatch` (right padding, the completion mask, targets shifted by one), so
both trainers read the same tokens at the same positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from orchestrator.trainer.jax_nnx.model import Qwen2
from orchestrator.trainer.loss import PackedBatch


class JaxBatch(NamedTuple):
    """A NamedTuple, not a Struct: JAX's transforms take it as a pytree of arrays as it is."""

    input_ids: jax.Array  # [B, T] int32, right-padded
    attention_mask: jax.Array  # [B, T] int32
    targets: jax.Array  # [B, T-1] int32: the token at t+1
    completion: jax.Array  # [B, T-1] bool: targets that are completion tokens
    advantages: jax.Array  # [B, T-1] float32: the rollout's advantage on its completion tokens, 0 elsewhere


def make_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
               advantages: Sequence[float], pad_id: int) -> JaxBatch:
    if len(advantages) != len(prompts):
        raise ValueError(f"advantages: {len(advantages)} values for {len(prompts)} samples")
    packed = PackedBatch(prompts, completions, pad_id)
    completion = jnp.asarray(packed.completion.numpy())
    per_token = jnp.asarray(advantages, dtype=jnp.float32)[:, None] * completion
    return JaxBatch(input_ids=jnp.asarray(packed.input_ids.numpy(), dtype=jnp.int32),
                    attention_mask=jnp.asarray(packed.attention_mask.numpy(), dtype=jnp.int32),
                    targets=jnp.asarray(packed.targets.numpy(), dtype=jnp.int32), completion=completion,
                    advantages=per_token.astype(jnp.float32))


def token_logprobs(model: Qwen2, batch: JaxBatch) -> jax.Array:
    """log p(targets[b, t]) under the model, `[B, T-1]` (teacher forced; padding included)."""
    logits = model(batch.input_ids, batch.attention_mask)[:, :-1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, batch.targets[..., None], axis=-1)[..., 0]


def policy_gradient_loss(model: Qwen2, batch: JaxBatch) -> jax.Array:
    logp = token_logprobs(model, batch)
    n = jnp.maximum(batch.completion.sum(), 1)
    # where(), not a product: a padding position's logprob may be anything.
    return -jnp.where(batch.completion, batch.advantages * logp, 0.0).sum() / n


def make_optimizer(model: Qwen2, learning_rate: float = 1e-3) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)


@nnx.jit
def train_step(model: Qwen2, optimizer: nnx.Optimizer, batch: JaxBatch) -> jax.Array:
    """One optimizer step in place (model and optimizer state); returns the loss before it."""
    loss, grads = nnx.value_and_grad(policy_gradient_loss)(model, batch)
    optimizer.update(model, grads)
    return loss
