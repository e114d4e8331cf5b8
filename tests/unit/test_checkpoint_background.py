"""Background checkpoints (`trainer.checkpoint_background`, the default for one trainer process):
every step journaled, each due checkpoint a snapshot written by a writer thread while the next
step trains. What must hold: training is bit for bit what synchronous checkpoints give, and so
is the checkpoint; a stop leaves a checkpoint of the newest step; a crash while the writer is
behind (a write hanging, later checkpoints skipped) resumes to the very same state by training
the journal again; after `checkpoint_max_skips` skips the next checkpoint waits for the writer
(bounded by step_timeout_s) and is written; a torn write is ignored; a failed write fails the
next step by name."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file

from orchestrator.config.run import RunConfig, TrainerConfig, TransportConfig
from orchestrator.errors import ConfigError
from orchestrator.trainer import checkpoint, checkpoint_background, step_journal
from tests.unit.test_step_journal import _assert_same_state, _state, _steps, batches  # noqa: F401 - fixture
from tests.unit.test_trainer_lora import _trainer

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

STEPS = 5


def _config(**trainer) -> RunConfig:
    return RunConfig(trainer=TrainerConfig(threads=1, **trainer), transport=TransportConfig(keep_last=8)).validate()


def test_background_is_the_default_for_one_process_and_off_under_torchrun():
    assert TrainerConfig().background_checkpoints and TrainerConfig().journaled
    assert not TrainerConfig(world_size=2).background_checkpoints
    assert not TrainerConfig(torchrun_args=["--nnodes=1"]).background_checkpoints
    assert not TrainerConfig(checkpoint=False).background_checkpoints and not TrainerConfig(checkpoint=False).journaled
    assert not TrainerConfig(checkpoint_background=False).journaled
    with pytest.raises(ConfigError, match="one trainer process") as caught:
        TrainerConfig(checkpoint_background=True, world_size=2).validate()
    assert caught.value.field == "trainer.checkpoint_background"


@pytest.fixture(scope="module")
def synchronous(tiny_model_dir, batches, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """Five steps with a checkpoint written before each publish (the old way)."""
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    torch.manual_seed(0)
    trainer = _trainer(run_dir, tiny_model_dir, _config(checkpoint_background=False))
    try:
        _steps(trainer, range(1, STEPS + 1), batches)
        return run_dir, _state(trainer)
    finally:
        trainer.close()


def test_background_checkpoints_train_and_write_exactly_what_synchronous_ones_do(
        synchronous, tiny_model_dir, batches, tmp_path):  # noqa: F811
    torch.manual_seed(0)
    trainer = _trainer(tmp_path / "run", tiny_model_dir, _config())
    try:
        done = _steps(trainer, range(1, STEPS + 1), batches)
        state = _state(trainer)
        trainer.checkpoint_journaled()  # what a Stop does: the write under way first, then the newest step
    finally:
        trainer.close()
    _assert_same_state(state, synchronous[1])
    # Every step journaled; each one's checkpoint either handed to the writer or skipped while it was busy.
    assert all("journal_s" in d.metrics for d in done.values())
    assert all(("checkpoint_s" in d.metrics) != ("checkpoint_skipped" in d.metrics) for d in done.values())
    assert "checkpoint_s" in done[1].metrics
    assert checkpoint.complete_steps(tmp_path / "run")[-1] == STEPS
    assert step_journal.journaled_steps(tmp_path / "run") == []
    ours = checkpoint.checkpoint_dir(tmp_path / "run", STEPS)
    theirs = checkpoint.checkpoint_dir(synchronous[0], STEPS)
    want = load_file(theirs / checkpoint.MODEL_FILE)
    got = load_file(ours / checkpoint.MODEL_FILE)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ours_opt = torch.load(ours / checkpoint.OPTIMIZER_FILE, weights_only=True)
    theirs_opt = torch.load(theirs / checkpoint.OPTIMIZER_FILE, weights_only=True)
    assert torch.equal(ours_opt["torch_rng"], theirs_opt["torch_rng"])
    for index, slots in theirs_opt["optimizer"]["state"].items():
        for key, value in slots.items():
            assert torch.equal(ours_opt["optimizer"]["state"][index][key], value), (index, key)


class _HangingWrites:
    """A fault: the writer's write of every step after `free_upto` hangs until released."""

    def __init__(self, monkeypatch, free_upto: int) -> None:
        self.release = threading.Event()
        self.free_upto = free_upto
        real = checkpoint_background.write

        def write(run_dir, snapshot, keep):
            if snapshot.meta.step > self.free_upto:
                self.release.wait(60)
            return real(run_dir, snapshot, keep)

        monkeypatch.setattr(checkpoint_background, "write", write)


