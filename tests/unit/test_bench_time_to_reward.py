"""The parts of `inflight bench time-to-reward` that decide its figures: the synchronous
reference's sampling (behaviour logprobs, where a completion ends) and the inflight config."""

import tomllib
from pathlib import Path

import pytest

from orchestrator.bench.sync_reference import _eos_ids, sample_batch
from orchestrator.bench.time_to_reward import WORKLOADS, _merge_toml, config_toml
from tests.reference import reference_logprobs


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir  # the session's tiny model (tests/conftest.py), read only


def test_the_references_samples_carry_their_generating_logprobs_and_end_at_the_first_eos(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = _eos_ids(model, tokenizer)
    assert eos
    prompts = [[5, 6, 7, 8, 9], [40, 41]]  # unequal lengths: the shorter one is left-padded
    samples = sample_batch(model, prompts, group_size=3, max_tokens=24, pad_id=0, eos=eos)
    assert [s[0] for s in samples] == [prompts[0]] * 3 + [prompts[1]] * 3
    for prompt, completion, logprobs in samples:
        assert 1 <= len(completion) == len(logprobs) <= 24
        assert not any(t in eos for t in completion[:-1])  # nothing after an EOS
        assert len(completion) == 24 or completion[-1] in eos
        expected = reference_logprobs(model, prompt, completion)
        assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-4


def test_the_inflight_config_holds_the_workload_and_extra_tables_override_it():
    from orchestrator.config.run import RunConfig, convert

    text = _merge_toml(config_toml(Path("/m"), WORKLOADS["small"], "just_in_time"),
                       ["[trainer]\\nthreads = 2", '[scheduler]\nadmission = "eager"'])
    config = convert(tomllib.loads(text), RunConfig, "config").validate()
    assert (config.scheduler.group_size, config.scheduler.batch_groups) == (4, 8)
    assert config.sampling.max_tokens == 64 and config.trainer.lr == 3e-3
    assert config.trainer.threads == 2 and config.scheduler.admission == "eager"
    assert config.run.model_preset == "small-rl" and config.eval.at_start is False


def test_the_cost_of_making_steps_durable_is_the_mean_over_every_step(tmp_path):
    """With trainer.checkpoint_every = 3 two steps of three journal and one checkpoints: the
    per-step figures are means over all steps (a median would hide the checkpoint, or show it
    as every step's); the train time stays a median."""
    from orchestrator.bench.time_to_reward import _inflight_figures
    from replay.log import ReplayLog
    from replay.records import ConsumptionRecord

    steps = [ConsumptionRecord(step=s, rollout_ids=[], metrics={"train_s": float(s), **(
        {"checkpoint_s": 3.0} if s % 3 == 0 else {"journal_s": 0.03})}) for s in range(1, 7)]
    with ReplayLog.open(tmp_path) as log:
        for record in steps:
            log.append(record)
    figures = _inflight_figures(tmp_path, 0.0, None)
    assert figures["checkpoint_s_per_step"] == pytest.approx(1.0)  # 2 checkpoints x 3 s / 6 steps
    assert figures["journal_s_per_step"] == pytest.approx(0.02)
    assert figures["train_s_per_step"] == pytest.approx(3.5)


def test_the_steps_past_the_target_report_their_lowest_reward_and_none_is_invented(tmp_path):
    """--after-target: a run kept going past the step that reached the target reports the lowest
    batch reward of the steps after it (a collapse shows there); a run stopped at the target
    reports no such figure."""
    import json

    from orchestrator.bench.time_to_reward import _inflight_figures
    from replay.log import ReplayLog

    with ReplayLog.open(tmp_path):
        pass
    rewards = [0.2, 0.95, 1.0, 0.0, 0.5]
    (tmp_path / "orchestrator.jsonl").write_text("".join(
        json.dumps({"event": "trainer.step_done", "step": s, "reward": r, "timestamp": f"2026-12-05T01:00:0{s}Z"})
        + "\n" for s, r in enumerate(rewards, start=1)))
    reached = {"event": "trainer.step_done", "step": 2, "reward": 0.95, "timestamp": "2026-12-05T01:00:02Z"}
    figures = _inflight_figures(tmp_path, 0.0, reached)
    assert figures["reward_min_after_target"] == 0.0 and figures["steps_after_target"] == 3
    assert figures["steps_to_target"] == 2
    stopped = {**reached, "step": 5, "reward": 0.5}
    assert "reward_min_after_target" not in _inflight_figures(tmp_path, 0.0, stopped)


def test_a_seed_given_by_set_gets_a_model_built_with_that_seed():
    """The run's seed seeds its model's build too: a model built with another seed is refused by
    the run, so each seed has its own directory (seed 0 keeps the preset's)."""
    from orchestrator.bench.time_to_reward import MODELS, _model_for, _seed

    assert _seed([]) == 0 and _seed(["[trainer]\\nthreads = 2"]) == 0
    assert _seed(["[run]\\nseed = 2", "[trainer]\\nthreads = 2"]) == 2
    assert _model_for("small-rl", 0) == (MODELS / "small-rl", "small-rl", 0)
    assert _model_for("small-rl", 2) == (MODELS / "small-rl-seed2", "small-rl", 2)


def test_a_negative_after_target_is_refused_naming_the_flag():
    import argparse

    from orchestrator.bench.time_to_reward import bench_command
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError, match="--after-target"):
        bench_command(argparse.Namespace(after_target=-1, keep=None, workloads=["tiny"]))


def test_a_set_that_is_not_toml_or_a_seed_that_is_not_an_integer_is_refused_naming_the_flag():
    from orchestrator.bench.time_to_reward import _seed
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError, match="--set/--variant: '\\[run' is not TOML"):
        _seed(["[run"])
    with pytest.raises(ConfigError, match="run.seed must be an integer, got 'x'"):
        _seed(['[run]\\nseed = "x"'])
