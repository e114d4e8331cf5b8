"""Session fixtures of the integration tests that cost an `inflight run`."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import NamedTuple

import pytest


class CrashResumeRun(NamedTuple):
    """What `crash_resume_run` left: its directories, and the log as it was after each crash."""

    package_dir: Path  # the user's package, the runs' working directory
    config: Path
    run_dir: Path
    max_steps: int
    killed: list  # the records after the SIGKILL
    published_at_kill: dict[str, str]  # every complete version on disk then: name -> digest
    crash_step: int  # the step after whose checkpoint the resumed run's trainer died
    crash_code: int
    crash_output: str
    crashed: list  # the records after the trainer's death
    published_at_crash: dict[str, str]
    records: list  # the records at the end


@pytest.fixture(scope="session")
def crash_resume_run(tmp_path_factory, rl_model) -> CrashResumeRun:
    """One `inflight run` of a user's dataset task (test_user_task's package) that crashes twice
    and ends at its step count, shared by the resume tests of test_run (every invariant after a
    SIGKILL), test_user_task (the next dataset row) and test_run_exactly_once (a trainer dead
    after its checkpoint). One run instead of three: each costs the start-up of an engine and a
    trainer twice; the steps themselves are cheap.

    1. The run, SIGKILLed as a process group (orchestrator, trainer and engine processes at once)
       once its trainer's journal holds step 7, published (a step the resume trains again: its
       checkpoint falls at the next even step). The trainer holds after that step
       (INFLIGHT_FAULT_TRAINER_HOLD_AFTER_STEP): a poll that waited for the window between an odd
       step's publish and the next checkpoint missed every one of them once (CI, stop 38).
    2. --resume, its replayed weights forced to differ from the published ones (the test hook
       INFLIGHT_FAULT_REPLAY_PERTURB: the trainer must continue from the published weights,
       orchestrator/trainer/restore.py), with the trainer set to die right after it journaled (and published) the
       third or fourth step after the last one the first run consumed (the odd one: with
       trainer.checkpoint_every = 2 a journal entry, not a checkpoint), before its StepDone
       reaches the orchestrator: the run fails (exit 2).
    3. --resume to the step count."""
    from orchestrator.trainer.process import CRASH_AFTER_CHECKPOINT, HOLD_AFTER_STEP
    from orchestrator.trainer.restore import PERTURB_REPLAY
    from orchestrator.trainer.step_journal import journaled_steps
    from replay.log import read_records
    from replay.records import ConsumptionRecord
    from tests.integration.test_run import digest, finish, kill_group, wait_for
    from tests.integration.test_user_task import package, run_in

    root = tmp_path_factory.mktemp("crash-resume")
    # checkpoint_every = 2: the steps between checkpoints are journaled and trained again on
    # resume (orchestrator/trainer/step_journal.py), so every resume here goes through both.
    config = package(root, rl_model, extra="[transport]\nkeep_last = 32\n\n[trainer]\ncheckpoint_every = 2\n")
    run_dir, max_steps = root / "run", 16

    def steps_done() -> int:
        try:
            return sum(1 for r in read_records(run_dir) if isinstance(r, ConsumptionRecord))
        except Exception:  # noqa: BLE001 - the log is being written
            return 0

    def published() -> dict[str, str]:
        return {p.name: digest(p) for p in (run_dir / "weights").glob("v*") if (p / "COMPLETE").exists()}

    log = root / "out.log"
    held_step = 7
    os.environ[HOLD_AFTER_STEP] = str(held_step)
    try:
        proc = run_in(root, [str(config), "--run-dir", str(run_dir), "--max-steps", str(max_steps)], log)
    finally:
        del os.environ[HOLD_AFTER_STEP]
    try:
        # The odd step published too: killed between its journal entry and its publish, the resume
        # would have no published weights to compare its replay with (nothing then differs).
        wait_for(lambda: steps_done() >= 6 and held_step in journaled_steps(run_dir)
                 and (run_dir / "weights" / f"v{held_step:08d}" / "COMPLETE").exists(), 900, proc, log,
                 f"six steps consumed and step {held_step} journaled and published")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_group(proc)
    killed, published_at_kill = list(read_records(run_dir)), published()

    crash_step = max(r.step for r in killed if isinstance(r, ConsumptionRecord)) + 3
    crash_step += crash_step % 2 == 0  # a journaled step (odd): the last resume trains it again
    assert crash_step <= max_steps - 2, f"the first run went on to step {crash_step - 3} after its SIGKILL"
    log = root / "crash.log"
    os.environ[CRASH_AFTER_CHECKPOINT] = str(crash_step)
    os.environ[PERTURB_REPLAY] = "0.001"
    try:
        proc = run_in(root, ["--run-dir", str(run_dir), "--resume", "--max-steps", str(max_steps)], log)
    finally:
        del os.environ[CRASH_AFTER_CHECKPOINT], os.environ[PERTURB_REPLAY]
    try:
        crash_code = proc.wait(900)
    finally:
        kill_group(proc)
    crashed, published_at_crash = list(read_records(run_dir)), published()

    log = root / "resume.log"
    proc = run_in(root, ["--run-dir", str(run_dir), "--resume", "--max-steps", str(max_steps)], log)
    try:
        finish(proc, log)
    finally:
        kill_group(proc)
    return CrashResumeRun(root, config, run_dir, max_steps, killed, published_at_kill, crash_step, crash_code,
                          (root / "crash.log").read_text(), crashed, published_at_crash, list(read_records(run_dir)))
