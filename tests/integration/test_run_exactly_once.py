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
