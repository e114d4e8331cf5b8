"""`trainer.checkpoint_every` = k: a checkpoint every k-th step, each step between journaled
(its batch and consumption), and --resume trains the journaled steps again from the checkpoint.
What must hold: the resumed trainer holds exactly the state (weights, Adam, step) of one that never
stopped; its re-derived weights equal the published version's; a version lost between the
journal entry and its publish is republished with the same weights; a stop checkpoints the
newest step; a journal with a gap, or a fresh start on a journal, is refused by name; the
orchestrator's account of a journaled step (consumption_of) is what the trainer sent."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.config.run import RunConfig, TrainerConfig, TransportConfig
from orchestrator.errors import ConfigError
from orchestrator.trainer import checkpoint, step_journal
from orchestrator.trainer.link import Batch, Sample, StepDone, pack_f32, pack_i32, unpack_f32
from orchestrator.trainer.process import Trainer
from orchestrator.trainer.publish import compare_with_files
from tests.unit.test_trainer_lora import _trainer
from transports.filesystem import published_versions, version_dir

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

STEPS = 5


def _config(**trainer) -> RunConfig:
    fields = {"threads": 1, "checkpoint_every": 3, "checkpoint_background": False, **trainer}
    return RunConfig(trainer=TrainerConfig(**fields), transport=TransportConfig(keep_last=8)).validate()


@pytest.fixture(scope="module")
def batches() -> dict[int, list[Sample]]:
    """Random prompts and completions, logprobs near a small model's, rewards varied per group."""
    out = {}
    for step in range(1, STEPS + 2):
        rng = np.random.default_rng(step)
        samples = []
        for j in range(8):
            prompt = rng.integers(3, 1024, size=int(rng.integers(3, 8))).tolist()
            completion = rng.integers(3, 1024, size=int(rng.integers(2, 6))).tolist()
            samples.append(Sample(rollout_id=100 * step + j, group_id=10 * step + j // 4,
                                  prompt_token_ids=pack_i32(prompt), completion_token_ids=pack_i32(completion),
                                  logprobs=pack_f32(rng.uniform(-7.5, -6.5, len(completion)).tolist()),
                                  reward=float(rng.random()), dispatched_version=step - 1))
        out[step] = samples
    return out


def _steps(trainer: Trainer, steps, batches) -> dict[int, StepDone]:
    out = {}
    for step in steps:
        done = trainer.handle(Batch(step=step, samples=batches[step]))
        assert isinstance(done, StepDone), done
        out[step] = done
    return out


