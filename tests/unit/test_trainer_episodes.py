"""The trainer on multi-turn episodes (issue #19): an episode's environment tokens are context
for the forward and out of the loss; their logprobs (NaN: none exists) never reach a gradient."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from orchestrator.config.run import TrainerConfig
from orchestrator.trainer.link import Sample, pack_f32, pack_i32
from orchestrator.trainer.step import train_step

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

NAN = float("nan")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def samples(model, env_logprob: float | None, spans: list[tuple[int, int]] | None) -> list[Sample]:
    """Four samples whose recorded logprobs are the model's own, perturbed a little (so every
    loss trains on them); the environment's tokens carry `env_logprob` (None: their own)."""
    rng = np.random.default_rng(0)
    out = []
    for j in range(4):
        completion = rng.integers(3, 1000, 12).tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[5, 6, 7] + completion])).logits[0, 2:-1]
        own = torch.log_softmax(logits, -1)[torch.arange(12), torch.tensor(completion)]
        logprobs = (own + torch.from_numpy(rng.normal(0, 0.2, 12)).float()).tolist()
        for start, end in spans or ():
            for i in range(start, min(end, len(logprobs))):
                logprobs[i] = logprobs[i] if env_logprob is None else env_logprob
        flat = [x for span in spans or () for x in span]
        out.append(Sample(rollout_id=j, group_id=0, prompt_token_ids=pack_i32([5, 6, 7]),
                          completion_token_ids=pack_i32(completion), logprobs=pack_f32(logprobs),
                          reward=float(j % 2), dispatched_version=0,
                          environment_spans=pack_i32(flat) if flat else b""))
    return out


def step(model, batch, loss: str):
    m = copy.deepcopy(model)
    optimizer = torch.optim.Adam(m.parameters(), lr=1e-2)
    result = train_step(m, optimizer, batch, TrainerConfig(loss=loss), pad_id=0, step=1)
    return result, torch.cat([p.detach().flatten() for p in m.parameters()])


@pytest.mark.parametrize("loss", ["tis", "ppo", "icepop", "plain"])
def test_environment_tokens_are_context_not_loss(model, loss):
    spans = [(3, 6), (9, 10)]
    masked, params = step(model, samples(model, NAN, spans), loss)
    assert torch.isfinite(params).all() and np.isfinite(masked.loss)
    assert masked.metrics["tokens"] == 4 * (12 - 4), "the loss averages over the sampled tokens only"
    assert all(np.isfinite(masked.log_ratio_mean)), "per-rollout log ratios over sampled tokens"
    # whatever logprob an environment token carries, it changes nothing
    other, other_params = step(model, samples(model, -6.9, spans), loss)
    assert torch.equal(params, other_params) and other.loss == masked.loss
    # and without the spans the same tokens would have been trained on
    _, unmasked = step(model, samples(model, None, None), loss)
    assert not torch.equal(params, unmasked)


def test_a_span_past_the_completion_is_refused_naming_the_rollout(model):
    with pytest.raises(ValueError, match=r"rollout 0: environment span \(10, 20\)"):
        step(model, samples(model, NAN, [(10, 20)]), "tis")
