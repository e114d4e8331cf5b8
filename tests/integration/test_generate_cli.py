"""`inflight generate`, the user's smoke test, run as a real subprocess on a real engine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

# The light lane (tests/lanes.py): no bound of seconds; each call starts an engine on the CPU the
# main lane leaves.
pytestmark = [pytest.mark.engine, pytest.mark.light_lane, pytest.mark.timeout(1200)]


def inflight(*args: str, timeout: float = 800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_prints_tokens_logprobs_and_versions(tiny_model_dir):
    result = inflight("generate", "--model", str(tiny_model_dir), "--prompt", "hello", "-n", "3",
                      "--max-tokens", "5", "--seed", "1", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 3
    for row in rows:
        assert len(row["token_ids"]) == len(row["logprobs"]) == len(row["versions"]) == 5
        assert all(lp <= 0.0 for lp in row["logprobs"])
        assert row["versions"] == [0] * 5


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "/nonexistent/model", "--prompt", "x"], "/nonexistent/model"),
        (["--prompt", "x", "--temperature", "-0.5"], "sampling.temperature"),
        (["--prompt", "x", "--max-tokens", "0"], "sampling.max_tokens"),
        (["--prompt", "x", "-n", "0"], "-n"),
    ],
)
def test_bad_input_is_named_and_exits_non_zero(tiny_model_dir, args, needle):
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    result = inflight("generate", *args, timeout=600)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_directory_without_weights_is_named(tiny_model_dir, tmp_path):
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").unlink()
    result = inflight("generate", "--model", str(broken), "--prompt", "x", timeout=600)
    assert result.returncode == 2
    assert "no weight files" in result.stderr and str(broken) in result.stderr
