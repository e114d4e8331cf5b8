"""GRPO advantages, the policy losses, and teacher-forced logprobs: pure torch, no I/O.

Losses (`TrainerConfig.loss`), all token means over the valid tokens of the batch, with
r = exp(logp_new - logp_behaviour) against the engine's recorded (behaviour) logprobs:

    tis     -mean(min(r, is_cap).detach() * A * logp_new)   the default: with one optimizer
            step per batch the proximal policy of decoupled PPO is the current one, so the
            objective reduces to a truncated-IS policy gradient; it tolerates staleness
            (docs/trainer.md, "Staleness and the loss (measured)")
    ppo     -mean(min(r * A, clip(r, 1 - ppo_clip, 1 + ppo_clip) * A))
    icepop  -mean(keep * r.detach() * A * logp_new), keep = r in [icepop_low, icepop_high]
    plain   -mean(A * logp_new)
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from orchestrator.config.run import TrainerConfig

# exp() of a log-ratio beyond this overflows nothing but says nothing more either; clamping
# keeps a wildly stale token from turning the ppo loss into inf.
_MAX_LOG_RATIO = 20.0

# The head runs on about this many logits at once (16 MiB in fp32): tokens per chunk = this //
# vocab (1024 for a 4096-token vocabulary), but at least MIN_CHUNK_TOKENS: every chunk reads
# the whole head weight and its backward adds a whole-head gradient, so thin chunks cost time
# (one CPU thread, vocab 151,936, hidden 128, 2048 tokens, forward and backward: 14.2 s CPU at
# 27 tokens per chunk, 6.7 s at 110, 5.6 s at 441, 4.4 s unchunked).
LOGIT_CHUNK_ELEMENTS = 1 << 22
MIN_CHUNK_TOKENS = 128
# Config attributes of models whose logits are not head(body(x)): a transform after the head
# (Gemma's soft-capping, Cohere's logit_scale, Granite's logits_scaling) or a scaling of the
# hidden state before it (MiniCPM's dim_model_base). Such a model takes its full forward.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "dim_model_base",
                     "output_multiplier_scale")
# The split path's method on the model (an FSDP2 forward method under torchrun), and the
# attribute that keeps the path chosen.
SPLIT_METHOD = "inflight_completion_logprobs"
_PATH_ATTR = "_inflight_logprob_path"


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
                mask: torch.Tensor | None, config: TrainerConfig,
                logp_clean: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, stats) for one batch of tokens; `mask` (bool or 0/1, None: all) marks valid tokens.

    `logp_clean`: the same weights' logprobs from a forward without dropout, when `logp_new`'s
    forward had dropout (LoRA's `dropout > 0`). The ratios' values (the IS weights, the clip
    decisions, the mismatch statistics) are then taken from it, so that a dropout mask is not
    reported as off-policy mismatch; the gradient still flows through `logp_new`."""
    valid = torch.ones_like(logp_new, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    measured = logp_new.detach() if logp_clean is None else logp_clean.detach()
    log_ratio = (measured - logp_behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    adv = advantages_per_token.to(logp_new.dtype)
    if config.loss == "tis":
        weight = ratio.clamp(max=config.is_cap)
        per_token = -(weight * adv * logp_new)
        clipped = ratio > config.is_cap
    elif config.loss == "ppo":
        # The ratio carries the gradient here, so it is rebuilt from logp_new (not detached).
        if logp_clean is None:
            r = (logp_new - logp_behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
        else:  # the clean ratio's value, the dropout forward's gradient (d r = r d logp_new)
            r = ratio * (logp_new - logp_new.detach()).exp()
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
    if len(parts) == 1:
        return dict(parts[0])  # exactly one slice's stats, not re-weighted through a sum
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


def completion_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0,
                        chunk_tokens: int | None = None) -> torch.Tensor:
    """The model's logprob of every completion token (flat, see PackedBatch), teacher forced,
    under the sampling temperature: the engine's processed logprobs are of logits / T, and the
    ratio must compare the same distribution (at T = 1 raw and processed coincide).

    A model whose logits are head(body(x)) (`logprob_path` "split", chosen once per model) runs
    its body, then the head on the completion positions only, `chunk_tokens` at a time
    (`head_logprobs`): no `[tokens, vocab]` logits, fp32 or other, exist at once. Any other
    model takes its full forward ("full")."""
    if logprob_path(model) == "split":
        return getattr(model, SPLIT_METHOD)(batch.input_ids, batch.attention_mask, batch.completion, batch.targets,
                                            temperature, chunk_tokens)
    return _full_forward_logprobs(model, batch, temperature)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  chunk_tokens: int | None = None) -> torch.Tensor:
    """log softmax(head(hidden) / T) at `targets`, row by row ([N, H] -> [N] fp32), the head
    applied to `chunk_tokens` rows at a time (default: LOGIT_CHUNK_ELEMENTS // vocab, at least
    MIN_CHUNK_TOKENS). Each chunk is checkpointed, so the backward recomputes its logits
    instead of keeping every chunk's."""
    vocab = head.weight.shape[0]
    chunk = chunk_tokens or max(MIN_CHUNK_TOKENS, LOGIT_CHUNK_ELEMENTS // vocab)
    train = torch.is_grad_enabled()
    parts = []
    # One pass even when there is no row: the result still hangs off the graph (a loss on it can
    # run backward, as every rank of a sharded step must).
    for lo in range(0, max(len(hidden), 1), chunk):
        h, t = hidden[lo:lo + chunk], targets[lo:lo + chunk]
        if train:
            parts.append(checkpoint(_chunk_logprobs, head, h, t, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t, temperature))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _full_forward_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1]
    logits = logits[batch.completion].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch.targets[batch.completion]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def logprob_path(model: torch.nn.Module) -> str:
    """"split" (body, then the head in chunks) or "full" (the model's own forward), chosen at the
    first call and kept on the model. Split needs a decoder (`get_decoder()`) and a linear head
    (`get_output_embeddings()`), no config attribute that transforms the logits between them
    (`_LOGIT_TRANSFORMS`), and its logprobs equal to the full forward's on a short sequence.
    Under FSDP2 every rank chooses at the same call, from the same weights."""
    path = getattr(model, _PATH_ATTR, None)
    if path is None:
        path = "split" if _install_split(model) and _split_agrees(model) else "full"
        setattr(model, _PATH_ATTR, path)
    return path


def _install_split(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import register_fsdp_forward_method

    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError, TypeError):
        return False
    if not isinstance(decoder, torch.nn.Module) or decoder is model or not isinstance(head, torch.nn.Linear):
        return False
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) is not None for name in _LOGIT_TRANSFORMS):
        return False
    setattr(model, SPLIT_METHOD, types.MethodType(_split_logprobs, model))
    # FSDP2 gathers the root's parameters (embeddings, final norm, head) around forward() only:
    # this makes the method a forward too. A no-op on a model that is not sharded.
    register_fsdp_forward_method(model, SPLIT_METHOD)
    return True