def _state(trainer: Trainer) -> tuple[dict, dict]:
    weights = {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    adam = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    return weights, adam


def _assert_same_state(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    (weights, adam), (want_weights, want_adam) = got, want
    assert weights.keys() == want_weights.keys() and adam.keys() == want_adam.keys()
    for name, tensor in want_weights.items():
        assert torch.equal(weights[name], tensor), name
    for name, state in want_adam.items():
        for key, value in state.items():
            assert torch.equal(adam[name][key], value), (name, key)


@pytest.fixture(scope="module")
def straight(tiny_model_dir, batches, tmp_path_factory):
    """Five steps with checkpoint_every = 3, as a trainer that is never stopped sees them."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    torch.manual_seed(0)
    trainer = _trainer(run_dir, tiny_model_dir, _config())
    try:
        done = _steps(trainer, range(1, STEPS + 1), batches)
        state = _state(trainer)
    finally:
        trainer.close()
    return run_dir, done, state


def _copy_run(straight, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(straight[0], run_dir)
    return run_dir


def test_steps_between_checkpoints_are_journaled_and_published(straight):
    run_dir, done, _ = straight
    assert checkpoint.complete_steps(run_dir) == [3]
    assert step_journal.journaled_steps(run_dir) == [4, 5]  # 1 and 2 went with the checkpoint of 3
    assert published_versions(run_dir / "weights") == [1, 2, 3, 4, 5]
    assert all(d.version == s for s, d in done.items())
    assert "checkpoint_s" in done[3].metrics and "journal_s" in done[4].metrics
    assert "checkpoint_s" not in done[4].metrics


def test_a_resume_trains_the_journaled_steps_again_to_the_very_same_state(straight, tiny_model_dir, tmp_path):
    run_dir = _copy_run(straight, tmp_path)
    torch.manual_seed(99)  # whatever the generator holds now, the checkpoint's is restored
    resumed = _trainer(run_dir, tiny_model_dir, _config(), resume=True)
    try:
        assert (resumed.step, resumed.resumed) == (5, True)
        _assert_same_state(_state(resumed), straight[2])
        compared, diff = resumed.publisher.compare(5)
        assert compared == len(straight[2][0]) and diff == 0.0
        assert resumed.ready().version == 5
    finally:
        resumed.close()


def test_the_orchestrators_account_of_a_journaled_step_is_the_step_done_the_trainer_sent(straight):
    run_dir, done, _ = straight
    for step in (3, 4, 5):
        got = step_journal.consumption_of(run_dir, step)
        want = done[step]
        assert (got.step, got.version, got.rollout_ids, got.loss, got.reward_mean) == \
               (want.step, want.version, want.rollout_ids, want.loss, want.reward_mean)
        assert unpack_f32(got.advantages).tolist() == unpack_f32(want.advantages).tolist()
    assert step_journal.consumption_of(run_dir, 2) is None  # neither checkpointed (kept) nor journaled


def test_a_version_lost_after_its_journal_entry_is_republished_with_the_same_weights(straight, tiny_model_dir,
                                                                                      tmp_path):
    run_dir = _copy_run(straight, tmp_path)
    shutil.rmtree(version_dir(run_dir / "weights", 5))  # the crash came between the entry and the publish
    resumed = _trainer(run_dir, tiny_model_dir, _config(), resume=True)
    try:
        assert resumed.step == 5
    finally:
        resumed.close()
    files = sorted(version_dir(run_dir / "weights", 5).glob("*.safetensors"))
    assert compare_with_files(straight[2][0], files) == (len(straight[2][0]), 0.0)


def test_a_stop_checkpoints_the_newest_step_and_the_resume_has_nothing_to_train(straight, tiny_model_dir,
                                                                                 tmp_path, batches):
    run_dir = _copy_run(straight, tmp_path)
    trainer = _trainer(run_dir, tiny_model_dir, _config(), resume=True)
    try:
        trainer.checkpoint_journaled()
    finally:
        trainer.close()
    assert checkpoint.complete_steps(run_dir)[-1] == 5 and step_journal.journaled_steps(run_dir) == []
    resumed = _trainer(run_dir, tiny_model_dir, _config(), resume=True)
    try:
        assert resumed.step == 5
        _assert_same_state(_state(resumed), straight[2])
        _steps(resumed, [6], batches)  # and it goes on: 6 is the next k-th step
        assert checkpoint.complete_steps(run_dir)[-1] == 6
    finally:
        resumed.close()


def test_a_journal_without_a_checkpoint_trains_again_from_the_base_model(tiny_model_dir, batches, tmp_path):
    torch.manual_seed(0)
    first = _trainer(tmp_path / "a", tiny_model_dir, _config())
    try:
        _steps(first, [1, 2], batches)
        want = _state(first)
    finally:
        first.close()
    assert checkpoint.complete_steps(tmp_path / "a") == [] and step_journal.journaled_steps(tmp_path / "a") == [1, 2]
    with pytest.raises(RuntimeError, match="start with --resume"):
        _trainer(tmp_path / "a", tiny_model_dir, _config())
    resumed = _trainer(tmp_path / "a", tiny_model_dir, _config(), resume=True)
    try:
        assert resumed.step == 2
        _assert_same_state(_state(resumed), want)
    finally:
        resumed.close()


def test_a_gap_in_the_journal_is_refused_naming_the_missing_step(straight, tiny_model_dir, tmp_path):
    run_dir = _copy_run(straight, tmp_path)
    step_journal.step_path(run_dir, 4).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="not step 4"):
        _trainer(run_dir, tiny_model_dir, _config(), resume=True)


def test_a_torn_journal_entry_is_refused_naming_its_file(straight, tiny_model_dir, tmp_path):
    run_dir = _copy_run(straight, tmp_path)
    path = step_journal.step_path(run_dir, 5)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match=str(path)):
        _trainer(run_dir, tiny_model_dir, _config(), resume=True)


@pytest.mark.parametrize(("fields", "message"), [
    ({"checkpoint_every": 0}, "must be >= 1"),
    ({"checkpoint_every": 3, "publish_every": 2}, "multiple of trainer.publish_every"),
    ({"checkpoint_every": 2, "world_size": 2}, "one trainer process"),
])
def test_checkpoint_every_mistakes_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message) as caught:
        TrainerConfig(**fields).validate()
    assert caught.value.field == "trainer.checkpoint_every"


def test_a_lora_run_with_dropout_replays_its_journal_to_the_same_adapter(tiny_model_dir, batches, tmp_path):
    """LoRA dropout draws from the torch generator: the checkpoint restores it, and the steps
    trained again draw what they drew the first time (the adapter and Adam state equal, and
    equal to the published adapter of the last step)."""
    from orchestrator.config.run import LoraConfig
    from orchestrator.trainer import lora

    config = RunConfig(trainer=TrainerConfig(threads=1, checkpoint_every=2, lora=LoraConfig(
        rank=4, alpha=8.0, dropout=0.1, target_modules=["q_proj", "v_proj"])),
        transport=TransportConfig(keep_last=8)).validate()
    torch.manual_seed(0)
    first = _trainer(tmp_path / "run", tiny_model_dir, config)
    try:
        _steps(first, [1, 2, 3], batches)
        want, want_adam = lora.adapter_state(first.model), _state(first)[1]
    finally:
        first.close()
    assert checkpoint.complete_steps(tmp_path / "run") == [2] and step_journal.journaled_steps(tmp_path / "run") == [3]
    torch.manual_seed(7)
    resumed = _trainer(tmp_path / "run", tiny_model_dir, config, resume=True)
    try:
        assert resumed.step == 3
        got = lora.adapter_state(resumed.model)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        _assert_same_state((_state(resumed)[0], _state(resumed)[1]), (_state(resumed)[0], want_adam))
        compared, diff = resumed.publisher.compare(3)
        assert compared == len(want) and diff == 0.0
    finally:
        resumed.close()


def test_a_resume_at_a_journaled_step_that_published_nothing_names_the_newest_published_version(
        tiny_model_dir, batches, tmp_path):
    """publish_every = 2, checkpoint_every = 4: step 5 is journaled and publishes nothing; the
    resumed trainer stands at step 5 and tells the orchestrator that version 4 is the newest
    (the one its engines must serve), and does not publish 5."""
    config = _config(checkpoint_every=4, publish_every=2)
    first = _trainer(tmp_path / "run", tiny_model_dir, config)
    try:
        done = _steps(first, range(1, 6), batches)
    finally:
        first.close()
    assert [d.version for d in done.values()] == [None, 2, None, 4, None]
    assert step_journal.journaled_steps(tmp_path / "run") == [5]
    assert step_journal.consumption_of(tmp_path / "run", 5).version is None
    resumed = _trainer(tmp_path / "run", tiny_model_dir, config, resume=True)
    try:
        assert resumed.step == 5 and resumed.ready().version == 4
        resumed.checkpoint_journaled()  # a stop: a checkpoint stands for a published version only
    finally:
        resumed.close()
    assert published_versions(tmp_path / "run" / "weights") == [2, 4]
    assert checkpoint.complete_steps(tmp_path / "run") == [4]
