"""GRPO advantages, the policy losses, and teacher-forced logprobs: pure torch, no I/O.

Losses (`TrainerConfig.loss`), all token means over the valid tokens of the batch, with
r = exp(logp_new - logp_behaviour) against the engine's recorded (behaviour) logprobs:

    tis     -mean(min(r, is_cap).detach() * A * logp_new)   the default: with one optimizer
            step per batch the proximal policy of decoupled PPO is the current one, so the
            objective reduces to a truncated-IS policy gradient; it tolerates staleness
            (docs: FIELD.md, "Staleness and the loss")
    ppo     -mean(min(r * A, clip(r, 1 - ppo_clip, 1 + ppo_clip) * A))
    icepop  -mean(keep * r.detach() * A * logp_new), keep = r in [icepop_low, icepop_high]
    plain   -mean(A * logp_new)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from orchestrator.config import TrainerConfig

# exp() of a log-ratio beyond this overflows nothing but says nothing more either; clamping
# keeps a wildly stale token from turning the ppo loss into inf.
_MAX_LOG_RATIO = 20.0


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool,
                     eps: float = 1e-6) -> torch.Tensor:
    """Reward minus its group's mean, over (population std + eps) when normalize_std."""
    rewards = rewards.to(torch.float32)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float32).index_add_(0, inverse, rewards)
    means = sums / counts
    centred = rewards - means[inverse]
    if not normalize_std:
        return centred
    var = torch.zeros(len(counts), dtype=torch.float32).index_add_(0, inverse, centred * centred) / counts
    return centred / (var.sqrt()[inverse] + eps)


def policy_loss(logp_new: torch.Tensor, logp_behaviour: torch.Tensor, advantages_per_token: torch.Tensor,
                mask: torch.Tensor | None, config: TrainerConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, stats) for one batch of tokens; `mask` (bool or 0/1, None: all) marks valid tokens."""
    valid = torch.ones_like(logp_new, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    log_ratio = (logp_new.detach() - logp_behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    adv = advantages_per_token.to(logp_new.dtype)
    if config.loss == "tis":
        weight = ratio.clamp(max=config.is_cap)
        per_token = -(weight * adv * logp_new)
        clipped = ratio > config.is_cap
    elif config.loss == "ppo":
        # The ratio carries the gradient here, so it is rebuilt from logp_new (not detached).
        r = (logp_new - logp_behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
        bounded = r.clamp(1.0 - config.ppo_clip, 1.0 + config.ppo_clip)
        per_token = -torch.minimum(r * adv, bounded * adv)
        # Tokens whose gradient the clip removed.
        clipped = ((adv > 0) & (ratio > 1.0 + config.ppo_clip)) | ((adv < 0) & (ratio < 1.0 - config.ppo_clip))
    elif config.loss == "icepop":
        clipped = (ratio < config.icepop_low) | (ratio > config.icepop_high)
        per_token = -(torch.where(clipped, torch.zeros_like(ratio), ratio) * adv * logp_new)
    elif config.loss == "plain":
        per_token = -(adv * logp_new)
        clipped = torch.zeros_like(valid)
    else:
        raise ValueError(f"unknown loss {config.loss!r}")
    n = int(valid.sum())
    # where(), not a product: padding positions may hold anything, even inf.
    loss = torch.where(valid, per_token, torch.zeros_like(per_token)).sum() / max(n, 1)
    return loss, _stats(log_ratio, ratio, clipped, valid, n)


def _stats(log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, valid: torch.Tensor,
           n: int) -> dict[str, float]:
    if n == 0:
        return {"tokens": 0.0}  # no token: the ratios are unknown, not 1 or 0
    lr, r = log_ratio[valid], ratio[valid]
    # k3 = r - 1 - log r estimates KL(behaviour || new) from tokens sampled by the behaviour policy.
    k3 = r - 1.0 - lr
    return {"tokens": float(n), "ratio_mean": float(r.mean()), "ratio_max": float(r.max()),
            "ratio_min": float(r.min()), "clipped_frac": float(clipped[valid].float().mean()),
            "kl_k3": float(k3.mean()), "log_ratio_mean": float(lr.mean())}


def merge_stats(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """The `policy_loss` stats of a whole batch from those of its slices (one per trainer rank):
    token counts add, *_max / *_min take the extreme, the others are token means."""
    parts = [p for p in parts if p.get("tokens", 0.0) > 0]
    if not parts:
        return {"tokens": 0.0}
    n = sum(p["tokens"] for p in parts)
    out = {"tokens": n}
    for key in parts[0]:
        if key == "tokens":
            continue
        values = [p[key] for p in parts]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(p[key] * p["tokens"] for p in parts) / n
    return out


class PackedBatch:
    """Prompt+completion sequences, right-padded, and where their completion tokens are.

    `targets[b, t]` is the token at position t+1, predicted by the logits at position t;
    `completion[b, t]` marks the completion tokens among them. Selecting with that mask gives
    every completion token once, sample by sample, in order (row-major): the flat layout of
    `flat_rollout` and of each sample's recorded logprobs concatenated.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int):
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a sample has an empty prompt: its first completion token has no context")
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        width = max(lengths)
        self.input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        self.attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        self.completion = torch.zeros((len(prompts), max(width - 1, 0)), dtype=torch.bool)
        for b, (p, c) in enumerate(zip(prompts, completions)):
            row = list(p) + list(c)
            self.input_ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
            self.attention_mask[b, :len(row)] = 1
            self.completion[b, len(p) - 1:len(row) - 1] = True
        self.targets = self.input_ids[:, 1:]
        self.completion_lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
        self.flat_rollout = torch.repeat_interleave(torch.arange(len(prompts)), self.completion_lengths)


def completion_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
    """The model's logprob of every completion token (flat, see PackedBatch), teacher forced,
    under the sampling temperature: the engine's processed logprobs are of logits / T, and the
    ratio must compare the same distribution (at T = 1 raw and processed coincide)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logits = logits[batch.completion].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch.targets[batch.completion]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def per_rollout_log_ratio(diff: torch.Tensor, flat_rollout: torch.Tensor,
                          count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, max |.|) of per-token differences per rollout; NaN for a rollout without tokens
    (its statistics are unknown)."""
    diff = diff.detach().float()
    n = torch.zeros(count).index_add_(0, flat_rollout, torch.ones_like(diff))
    mean = torch.zeros(count).index_add_(0, flat_rollout, diff) / n
    max_abs = torch.zeros(count).scatter_reduce_(0, flat_rollout, diff.abs(), "amax", include_self=False)
    nan = torch.full((count,), float("nan"))
    return torch.where(n > 0, mean, nan), torch.where(n > 0, max_abs, nan)
