"""One optimizer step on one batch of samples, in one process (`train_step`) or on one rank
of an FSDP2 model (`train_step_sharded`): pure compute, no I/O. The trainer process
(`orchestrator.trainer.process`) drives them.

A batch runs as micro-batches of at most `trainer.micro_batch_tokens` padded tokens
(`micro_batches`: samples bucketed by length), each forward and backward on its own, their
gradients accumulated into one optimizer step. The loss is a token mean over the whole batch,
so each micro-batch adds its token sum / the batch's tokens: loss, gradient, clipping and step
are the whole batch's, and so are the statistics (merged by token count) and the per-rollout
log ratios (put back in batch order)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from orchestrator.config.run import TrainerConfig
from orchestrator.trainer.kl_control import next_lr, per_step_kl
from orchestrator.trainer.link import Sample, unpack_f32, unpack_i32
from orchestrator.trainer.lora import dropout_off, has_dropout
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


def micro_batches(lengths: Sequence[int], budget: int | None) -> list[list[int]]:
    """The samples (indices into `lengths`, prompt + completion tokens each) of each
    micro-batch. None: one micro-batch, the batch as it is. A budget: longest first (ties in
    batch order), cut so that a micro-batch's padded size (its rows x its longest row) stays
    within the budget; a sample longer than the budget goes alone. Neighbours in length share
    a micro-batch, so little of it is padding."""
    if budget is None:
        return [list(range(len(lengths)))] if lengths else []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class _Unpacked(msgspec.Struct):
    prompts: list[list[int]]
    completions: list[list[int]]
    recorded: list[np.ndarray]  # the engine's logprobs, per sample
    rewards: torch.Tensor
    advantages: torch.Tensor  # group-normalised over the whole batch
    sampled: list[np.ndarray | None]  # per sample: which completion tokens were sampled (None: all)

    @property
    def lengths(self) -> list[int]:
        return [len(p) + len(c) for p, c in zip(self.prompts, self.completions)]

    @property
    def tokens(self) -> int:
        """The tokens the loss averages over: the sampled ones."""
        return sum(len(c) if m is None else int(m.sum()) for c, m in zip(self.completions, self.sampled))

    def mask(self, mb: list[int]) -> np.ndarray | None:
        """The micro-batch's flat sampled-token mask; None when every token was sampled."""
        if all(self.sampled[i] is None for i in mb):
            return None
        return np.concatenate([np.ones(len(self.completions[i]), bool) if self.sampled[i] is None
                               else self.sampled[i] for i in mb])


class _Accumulated(msgspec.Struct):
    """What the micro-batches of one slice of the batch add up to, in the slice's order."""

    loss_sum: float  # the sum over tokens of the per-token loss
    stats: list[dict[str, float]]  # policy_loss's, one per micro-batch
    log_ratio_mean: torch.Tensor
    log_ratio_max_abs: torch.Tensor


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample],
               config: TrainerConfig, pad_id: int, step: int | None = None,
               temperature: float = 1.0, device: torch.device | None = None) -> StepResult:
    """One optimizer step on one batch of samples (pure compute: no I/O), by micro-batches of
    at most `config.micro_batch_tokens` (gradient accumulation: the same loss, gradient and
    step as the whole batch at once)."""
    data = _unpack(samples, config)
    optimizer.zero_grad(set_to_none=True)
    plan = micro_batches(data.lengths, config.micro_batch_tokens)
    # The loss is a token mean over the whole batch: each micro-batch's token sum / all tokens.
    acc = _accumulate(model, data, list(range(len(samples))), plan, config, pad_id, temperature,
                      device or torch.device("cpu"), scale=1.0 / max(data.tokens, 1))
    paced = _pace(optimizer, config, samples, step, acc.log_ratio_mean.tolist())
    grad_norm = _clip_and_step(model, optimizer, config)
    metrics = {**merge_stats(acc.stats), "grad_norm": grad_norm, "samples": float(len(samples)), **paced}
    metrics.update(_staleness(samples, step))
    return StepResult(loss=acc.loss_sum / max(data.tokens, 1), reward_mean=float(data.rewards.mean()),
                      metrics=metrics, rollout_ids=[s.rollout_id for s in samples],
                      advantages=data.advantages.tolist(), log_ratio_mean=acc.log_ratio_mean.tolist(),
                      log_ratio_max_abs=acc.log_ratio_max_abs.tolist())