def _split_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion: torch.Tensor,
                    targets: torch.Tensor, temperature: float, chunk_tokens: int | None) -> torch.Tensor:
    """The model's method (see `_install_split`): the body's hidden states at the positions
    that predict a completion token, then the head on those only."""
    hidden = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return head_logprobs(self.get_output_embeddings(), hidden[:, :-1][completion], targets[completion], temperature,
                         chunk_tokens)


def _split_agrees(model: torch.nn.Module) -> bool:
    """The split path's logprobs equal the full forward's on 8 tokens (a transform of the logits
    that no known config attribute names shows up here)."""
    param = next(model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(8) % vocab).tolist()
    batch = PackedBatch([ids[:3]], [ids[3:]], pad_id=0)
    device = param.device
    for name in ("input_ids", "attention_mask", "completion", "targets"):
        setattr(batch, name, getattr(batch, name).to(device))
    with torch.no_grad():
        split = getattr(model, SPLIT_METHOD)(batch.input_ids, batch.attention_mask, batch.completion, batch.targets,
                                             1.0, None)
        full = _full_forward_logprobs(model, batch, 1.0)
    tolerance = 1e-4 if param.dtype == torch.float32 else 5e-2
    return bool(torch.allclose(split, full, rtol=0.0, atol=tolerance))


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
