"""`inflight export-model` says plainly when the weights it exports are not ones an engine served
under their version (orchestrator/commands/export_served.py): a version the replay log records no
activation of, a checkpoint whose weights are not those its version was published with (the
trainer's ledger), or, without a log or a ledger line, that it is not known."""

from __future__ import annotations

import time

import pytest

from orchestrator.commands.cli import main
from orchestrator.commands.export_model import export_model
from orchestrator.trainer import checkpoint, ledger
from tests.unit.test_export_model import make_run

pytestmark = pytest.mark.timeout(300)


def _activate(root, versions) -> None:
    from replay.log import ReplayLog
    from replay.records import ActivationRecord

    with ReplayLog.open(root) as log:
        for v in versions:
            log.append(ActivationRecord(version=v, outcome="activated", engines=[], activated_at=time.time()))


def _ledger_from_checkpoints(root, versions) -> None:
    for v in versions:
        digest, n = ledger.file_digest(checkpoint.checkpoint_dir(root, v) / checkpoint.MODEL_FILE)
        ledger.record(root, v, digest, n)


@pytest.fixture(scope="module")
def served_run(tmp_path_factory, tiny_model_dir):
    """Three versions (v1 only in its checkpoint: keep_last = 2), 1 and 2 activated, 3 not."""
    root = tmp_path_factory.mktemp("served") / "run"
    make_run(root, tiny_model_dir)
    _activate(root, [1, 2])
    return root


def test_a_served_checkpoint_whose_weights_the_ledger_names_exports_without_a_note(served_run, tmp_path):
    _ledger_from_checkpoints(served_run, [1])
    result = export_model(served_run, 1, out_dir=tmp_path / "out")
    assert (result.source, result.served, result.note) == ("checkpoint", True, "")
    assert "| served by engines | yes |" in (result.path / "README.md").read_text()


def test_a_checkpoint_holding_other_weights_than_its_version_was_published_with_is_named(served_run, tmp_path):
    path = ledger.ledger_path(served_run)
    saved = path.read_bytes() if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"version": 1, "digest": "' + "f" * 64 + '", "tensors": 1}\n')
    try:
        result = export_model(served_run, 1, out_dir=tmp_path / "out")
    finally:
        path.unlink()
        if saved is not None:
            path.write_bytes(saved)
    assert result.served is False
    assert "holds weights no engine served" in result.note and "versions the engines served: 1-2" in result.note
    assert "NO: " in (result.path / "README.md").read_text()


def test_a_checkpoint_the_ledger_does_not_record_is_not_known(served_run, tmp_path):
    (ledger.ledger_path(served_run)).unlink(missing_ok=True)
    result = export_model(served_run, 1, out_dir=tmp_path / "out")
    assert result.served is None and "is not known" in result.note


def test_a_published_version_never_activated_is_exported_with_a_plain_warning(served_run, tmp_path, capsys):
    code = main(["export-model", str(served_run), "--version", "latest", str(tmp_path / "out")])
    assert code == 0
    err = capsys.readouterr().err
    assert "inflight: warning: no engine served version 3" in err and "versions the engines served: 1-2" in err


def test_without_a_replay_log_whether_a_version_was_served_is_not_known(tmp_path, tiny_model_dir):
    root = tmp_path / "run"
    make_run(root, tiny_model_dir, log=False)
    result = export_model(root, 3, out_dir=tmp_path / "out")
    assert result.served is None and "no replay log" in result.note
