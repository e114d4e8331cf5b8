"""Exactly once across a trainer that dies right after it checkpointed a step (before its StepDone
reached the orchestrator): the step's batch is recorded consumed (the checkpoint's own account),
never also discarded, and --resume continues from it with every step consumed once."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from orchestrator.trainer.process import CRASH_AFTER_CHECKPOINT
from replay.log import read_records
from replay.records import ConsumptionRecord, DiscardRecord, RolloutRecord
from tests.integration.test_run import INFLIGHT, check_log_invariants, finish, kill_group, start, write_config

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


@pytest.mark.timeout(1200)
def test_a_trainer_dead_after_its_checkpoint_has_its_step_consumed_not_discarded(tmp_path, rl_model):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", rl_model, "[transport]\nkeep_last = 32\n")
    log = tmp_path / "out.log"
    os.environ[CRASH_AFTER_CHECKPOINT] = "3"
    try:
        proc = start([str(config), "--run-dir", str(run_dir), "--max-steps", "6"], log)
    finally:
        del os.environ[CRASH_AFTER_CHECKPOINT]
    try:
        code = proc.wait(900)
    finally:
        kill_group(proc)
    text = log.read_text()
    assert code == 2, text[-3000:]  # the run failed loudly, in one line
    errors = [line for line in text.splitlines() if line.startswith("inflight: error:")]
    assert len(errors) == 1 and "trainer" in errors[0], text[-3000:]
    records = list(read_records(run_dir))
    consumed, discarded = claims(records)
    step3 = [r for r in records if isinstance(r, ConsumptionRecord) and r.step == 3]
    assert len(step3) == 1 and len(step3[0].rollout_ids) == 64  # recovered from the checkpoint
    assert not set(consumed) & set(discarded), "a rollout both consumed and discarded"

    proc = start(["--run-dir", str(run_dir), "--resume", "--max-steps", "6"], tmp_path / "resume.log")
    try:
        finish(proc, tmp_path / "resume.log")
    finally:
        kill_group(proc)
    records = check_log_invariants(run_dir, 6)
    consumed, discarded = claims(records)
    assert all(len(steps) == 1 for steps in consumed.values())
    assert not set(consumed) & set(discarded), "a rollout both consumed and discarded"
    by_id = {r.rollout_id: r for r in records if isinstance(r, RolloutRecord)}
    assert all(by_id[rid].status_name == "completed" for rid in consumed)
    stats = subprocess.run(INFLIGHT + ["stats", str(run_dir), "--json"], capture_output=True, text=True, timeout=300)
    assert stats.returncode == 0 and json.loads(stats.stdout)["invalid_consumptions"] == 0
