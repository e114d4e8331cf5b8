"""A bound on how far one optimizer step moves the policy (`trainer.kl_target`): the learning
rate is scaled down when a step moved the sampled tokens' distribution by more than the target,
and back up towards `trainer.lr` when it moved them by much less.

Why: Adam's step is about `lr` per parameter whatever the gradient's size, so how far one step
moves the policy depends on the model, not on the loss. On a model whose logits are sensitive
to its weights (the `small` preset at lr 3e-3: 1.5-3 nats a token a step) two or three steps in
one direction saturate the policy: every sample of a group is then the same sequence, every
advantage 0, every gradient 0, for ever (docs/trainer.md, "One step's size").

What is measured costs nothing extra: the step's own forward already compares each sample's
recorded logprobs (the version that sampled it) with the trainer's before the step. A sample
`lag` versions old spans `lag` steps; the batch's youngest samples past lag 0 are used, their
per-token KL estimate over their lag standing for one step. Steps in one direction add up
faster than linearly, so with a youngest lag above 1 the figure errs high and the bound holds
steps below the target (conservative); samples whose later tokens a newer version sampled (an
activation during the rollout) count by their dispatched version, which errs low; the engine's
and trainer's numerical mismatch counts as movement (keep the target well above an on-policy
batch's `kl_k3`). Samples of the trainer's own version (lag 0: a synchronous loop) say nothing
about a step, and a batch of only those leaves the rate as it was. Pure functions: the trainer
applies the rate (it lives in the optimizer's state, so checkpoints and resumes carry it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

# KL grows about as the square of a small step, so a step's rate is scaled by sqrt(target / kl);
# never by less than this at once (one noisy batch), and never up by more than GROW.
SHRINK_FLOOR = 0.1
GROW = 1.5
# The rate's floor, a share of trainer.lr: it can always come back.
MIN_SHARE = 1e-3


def per_step_kl(lags: Sequence[int], log_ratio_means: Sequence[float]) -> float | None:
    """The mean over the youngest samples older than the trainer (the smallest lag >= 1 with a
    figure) of their per-token KL estimate (-mean log ratio, k1) divided by that lag; None when
    no sample is older or none has a figure (a rollout without completion tokens has NaN)."""
    known = [(lag, m) for lag, m in zip(lags, log_ratio_means) if lag >= 1 and math.isfinite(m)]
    if not known:
        return None
    youngest = min(lag for lag, _ in known)
    per_step = [-m / lag for lag, m in known if lag == youngest]
    return sum(per_step) / len(per_step)


def next_lr(lr: float, lr_max: float, kl: float | None, target: float) -> float:
    """The rate for the next step after steps at `lr` moved the policy by `kl` a step: outside
    [target / 2, 2 x target] it moves (down by sqrt(target / kl), at most 10x; up by 1.5x, up to
    `lr_max`); inside, or with no figure, it stays."""
    if kl is None:
        return lr
    if kl > 2 * target:
        lr *= max(math.sqrt(target / kl), SHRINK_FLOOR)
    elif kl < target / 2:
        lr *= GROW
    return min(max(lr, lr_max * MIN_SHARE), lr_max)
