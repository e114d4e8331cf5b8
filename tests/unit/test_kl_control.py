"""`trainer.kl_target`: one step's move of the policy bounded by the rate (kl_control), paced from
the batch's own log ratios inside `train_step`, carried by the optimizer's state (checkpoints)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from orchestrator.config.run import TrainerConfig
from orchestrator.errors import ConfigError
from orchestrator.trainer.kl_control import GROW, MIN_SHARE, SHRINK_FLOOR, next_lr, per_step_kl

pytestmark = pytest.mark.timeout(120)


def test_per_step_kl_takes_the_youngest_samples_past_lag_0_over_their_lag():
    # lag 0 says nothing of a step; NaN (no completion tokens) has no figure; lag 3 is not the youngest.
    assert per_step_kl([0, 1, 3, 1], [-5.0, -0.4, -9.0, float("nan")]) == pytest.approx(0.4)
    assert per_step_kl([3, 2, 2, 0], [-9.0, -0.6, -1.0, -5.0]) == pytest.approx(0.4)
    assert per_step_kl([0, 0], [-1.0, -2.0]) is None
    assert per_step_kl([1], [float("nan")]) is None


def test_next_lr_shrinks_by_the_square_root_grows_slowly_and_stays_within_its_bounds():
    assert next_lr(1e-3, 3e-3, 0.4, 0.1) == pytest.approx(1e-3 * math.sqrt(0.1 / 0.4))
    assert next_lr(1e-3, 3e-3, 1e6, 0.1) == pytest.approx(1e-3 * SHRINK_FLOOR)  # one batch: at most 10x
    assert next_lr(1e-3, 3e-3, 0.01, 0.1) == pytest.approx(1e-3 * GROW)
    assert next_lr(2.5e-3, 3e-3, 0.0, 0.1) == 3e-3  # never past trainer.lr
    assert next_lr(3e-6, 3e-3, 1e6, 0.1) == pytest.approx(3e-3 * MIN_SHARE)  # never below its floor
    for kl in (0.05, 0.1, 0.2, None):  # inside the band, or no figure: it stays
        assert next_lr(1e-3, 3e-3, kl, 0.1) == 1e-3


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_kl_target_that_is_not_a_positive_number_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match="trainer.kl_target"):
        TrainerConfig(kl_target=value).validate()


def _batch(model_dir, lag: int, shift: float, step: int):
    """One group of 4 of the digits task, sampled `lag` versions before the trainer's, whose
    recorded logprobs are the trainer's own plus `shift`: the policy that sampled them held them
    likelier by `shift` nats a token, as a policy that has moved since holds its own samples."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.trainer.link import Sample, pack_f32, pack_i32
    from orchestrator.trainer.loss import PackedBatch, completion_logprobs

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tok("12 34 ").input_ids
    completions = [tok(t).input_ids for t in ("5", "67", "x 8", "99")]
    with torch.no_grad():
        own = completion_logprobs(model, PackedBatch([prompt] * 4, completions, tok.pad_token_id), 1.0)
    own, samples, at = own.numpy(), [], 0
    for i, c in enumerate(completions):
        lp = own[at:at + len(c)] + shift
        at += len(c)
        samples.append(Sample(rollout_id=i, group_id=0, prompt_token_ids=pack_i32(prompt),
                              completion_token_ids=pack_i32(c), logprobs=pack_f32(lp.astype(np.float32)),
                              reward=float(i % 2), dispatched_version=(step - 1) - lag))
    return model, samples, tok.pad_token_id


def test_train_step_takes_the_rate_its_batch_asks_for_and_reports_it(rl_model):
    from orchestrator.trainer.step import train_step

    config = TrainerConfig(lr=3e-3, kl_target=0.1)
    model, samples, pad = _batch(rl_model, lag=2, shift=0.8, step=5)  # 0.4 a step: 4x the target
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    result = train_step(model, optimizer, samples, config, pad_id=pad, step=5)
    assert result.metrics["kl_per_step"] == pytest.approx(0.4, rel=1e-3)
    assert result.metrics["lr"] == pytest.approx(3e-3 * math.sqrt(0.1 / 0.4), rel=1e-3)
    assert optimizer.param_groups[0]["lr"] == result.metrics["lr"]  # the step took it; checkpoints carry it
    assert optimizer.state_dict()["param_groups"][0]["lr"] == result.metrics["lr"]


def test_without_a_target_or_with_only_fresh_samples_the_rate_stays(rl_model):
    from orchestrator.trainer.step import train_step

    model, samples, pad = _batch(rl_model, lag=2, shift=0.8, step=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    result = train_step(model, optimizer, samples, TrainerConfig(lr=3e-3), pad_id=pad, step=5)
    assert "lr" not in result.metrics and "kl_per_step" not in result.metrics
    assert optimizer.param_groups[0]["lr"] == 3e-3
    # A synchronous loop's batch (lag 0) has no figure of a step: the rate stays, and none is reported.
    model, samples, pad = _batch(rl_model, lag=0, shift=0.0, step=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    result = train_step(model, optimizer, samples, TrainerConfig(lr=3e-3, kl_target=0.1), pad_id=pad, step=5)
    assert result.metrics["lr"] == 3e-3 and "kl_per_step" not in result.metrics


def test_a_checkpoint_resumes_at_the_paced_rate_not_trainer_lr(rl_model, tmp_path):
    from orchestrator.trainer import checkpoint
    from orchestrator.trainer.step import train_step

    config = TrainerConfig(lr=3e-3, kl_target=0.1)
    model, samples, pad = _batch(rl_model, lag=1, shift=0.4, step=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    paced = train_step(model, optimizer, samples, config, pad_id=pad, step=3).metrics["lr"]
    assert paced < config.lr
    meta = checkpoint.CheckpointMeta(step=1, version=1, created_unix=0.0,
                                     consumption=checkpoint.Consumption([], [], [], [], 0.0, 0.0, {}))
    checkpoint.save(tmp_path, model, optimizer, meta, keep=1)
    resumed, _, _ = _batch(rl_model, lag=1, shift=0.4, step=3)
    fresh = torch.optim.Adam(resumed.parameters(), lr=config.lr)  # as the trainer makes it at start
    checkpoint.load(tmp_path, 1, resumed, fresh)
    assert fresh.param_groups[0]["lr"] == paced
