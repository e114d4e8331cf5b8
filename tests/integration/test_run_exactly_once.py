"""Exactly once across a trainer that dies right after it checkpointed a step (before its StepDone
reached the orchestrator): the step's batch is recorded consumed (the checkpoint's own account),
never also discarded, and --resume continues from it with every step consumed once."""

from __future__ import annotations

import json
import subprocess

import pytest

from replay.records import ConsumptionRecord, DiscardRecord, RolloutRecord
from tests.integration.test_run import INFLIGHT, check_log_invariants

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def claims(records) -> tuple[dict[int, list[int]], dict[int, list[str]]]:
    consumed: dict[int, list[int]] = {}
    discarded: dict[int, list[str]] = {}
    for r in records:
        if isinstance(r, ConsumptionRecord):
            for rid in r.rollout_ids:
                consumed.setdefault(rid, []).append(r.step)
        elif isinstance(r, DiscardRecord):
            for rid in r.rollout_ids:
                discarded.setdefault(rid, []).append(r.reason)
    return consumed, discarded


@pytest.mark.timeout(1500)
def test_a_trainer_dead_after_journaling_a_step_has_it_consumed_not_discarded(crash_resume_run):
    """On the shared run of tests/integration/conftest.py: its second part (a resumed run) is
    started with the trainer set to die right after it journaled `crash_step`; the third
    resumes it to the step count."""
    run = crash_resume_run
    text = run.crash_output
    assert run.crash_code == 2, text[-3000:]  # the run failed loudly, in one line
    errors = [line for line in text.splitlines() if line.startswith("inflight: error:")]
    assert len(errors) == 1 and "trainer" in errors[0], text[-3000:]
    records = run.crashed
    consumed, discarded = claims(records)
    crashed_step = [r for r in records if isinstance(r, ConsumptionRecord) and r.step == run.crash_step]
    assert len(crashed_step) == 1 and len(crashed_step[0].rollout_ids) == 64  # recovered from its journal entry
    # The last resume trained the journaled step again from the checkpoint before it (the
    # trainer died before checkpointing anything newer), to the very weights it had published.
    events = [json.loads(line) for line in (run.run_dir / "trainer.log").read_text().splitlines()
              if line.startswith("{") and '"trainer.replayed"' in line]
    last = [e for e in events if run.crash_step in e["steps"]]
    assert last and last[-1]["compared_version"] == run.crash_step, events
    assert last[-1]["compared_tensors"] > 0 and last[-1]["max_abs_diff"] == 0.0, last[-1]
    assert not set(consumed) & set(discarded), "a rollout both consumed and discarded"

    records = check_log_invariants(run.run_dir, run.max_steps)
    consumed, discarded = claims(records)
    assert all(len(steps) == 1 for steps in consumed.values())
    assert not set(consumed) & set(discarded), "a rollout both consumed and discarded"
    by_id = {r.rollout_id: r for r in records if isinstance(r, RolloutRecord)}
    assert all(by_id[rid].status_name == "completed" for rid in consumed)
    stats = subprocess.run(INFLIGHT + ["stats", str(run.run_dir), "--json"], capture_output=True, text=True, timeout=300)
    assert stats.returncode == 0 and json.loads(stats.stdout)["invalid_consumptions"] == 0


def _trainer_events(run_dir, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trainer.log").read_text().splitlines()
            if line.startswith("{") and f'"{name}"' in line]


@pytest.mark.timeout(1500)
def test_one_version_one_set_of_weights_across_a_resume_whose_replay_differs(crash_resume_run, tmp_path):
    """The resume after the SIGKILL trained its journaled steps again with their weights forced
    to differ (INFLIGHT_FAULT_REPLAY_PERTURB): the trainer continued from the published weights.
    From the records: every version number has one set of weights (the ledger's one line per
    version, the published files' bytes at each crash and at the end, each checkpoint left), every
    version the engines served is among them, and the exported latest version is what they served (the newest version they served; the last, published as the run stops
    and never activated, is exported with a plain warning)."""
    from safetensors.torch import load_file

    from orchestrator.commands.export_model import export_model
    from orchestrator.trainer import checkpoint, ledger
    from orchestrator.trainer.publish import compare_with_files
    from replay.records import ActivationRecord
    from tests.integration.test_run import digest

    run = crash_resume_run
    perturbed = _trainer_events(run.run_dir, "trainer.replay_perturbed")
    differs = _trainer_events(run.run_dir, "trainer.replay_differs")
    assert perturbed and differs, "the resume after the SIGKILL trained no published step again"
    assert all(e["max_abs_diff"] > 0 for e in differs)
    restored = [e for e in _trainer_events(run.run_dir, "trainer.replayed") if e["restored_published"]]
    assert len(restored) == 1 and restored[0]["restored_published"] == [e["version"] for e in differs]
    assert restored[0]["max_abs_diff"] > 0  # the last replayed step differed too, and gave way

    # One line per version in the ledger, each digest once (every step moves the weights).
    lines = [json.loads(line) for line in ledger.ledger_path(run.run_dir).read_text().splitlines() if line]
    versions = [line["version"] for line in lines]
    assert sorted(versions) == list(range(1, run.max_steps + 1)) and len(set(versions)) == len(versions)
    recorded = ledger.read(run.run_dir)
    assert len(set(recorded.values())) == len(recorded)
    # The published files of a version never changed: at the SIGKILL, at the trainer's death, at the end.
    final = {p.name: digest(p) for p in (run.run_dir / "weights").glob("v*") if (p / "COMPLETE").exists()}
    for name in set(run.published_at_kill) | set(run.published_at_crash) | set(final):
        seen = {d for d in (run.published_at_kill.get(name), run.published_at_crash.get(name), final.get(name)) if d}
        assert len(seen) == 1, f"{name} held two sets of weights"
    # Each checkpoint left holds what its version was published with, and what its files hold.
    for step in checkpoint.complete_steps(run.run_dir):
        saved = checkpoint.checkpoint_dir(run.run_dir, step) / checkpoint.MODEL_FILE
        assert ledger.file_digest(saved)[0] == recorded[step], step
        files = sorted((run.run_dir / "weights" / f"v{step:08d}").glob("*.safetensors"))
        if files:
            assert compare_with_files(load_file(str(saved)), files)[1] == 0.0, step
    served = {r.version for r in run.records if isinstance(r, ActivationRecord) and r.outcome == "activated"}
    assert served and served - {0} <= set(recorded)

    # The run's last version is published as it stops, never activated: the export says so.
    latest = export_model(run.run_dir, "latest", out_dir=tmp_path / "latest")
    newest_served = max(served)
    if latest.version not in served:
        assert latest.served is False and f"no engine served version {latest.version}" in latest.note
    # The newest version the engines served exports as exactly the weights they loaded.
    result = export_model(run.run_dir, newest_served, out_dir=tmp_path / "out")
    assert (result.source, result.served, result.note) == ("published", True, "")
    exported = {}
    for path in sorted(result.path.glob("*.safetensors")):
        exported.update(load_file(str(path)))
    files = sorted((run.run_dir / "weights" / f"v{newest_served:08d}").glob("*.safetensors"))
    compared, diff = compare_with_files(exported, files)
    assert compared == len(exported) and diff == 0.0