def train_step_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample],
                       config: TrainerConfig, pad_id: int, ranks: Ranks, step: int | None = None,
                       temperature: float = 1.0, device: torch.device | None = None) -> StepResult:
    """`train_step` on one rank of an FSDP2 model: this rank's contiguous slice of the samples,
    the same result as one process on the whole batch (every rank returns it)."""
    import torch.distributed as dist

    device = device or torch.device("cpu")
    # Groups are normalised over the whole batch, which every rank holds.
    data = _unpack(samples, config)
    lengths = data.lengths
    slices = [range(len(samples) * r // ranks.world, len(samples) * (r + 1) // ranks.world) for r in range(ranks.world)]
    mine = list(slices[ranks.rank])
    plan = [[mine[i] for i in mb] for mb in micro_batches([lengths[i] for i in mine], config.micro_batch_tokens)]
    # FSDP's collectives need every rank's forward and backward, as many on each: a rank with
    # fewer micro-batches (a shorter slice, or none: a batch smaller than the world) runs idle
    # passes that add zero to the gradient.
    passes = max(len(micro_batches([lengths[i] for i in s], config.micro_batch_tokens)) for s in slices)

    optimizer.zero_grad(set_to_none=True)
    # FSDP averages the gradients over ranks: x world makes them those of the whole batch's
    # token mean, as one process would compute it.
    acc = _accumulate(model, data, mine, plan, config, pad_id, temperature, device,
                      scale=ranks.world / max(data.tokens, 1))
    for _ in range(passes - len(plan)):
        _idle_pass(model, pad_id, temperature, device)
    # Gathered before the step: every rank paces it from the whole batch's log ratios, the same rate.
    parts: list = [None] * ranks.world
    dist.all_gather_object(parts, (acc.loss_sum, merge_stats(acc.stats), acc.log_ratio_mean.tolist(),
                                   acc.log_ratio_max_abs.tolist()))
    log_ratio_mean = [v for p in parts for v in p[2]]
    paced = _pace(optimizer, config, samples, step, log_ratio_mean)
    grad_norm = _clip_and_step(model, optimizer, config)

    metrics = {**merge_stats([p[1] for p in parts]), "grad_norm": grad_norm, "samples": float(len(samples)),
               **paced}
    metrics.update(_staleness(samples, step))
    return StepResult(loss=sum(p[0] for p in parts) / max(data.tokens, 1), reward_mean=float(data.rewards.mean()),
                      metrics=metrics, rollout_ids=[s.rollout_id for s in samples],
                      advantages=data.advantages.tolist(),
                      log_ratio_mean=log_ratio_mean,
                      log_ratio_max_abs=[v for p in parts for v in p[3]])


def _accumulate(model: torch.nn.Module, data: _Unpacked, indices: list[int], plan: list[list[int]],
                config: TrainerConfig, pad_id: int, temperature: float, device: torch.device,
                scale: float) -> _Accumulated:
    """Forward and backward of each micro-batch in `plan` (sample indices, all in `indices`),
    each micro-batch's token sum of the loss x `scale` into the gradients; per-rollout log
    ratios come back in the order of `indices`."""
    position = {i: k for k, i in enumerate(indices)}
    noisy = has_dropout(model)  # LoRA dropout: the ratios come from a second forward without it
    nan = torch.full((len(indices),), float("nan"))
    acc = _Accumulated(loss_sum=0.0, stats=[], log_ratio_mean=nan.clone(), log_ratio_max_abs=nan.clone())
    for mb in plan:
        batch = PackedBatch([data.prompts[i] for i in mb], [data.completions[i] for i in mb], pad_id)
        behaviour = torch.from_numpy(np.concatenate([data.recorded[i] for i in mb]).astype(np.float32))
        advantages = data.advantages[mb][batch.flat_rollout]
        logp = completion_logprobs(model, _on(batch, device), temperature)
        clean = _clean_logprobs(model, batch, temperature, device) if noisy else logp.detach()
        flat = data.mask(mb)
        mask = None if flat is None else torch.from_numpy(flat)
        if mask is not None:
            # An environment's tokens have no behaviour logprob (NaN): context for the forward,
            # out of the loss. Made equal to the trainer's own there, so that no NaN reaches a
            # gradient (a masked-out NaN still poisons the backward of a product).
            behaviour = torch.where(mask, behaviour, clean.cpu())
        # The weights have not moved yet, so `clean` is the trainer's logprob before the step:
        # the gradient's own forward when it has no dropout (train and inference forwards agree).
        diff, rollout_of = clean.cpu() - behaviour, batch.flat_rollout
        if mask is not None:
            diff, rollout_of = diff[mask], rollout_of[mask]
        lr_mean, lr_max = per_rollout_log_ratio(diff, rollout_of, len(mb))
        slots = torch.tensor([position[i] for i in mb])
        acc.log_ratio_mean[slots], acc.log_ratio_max_abs[slots] = lr_mean, lr_max
        loss, stats = policy_loss(logp, behaviour.to(device), advantages.to(device),
                                  None if mask is None else mask.to(device), config,
                                  logp_clean=clean if noisy else None)
        n = len(logp) if mask is None else int(mask.sum())
        (loss * (n * scale)).backward()  # policy_loss is a token mean over this micro-batch
        acc.loss_sum += float(loss.detach()) * n
        acc.stats.append(stats)
    return acc


def _clean_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float,
                    device: torch.device) -> torch.Tensor:
    """The batch's logprobs from a forward without LoRA's dropout (no gradient)."""
    with torch.no_grad(), dropout_off(model):
        return completion_logprobs(model, _on(batch, device), temperature)


def _idle_pass(model: torch.nn.Module, pad_id: int, temperature: float, device: torch.device) -> None:
    """A forward and backward through the same path as a micro-batch, adding zero (and, under
    LoRA dropout, the micro-batch's second forward: FSDP's collectives need as many on each rank)."""
    batch = PackedBatch([[pad_id]], [[pad_id]], pad_id)
    if has_dropout(model):
        _clean_logprobs(model, batch, temperature, device)
    logp = completion_logprobs(model, _on(batch, device), temperature)
    (logp.sum() * 0.0).backward()


def _pace(optimizer: torch.optim.Optimizer, config: TrainerConfig, samples: Sequence[Sample],
          step: int | None, log_ratio_mean: list[float]) -> dict[str, float]:
    """`trainer.kl_target`: the rate this step takes, from how far the steps before it moved the
    policy (this batch's log ratios, measured before the step: `kl_control`); its figures for the
    step's metrics. Nothing without a target or a step number (no lags)."""
    if config.kl_target is None or step is None:
        return {}
    kl = per_step_kl(_lags(samples, step), log_ratio_mean)
    lr = next_lr(optimizer.param_groups[0]["lr"], config.lr, kl, config.kl_target)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return {"lr": lr} if kl is None else {"lr": lr, "kl_per_step": kl}


def _clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainerConfig) -> float:
    max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    return float(grad_norm)


