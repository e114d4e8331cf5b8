"""`inflight run examples/lora.toml` end to end: the digits task trained with a LoRA adapter on
the frozen tiny-lora model, real vLLM engine, real trainer process. What issue #20 asks it to
show: the reward reaches 0.5 within 60 steps (seed 0); no activation pauses an engine; every
rollout has exactly one version, and its logprobs equal a transformers forward of base + that
version's adapter (checked with PEFT here and by `inflight replay --verify-spans`); a resume of
the finished run says so and starts nothing, `--max-steps` extends it (the misuse check of
test_run_misuse, on the run that is here anyway); export-model writes the adapter, and with --merge
the merged model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from replay.log import read_records
from replay.records import ActivationRecord, ConsumptionRecord, RolloutRecord, RunMetaRecord
from tests.integration.lora_helpers import reference_logprobs

# The light lane (tests/lanes.py): no bound of seconds, so the timeouts allow for a run that only gets
# the CPU the main lane leaves (its cpu cgroup holds the run's trainer and engine too).
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.light_lane, pytest.mark.timeout(2400)]
INFLIGHT = [sys.executable, "-m", "orchestrator.commands.cli"]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lora.toml"


def inflight(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(INFLIGHT + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, Path]:
    """The example as a user runs it, with its model built in a temporary directory."""
    from orchestrator.model import ensure_model

    root = tmp_path_factory.mktemp("lora-run")
    model = ensure_model(root / "tiny-lora", preset="tiny-lora", seed=0)
    text = EXAMPLE.read_text().replace('model = "models/tiny-lora"', f'model = "{model}"')
    assert str(model) in text, "examples/lora.toml names models/tiny-lora"
    config = root / "lora.toml"
    # appended to [run], the example's last table; 30 of its 60 steps (it passes 0.5 by about 17).
    # Every version's adapter is kept, so that the check below covers the run, not only the last
    # transport.keep_last versions (which of those sampled anything depends on timing: on CI only two did).
    # The trainer's start bounded as the light lane needs (on CI 120 s ran out beside the main lane).
    assert "[trainer]\n" in text
    text = text.replace("[trainer]\n", "[trainer]\nstart_timeout_s = 1200\n", 1)
    config.write_text(text + '\nprogress = "plain"\n\n[transport]\nkeep_last = 64\n')
    run_dir = root / "run"
    done = inflight("run", str(config), "--run-dir", str(run_dir), "--max-steps", "30")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir, model


def records(run_dir: Path, kind):
    return [r for r in read_records(run_dir) if isinstance(r, kind)]


def started_engines(run_dir: Path) -> int:
    lines = (run_dir / "orchestrator.jsonl").read_text().splitlines()
    return sum(json.loads(line).get("event") == "engine.starting" for line in lines if line.startswith("{"))


def test_the_digits_task_learns_with_a_lora_adapter_and_no_activation_pauses(lora_run):
    run_dir, _model = lora_run
    stats = json.loads(inflight("stats", str(run_dir), "--json").stdout)
    rewards = {s["step"]: s["reward_mean"] for s in stats["per_step"]}
    assert max(rewards) == 30
    reached = [s for s in sorted(rewards) if rewards[s] >= 0.5]
    assert reached and reached[0] <= 30, f"reward per step: {rewards}"  # the issue: within 60
    activations = records(run_dir, ActivationRecord)
    assert len(activations) >= 25 and all(a.outcome == "activated" for a in activations)
    assert all(a.strategy == "adapter" for a in activations)
    meta = next(r for r in read_records(run_dir) if isinstance(r, RunMetaRecord))  # what ran, not the file's default
    assert meta.config["activation"]["strategy"] == "adapter" and meta.config["activation"]["kv_policy"] == "drain"
    assert all(e["enable_lora"] and e["max_lora_rank"] == 16 for e in meta.config["engines_as_run"])
    assert all(e.pause_s == 0.0 for a in activations for e in a.engines), "an adapter activation paused an engine"
    rollouts = [r for r in records(run_dir, RolloutRecord) if r.status_name == "completed"]
    assert rollouts and all(r.identity.adapter and r.identity.adapter.startswith("lora r=16") for r in rollouts)
    assert all(len(r.change_points()) == 1 for r in rollouts if r.num_completion_tokens), \
        "every rollout samples under exactly one adapter"


def test_every_retained_version_samples_as_base_plus_its_adapter(lora_run):
    run_dir, model = lora_run
    rollouts = [r for r in records(run_dir, RolloutRecord) if r.status_name == "completed"]
    checked = set()
    for r in rollouts:
        version = r.dispatched_version
        adapter = run_dir / "weights" / f"v{version:08d}"
        if version in checked or not (adapter / "COMPLETE").exists():
            continue
        ref = reference_logprobs(model, adapter, r.prompt_tokens().tolist(), r.completion_tokens().tolist())
        err = max(abs(a - b) for a, b in zip(ref, r.logprobs().tolist()))
        assert err <= 1e-3, f"v{version}: max |engine - PEFT(base + adapter)| = {err}"
        checked.add(version)
    # every version is retained (keep_last = 64): most of the run's 30 versions sampled rollouts
    assert len(checked) >= 10, sorted(checked)
    verified = inflight("replay", str(run_dir), "--verify-spans", "--steps", "25:30", "--json")
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-2000:]
    report = json.loads(verified.stdout)["verify_spans"]
    assert report["passed"] and report["checked_tokens"] > 0 and report["checked_max_abs_diff"] <= 1e-3


def test_resume_continues_and_export_writes_the_adapter_and_the_merged_model(lora_run, tmp_path):
    run_dir, model = lora_run
    # A resume of the finished run exits 0 at once, says so and starts nothing (a user's slip)...
    assert started_engines(run_dir) == 1
    done = inflight("run", "--run-dir", str(run_dir), "--resume", "--max-steps", "30", timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "already reached step 30" in done.stdout
    assert started_engines(run_dir) == 1  # nothing started
    # ... and --max-steps extends it.
    resumed = inflight("run", "--run-dir", str(run_dir), "--resume", "--max-steps", "32")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    steps = records(run_dir, ConsumptionRecord)
    assert [c.step for c in steps] == list(range(1, 33))
    consumed = [rid for c in steps for rid in c.rollout_ids]
    rollouts = {r.rollout_id: r for r in records(run_dir, RolloutRecord)}
    assert len(consumed) == len(set(consumed)) and all(rollouts[rid].status_name == "completed" for rid in consumed)
    stats = json.loads(inflight("stats", str(run_dir), "--json").stdout)
    assert max(s["step"] for s in stats["per_step"]) == 32 and stats["invalid_consumptions"] == 0
    adapter = inflight("export-model", str(run_dir), "--version", "latest", str(tmp_path / "adapter"))
    assert adapter.returncode == 0, adapter.stderr[-2000:]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    merged = inflight("export-model", str(run_dir), "--version", "latest", "--merge", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr[-2000:]
    prompt, completion = [5, 17, 33, 9], [40, 41, 42]
    want = reference_logprobs(model, tmp_path / "adapter", prompt, completion)
    got = reference_logprobs(tmp_path / "merged", None, prompt, completion)
    assert max(abs(a - b) for a, b in zip(want, got)) <= 1e-4
