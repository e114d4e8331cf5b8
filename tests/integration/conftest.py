"""Session fixtures of the integration tests that cost an `inflight run`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def replay_run(tmp_path_factory, rl_model) -> Path:
    """One finished `inflight run` of 5 steps, shared read-only. Its scheduler is set so that
    rollouts cross activations (one step of staleness at most, few in flight, longer completions):
    the replay tests (test_replay_analysis_run) analyse its multi-version spans; the misuse test
    (test_run_misuse) resumes a copy of it as a finished run."""
    root = tmp_path_factory.mktemp("replay-run")
    config = root / "config.toml"
    config.write_text(f"""
[engine]
model = "{rl_model}"
[run]
progress = "none"
tensorboard = false
[http]
enabled = false
[scheduler]
group_size = 4
batch_groups = 4
max_off_policy_steps = 1
max_inflight = 16
[sampling]
max_tokens = 64
""")
    run_dir = root / "run"
    log = root / "run.log"
    with log.open("w") as out:
        result = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(config), "--run-dir", str(run_dir),
                                 "--max-steps", "5"], check=False, stdout=out, stderr=subprocess.STDOUT, timeout=600,
                                start_new_session=True)
    assert result.returncode == 0, log.read_text()[-4000:]
    return run_dir

