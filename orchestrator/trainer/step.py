"""One optimizer step on one batch of samples, in one process (`train_step`) or on one rank
of an FSDP2 model (`train_step_sharded`): pure compute, no I/O. The trainer process
(`orchestrator.trainer.process`) drives them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from orchestrator.config import TrainerConfig
from orchestrator.trainer.link import Sample, unpack_f32, unpack_i32
from orchestrator.trainer.loss import (
    PackedBatch,
    completion_logprobs,
    group_advantages,
    merge_stats,
    per_rollout_log_ratio,
    policy_loss,
)
from orchestrator.trainer.ranks import Ranks


class StepResult(msgspec.Struct):
    loss: float
    reward_mean: float
    metrics: dict[str, float]
    rollout_ids: list[int]
    advantages: list[float]
    log_ratio_mean: list[float]  # NaN: a rollout without completion tokens
    log_ratio_max_abs: list[float]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample],
               config: TrainerConfig, pad_id: int, step: int | None = None,
               temperature: float = 1.0) -> StepResult:
    """One optimizer step on one batch of samples (pure compute: no I/O)."""
    prompts, completions, recorded, rewards, advantages = _unpack(samples, config)
    behaviour = torch.from_numpy(np.concatenate(recorded).astype(np.float32))
    batch = PackedBatch(prompts, completions, pad_id)

    optimizer.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, batch, temperature)
    # One forward serves both: the weights have not moved yet, so logp.detach() is the trainer's
    # logprob before the step (no dropout in these models: train and inference forwards agree).
    lr_mean, lr_max = per_rollout_log_ratio(logp.detach() - behaviour, batch.flat_rollout, len(samples))
    loss, stats = policy_loss(logp, behaviour, advantages[batch.flat_rollout], None, config)
    loss.backward()
    max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()

    metrics = {**stats, "grad_norm": float(grad_norm), "samples": float(len(samples))}
    metrics.update(_staleness(samples, step))
    return StepResult(loss=float(loss.detach()), reward_mean=float(rewards.mean()), metrics=metrics,
                      rollout_ids=[s.rollout_id for s in samples], advantages=advantages.tolist(),
                      log_ratio_mean=lr_mean.tolist(), log_ratio_max_abs=lr_max.tolist())


def train_step_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample],
                       config: TrainerConfig, pad_id: int, ranks: Ranks, step: int | None = None,
                       temperature: float = 1.0, device: torch.device | None = None) -> StepResult:
    """`train_step` on one rank of an FSDP2 model: this rank's contiguous slice of the samples,
    the same result as one process on the whole batch (every rank returns it)."""
    import torch.distributed as dist

    device = device or torch.device("cpu")
    # Groups are normalised over the whole batch, which every rank holds.
    prompts, completions, recorded, rewards, advantages = _unpack(samples, config)
    tokens = sum(len(c) for c in completions)
    lo, hi = len(samples) * ranks.rank // ranks.world, len(samples) * (ranks.rank + 1) // ranks.world

    optimizer.zero_grad(set_to_none=True)
    if hi > lo:
        batch = PackedBatch(prompts[lo:hi], completions[lo:hi], pad_id)
        behaviour = torch.from_numpy(np.concatenate(recorded[lo:hi]).astype(np.float32))
        logp = completion_logprobs(model, _on(batch, device), temperature)
        lr_mean, lr_max = per_rollout_log_ratio(logp.detach().cpu() - behaviour, batch.flat_rollout, hi - lo)
        loss, stats = policy_loss(logp, behaviour.to(device), advantages[lo:hi][batch.flat_rollout].to(device),
                                  None, config)
        local_sum = loss * max(len(logp), 1)  # policy_loss is a token mean over this slice
    else:
        # FSDP's collectives need every rank's forward and backward: a rank without samples
        # (a batch smaller than the world) adds a zero to the loss.
        logits = model(input_ids=torch.full((1, 1), pad_id, dtype=torch.long, device=device)).logits
        local_sum = logits.sum() * 0.0
        stats, lr_mean, lr_max = {"tokens": 0.0}, torch.empty(0), torch.empty(0)
    # FSDP averages the gradients over ranks: x world makes them those of the whole batch's
    # token mean, as one process would compute it.
    (local_sum * (ranks.world / max(tokens, 1))).backward()
    max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()

    parts: list = [None] * ranks.world
    dist.all_gather_object(parts, (float(local_sum.detach()), stats, lr_mean.tolist(), lr_max.tolist()))
    metrics = {**merge_stats([p[1] for p in parts]), "grad_norm": float(grad_norm), "samples": float(len(samples))}
    metrics.update(_staleness(samples, step))
    return StepResult(loss=sum(p[0] for p in parts) / max(tokens, 1), reward_mean=float(rewards.mean()),
                      metrics=metrics, rollout_ids=[s.rollout_id for s in samples], advantages=advantages.tolist(),
                      log_ratio_mean=[v for p in parts for v in p[2]], log_ratio_max_abs=[v for p in parts for v in p[3]])


def _unpack(samples: Sequence[Sample], config: TrainerConfig):
    """(prompts, completions, recorded logprobs, rewards, group-normalised advantages) of a
    batch; a sample whose logprobs do not cover its completion is refused, naming it."""
    if not samples:
        raise ValueError("a batch needs at least one sample")
    prompts = [unpack_i32(s.prompt_token_ids).tolist() for s in samples]
    completions = [unpack_i32(s.completion_token_ids).tolist() for s in samples]
    recorded = [unpack_f32(s.logprobs) for s in samples]
    for s, c, lp in zip(samples, completions, recorded):
        if len(c) != len(lp):
            raise ValueError(f"rollout {s.rollout_id}: {len(c)} completion tokens but {len(lp)} logprobs")
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    advantages = group_advantages(rewards, torch.tensor([s.group_id for s in samples]), config.normalize_std)
    return prompts, completions, recorded, rewards, advantages


def _staleness(samples: Sequence[Sample], step: int | None) -> dict[str, float]:
    """Staleness of a sample consumed by step s: (s - 1) - its dispatched version."""
    if step is None:
        return {}
    lags = [(step - 1) - s.dispatched_version for s in samples]
    return {"staleness_mean": float(np.mean(lags)), "staleness_max": float(max(lags))}


def _on(batch: PackedBatch, device: torch.device) -> PackedBatch:
    if device.type != "cpu":  # written, not yet run on a GPU
        for name in ("input_ids", "attention_mask", "completion", "targets"):
            setattr(batch, name, getattr(batch, name).to(device))
    return batch
