"""A resumed trainer continues from the weights the engines served (orchestrator/trainer/restore.py):
replayed steps whose weights come out otherwise (forced here by the test hook
INFLIGHT_FAULT_REPLAY_PERTURB) give way to the published ones, bit for bit, so a checkpoint written
after the resume holds the published weights of its version; the replay reports its progress; the
ledger (orchestrator/trainer/ledger.py) names each version's weights once and refuses another set."""

from __future__ import annotations

import pytest
import torch

from orchestrator.trainer import checkpoint, ledger, restore, step_journal
from orchestrator.trainer.link import Replaying
from orchestrator.trainer.process import Trainer
from orchestrator.trainer.publish import compare_with_files
from tests.unit.test_step_journal import _assert_same_state, _config, _copy_run, _state, batches, straight  # noqa: F401
from transports.filesystem import version_dir

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)


def test_replayed_weights_that_differ_give_way_to_the_published_ones(straight, tiny_model_dir, tmp_path,  # noqa: F811
                                                                     monkeypatch):
    run_dir = _copy_run(straight, tmp_path)
    monkeypatch.setenv(restore.PERTURB_REPLAY, "0.001")
    progress: list[Replaying] = []
    resumed = Trainer(str(run_dir), str(tiny_model_dir), _config())
    try:
        resumed.start(True, progress=progress.append)
        assert [(p.step, p.index, p.total) for p in progress] == [(4, 1, 2), (5, 2, 2)]
        # Each replayed step was shifted after its update and set back to its published version:
        # weights and Adam state are those of the trainer that never stopped.
        _assert_same_state(_state(resumed), straight[2])
        assert resumed.publisher.compare(5) == (len(straight[2][0]), 0.0)
        resumed.checkpoint_journaled()  # a stop right after the resume checkpoints step 5
    finally:
        resumed.close()
    # That checkpoint holds what version 5 names: the published files, and the ledger's digest.
    saved = checkpoint.checkpoint_dir(run_dir, 5) / checkpoint.MODEL_FILE
    assert ledger.file_digest(saved)[0] == ledger.read(run_dir)[5]
    from safetensors.torch import load_file

    files = sorted(version_dir(run_dir / "weights", 5).glob("*.safetensors"))
    assert compare_with_files(load_file(str(saved)), files)[1] == 0.0


def test_a_lost_version_is_published_from_the_replayed_weights_unless_the_ledger_names_others(
        straight, tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """Version 5's files gone, the replayed weights different (the hook). If the ledger records
    version 5 (it was published, then its files removed), those weights are refused by name and
    nothing is published; if it does not (the crash came before the publish completed: no
    engine served 5), the replayed weights are version 5, published and recorded."""
    import shutil

    run_dir = _copy_run(straight, tmp_path)
    shutil.rmtree(version_dir(run_dir / "weights", 5))
    monkeypatch.setenv(restore.PERTURB_REPLAY, "0.001")
    refused = Trainer(str(run_dir), str(tiny_model_dir), _config())
    try:
        with pytest.raises(checkpoint.CheckpointError, match="version 5 was published with weights"):
            refused.start(True)
    finally:
        refused.close()
    assert not version_dir(run_dir / "weights", 5).exists()
    path = ledger.ledger_path(run_dir)
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines() if '"version": 5' not in line))
    resumed = Trainer(str(run_dir), str(tiny_model_dir), _config())
    try:
        resumed.start(True)
        assert resumed.publisher.compare(5)[1] == 0.0  # published from what it holds
        assert ledger.read(run_dir)[5] == ledger.model_digest(resumed.model)[0]
        assert not torch.equal(resumed.model.state_dict()["model.norm.weight"], straight[2][0]["model.norm.weight"])
    finally:
        resumed.close()


def test_the_ledger_names_every_published_version_once(straight):  # noqa: F811
    run_dir, done, state = straight
    recorded = ledger.read(run_dir)
    assert sorted(recorded) == [1, 2, 3, 4, 5]
    assert len(set(recorded.values())) == 5  # every step moved the weights
    saved = checkpoint.checkpoint_dir(run_dir, 3) / checkpoint.MODEL_FILE
    assert ledger.file_digest(saved)[0] == recorded[3]
    assert ledger.state_digest({n: t for n, t in state[0].items() if n != "lm_head.weight"}) == recorded[5] or \
        ledger.state_digest(state[0]) == recorded[5]
    assert not ledger.record(run_dir, 5, recorded[5], 1)  # the same weights again: nothing new
    with pytest.raises(checkpoint.CheckpointError, match="version 4 was published with weights"):
        ledger.record(run_dir, 4, recorded[5], 1)


def test_a_torn_ledger_line_is_ignored_and_never_glued_to_the_next(tmp_path):
    (tmp_path / "trainer").mkdir()
    ledger.record(tmp_path, 1, "a" * 64, 3)
    with open(ledger.ledger_path(tmp_path), "ab") as f:
        f.write(b'{"version": 2, "dig')  # the crash hit the write
    assert ledger.read(tmp_path) == {1: "a" * 64}
    assert ledger.record(tmp_path, 2, "b" * 64, 3)
    assert ledger.read(tmp_path) == {1: "a" * 64, 2: "b" * 64}
    assert step_journal.journaled_steps(tmp_path) == []  # the ledger is no journal entry