def _unpack(samples: Sequence[Sample], config: TrainerConfig) -> _Unpacked:
    """A batch's tokens, recorded logprobs, rewards and group-normalised advantages; a sample
    whose logprobs do not cover its completion is refused, naming it."""
    if not samples:
        raise ValueError("a batch needs at least one sample")
    prompts = [unpack_i32(s.prompt_token_ids).tolist() for s in samples]
    completions = [unpack_i32(s.completion_token_ids).tolist() for s in samples]
    recorded = [unpack_f32(s.logprobs) for s in samples]
    for s, c, lp in zip(samples, completions, recorded):
        if len(c) != len(lp):
            raise ValueError(f"rollout {s.rollout_id}: {len(c)} completion tokens but {len(lp)} logprobs")
    sampled = [_sampled_mask(s, len(c)) for s, c in zip(samples, completions)]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    advantages = group_advantages(rewards, torch.tensor([s.group_id for s in samples]), config.normalize_std)
    return _Unpacked(prompts, completions, recorded, rewards, advantages, sampled)


def _sampled_mask(sample: Sample, n: int) -> np.ndarray | None:
    """Which of a sample's completion tokens were sampled; a span past its completion is refused."""
    if not sample.environment_spans:
        return None
    flat = unpack_i32(sample.environment_spans).tolist()
    mask = np.ones(n, dtype=bool)
    for start, end in zip(flat[0::2], flat[1::2]):
        if not 0 <= start < end <= n:
            raise ValueError(f"rollout {sample.rollout_id}: environment span ({start}, {end}) outside its {n} "
                             "completion tokens")
        mask[start:end] = False
    return mask


def _lags(samples: Sequence[Sample], step: int) -> list[int]:
    """Each sample's staleness for step s: the steps since its dispatched version, (s - 1) - it."""
    return [(step - 1) - s.dispatched_version for s in samples]


def _staleness(samples: Sequence[Sample], step: int | None) -> dict[str, float]:
    """Staleness of a sample consumed by step s: (s - 1) - its dispatched version."""
    if step is None:
        return {}
    lags = _lags(samples, step)
    return {"staleness_mean": float(np.mean(lags)), "staleness_max": float(max(lags))}


def _on(batch: PackedBatch, device: torch.device) -> PackedBatch:
    if device.type != "cpu":  # written, not yet run on a GPU
        for name in ("input_ids", "attention_mask", "completion", "targets"):
            setattr(batch, name, getattr(batch, name).to(device))
    return batch