def test_a_crash_while_the_writer_is_behind_resumes_to_the_very_same_state(
        synchronous, tiny_model_dir, batches, tmp_path, monkeypatch):  # noqa: F811
    hanging = _HangingWrites(monkeypatch, free_upto=1)
    torch.manual_seed(0)
    trainer = _trainer(tmp_path / "run", tiny_model_dir, _config(checkpoint_max_skips=3))
    try:
        done = _steps(trainer, [1], batches)
        trainer.writer.collect(timeout_s=None)  # step 1's checkpoint is in place
        done |= _steps(trainer, range(2, STEPS + 1), batches)  # 2's write hangs: 3-5 are skipped
        assert [s for s, d in done.items() if "checkpoint_skipped" in d.metrics] == [3, 4, 5]
        crashed = tmp_path / "crashed"
        shutil.copytree(tmp_path / "run", crashed)  # the disk as a crash now would leave it
    finally:
        hanging.release.set()
        trainer.close()
    assert checkpoint.complete_steps(crashed) == [1]
    assert step_journal.journaled_steps(crashed) == [2, 3, 4, 5]
    torn = checkpoint.checkpoints_root(crashed) / f".tmp-{checkpoint.checkpoint_dir(crashed, 2).name}"
    torn.mkdir()
    (torn / checkpoint.MODEL_FILE).write_bytes(b"\0" * 100)  # the write of 2, cut short
    torch.manual_seed(99)
    resumed = _trainer(crashed, tiny_model_dir, _config(), resume=True)
    try:
        assert (resumed.step, resumed.ready().version) == (STEPS, STEPS)
        _assert_same_state(_state(resumed), synchronous[1])
        assert resumed.publisher.compare(STEPS) == (len(synchronous[1][0]), 0.0)
    finally:
        resumed.close()


def test_after_k_skipped_checkpoints_the_next_waits_for_the_writer_and_is_written(
        tiny_model_dir, batches, tmp_path, monkeypatch):  # noqa: F811
    """trainer.checkpoint_max_skips = 2: with 2's write hanging, 3 and 4 are skipped and 5 waits
    for it (released once it waits), then is written: the journal a resume would
    train again never grows past the bound."""
    hanging = _HangingWrites(monkeypatch, free_upto=1)
    trainer = _trainer(tmp_path / "run", tiny_model_dir, _config(checkpoint_max_skips=2))
    try:
        done = _steps(trainer, range(1, 5), batches)
        assert [s for s, d in done.items() if "checkpoint_skipped" in d.metrics] == [3, 4]
        real_wait, waited = trainer._wait_for_writer, []

        def wait():  # the write is released once the trainer waits for it (no timing involved)
            waited.append(trainer.writer.busy)
            hanging.release.set()
            return real_wait()

        monkeypatch.setattr(trainer, "_wait_for_writer", wait)
        done |= _steps(trainer, [5], batches)
        assert waited == [True]
        assert "checkpoint_wait_s" in done[5].metrics and "checkpoint_s" in done[5].metrics
        assert done[5].metrics["checkpoint_written_step"] == 2.0  # the write it waited for
        trainer.writer.collect(timeout_s=None)
    finally:
        hanging.release.set()
        trainer.close()
    assert checkpoint.complete_steps(tmp_path / "run")[-1] == 5
    assert step_journal.journaled_steps(tmp_path / "run") == []


def test_a_write_that_outlasts_the_step_timeout_after_k_skips_fails_the_step_by_name(
        tiny_model_dir, batches, tmp_path, monkeypatch):  # noqa: F811
    hanging = _HangingWrites(monkeypatch, free_upto=1)
    trainer = _trainer(tmp_path / "run", tiny_model_dir, _config(checkpoint_max_skips=0, step_timeout_s=0.2))
    try:
        _steps(trainer, [1], batches)
        trainer.writer.collect(timeout_s=None)
        _steps(trainer, [2], batches)  # its write hangs
        with pytest.raises(checkpoint.CheckpointError, match="trainer.checkpoint_max_skips"):
            _steps(trainer, [3], batches)
    finally:
        hanging.release.set()
        trainer.close()
    assert step_journal.journaled_steps(tmp_path / "run")[-1] == 3  # step 3 stays durable in its entry


def test_a_failed_background_write_fails_the_next_step_naming_the_checkpoint(
        tiny_model_dir, batches, tmp_path, monkeypatch):  # noqa: F811
    def full_disk(run_dir, snapshot, keep):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_background, "write", full_disk)
    trainer = _trainer(tmp_path / "run", tiny_model_dir, _config())
    try:
        _steps(trainer, [1], batches)
        while trainer.writer.busy:
            threading.Event().wait(0.01)
        with pytest.raises(checkpoint.CheckpointError, match="background checkpoint of step 1 failed: OSError"):
            _steps(trainer, [2], batches)
    finally:
        trainer.close()
    assert step_journal.journaled_steps(tmp_path / "run") == [1]  # step 1 stays durable in its entry
