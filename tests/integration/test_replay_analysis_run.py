"""`inflight replay` on a real `inflight run` (vLLM CPU engine, real trainer, filesystem
transport, `recompute` KV policy with `pause_swap`, fp32 wire and serving).

One run is shared by every test (session scope): `interrupted_run` of tests/conftest.py, which
test_no_orphans also checks (it is stopped by a Ctrl-C after 5 steps). Its scheduler is set so
that rollouts cross activations (one step of staleness at most, few in flight, longer
completions): the log has multi-version spans. The checks: every token is reproduced by its
recorded version within 1e-3; a copy of the log whose spans are shifted by one token, and a copy
whose version files are swapped, fail loudly naming the first offending token; a pruned version
is skipped and reported; the JSON report has its keys.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from replay.log import FsyncPolicy, ReplayLog, read_records
from replay.records import RolloutRecord

pytestmark = [pytest.mark.engine, pytest.mark.slow]
INFLIGHT = [sys.executable, "-m", "orchestrator.commands.cli"]


@pytest.fixture(scope="session")
def replay_run(interrupted_run) -> Path:
    return interrupted_run.run_dir


def replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(INFLIGHT + ["replay", *map(str, args)], check=False, capture_output=True, text=True, timeout=300)


def copy_run(run_dir: Path, dest: Path, transform=None) -> Path:
    shutil.copytree(run_dir / "weights", dest / "weights")
    shutil.copy(run_dir / "config.json", dest / "config.json")
    with ReplayLog.open(dest, fsync=FsyncPolicy.every(1000)) as log:
        for record in read_records(run_dir):
            log.append(transform(record) if transform else record)
    return dest


def rollouts(run_dir: Path) -> list[RolloutRecord]:
    return [r for r in read_records(run_dir) if isinstance(r, RolloutRecord) and r.num_completion_tokens]


@pytest.mark.timeout(900)
def test_verify_spans_passes_on_a_recompute_run(replay_run):
    result = replay(replay_run, "--verify-spans", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    records = rollouts(replay_run)
    tokens = sum(r.num_completion_tokens for r in records)
    verify = report["verify_spans"]
    assert verify["passed"] and verify["tokens"] == verify["checked_tokens"] == tokens
    assert report["verify_spans_max_abs_diff"] <= 1e-3
    assert report["skipped_versions"] == []
    assert report["log"]["kv_policies"] == ["recompute"]
    # the run had version spans that cross activations, and each was verified token by token
    assert any(len(r.change_points()) > 1 for r in records)
    assert {row["lag"] for row in verify["by_lag"]} >= {0, 1}
    # JSON keys, lags counted from the newest activated version
    assert report["target"]["version"] == report["log"]["latest_version"] > 0
    for row in report["by_lag"]:
        assert isinstance(row["lag"], int) and row["lag"] >= 0
        for key in ("tokens", "kl_k3", "ratio_p50", "ratio_p99", "clip_fraction"):
            assert key in row
    lag0 = [row for row in report["by_lag"] if row["lag"] == 0]
    assert not lag0 or lag0[0]["kl_k3"] < 1e-5
    # the trainer's own lag-0 mismatch (fp32 trainer and engine) is tiny
    assert report["trainer_mismatch"]["lag0_log_ratio_max_abs"] < 1e-3


def _shift(record):
    """Change points one token later; the first token claims the previous version."""
    if not isinstance(record, RolloutRecord) or not record.num_completion_tokens:
        return record
    versions = record.expand_versions()
    if versions[0] == 0:
        return record
    shifted = np.concatenate([[versions[0] - 1], versions[:-1]])
    return msgspec.structs.replace(record, dispatched_version=int(shifted[0]),
                                   **_change_blobs(shifted))


def _change_blobs(versions: np.ndarray) -> dict[str, bytes]:
    starts = [0] + [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
    return {"version_starts": np.array(starts, "<i4").tobytes(),
            "version_values": np.array([versions[i] for i in starts], "<i4").tobytes()}


@pytest.mark.timeout(900)
def test_verify_spans_fails_on_shifted_spans(replay_run, tmp_path):
    copy = copy_run(replay_run, tmp_path / "shifted", _shift)
    result = replay(copy, "--verify-spans", "--json")
    assert result.returncode == 1, result.stderr
    failure = json.loads(result.stdout)["verify_spans"]["first_failure"]
    assert failure["abs_diff"] > 1e-3
    message = f"rollout {failure['rollout_id']} token {failure['position']} (version {failure['version']})"
    assert message in result.stderr


@pytest.mark.timeout(900)
def test_verify_spans_fails_on_swapped_version_files(replay_run, tmp_path):
    copy = copy_run(replay_run, tmp_path / "swapped")
    weights = copy / "weights"
    a, b = weights / "v00000001", weights / "v00000002"
    a.rename(weights / "tmp")
    b.rename(a)
    (weights / "tmp").rename(b)
    result = replay(copy, "--verify-spans", "--json")
    assert result.returncode == 1, result.stderr
    failure = json.loads(result.stdout)["verify_spans"]["first_failure"]
    assert failure["version"] in (1, 2)
    assert "verify-spans failed" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(900)
def test_pruned_version_is_reported_and_the_rest_analysed(replay_run, tmp_path):
    copy = copy_run(replay_run, tmp_path / "pruned")
    shutil.rmtree(copy / "weights" / "v00000001")
    plots = tmp_path / "plots"
    result = replay(copy, "--verify-spans", "--json", "--plots", plots)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["skipped_versions"] == [1]
    expected = sum(int((r.expand_versions() == 1).sum()) for r in rollouts(replay_run))
    assert report["skipped"][0]["tokens"] == expected > 0
    assert report["verify_spans"]["passed"]
    assert report["by_lag"] and (plots / "report.html").is_file()
