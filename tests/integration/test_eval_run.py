"""Evaluation never holds training (issue #30 item 6): `[eval] every_steps = 1` on the tiny
default, a real engine and trainer. Versions go live while evaluations run, every eval record
names the versions its tokens came from, the trainer's wait for each batch is recorded, and
`inflight eval` on the finished run still evaluates one version.

The trainer's waits with evaluation on and off are a measurement, not asserted here (times on a
loaded CPU): docs/tasks.md#5-evaluation gives the figures.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from replay.records import ActivationRecord, EvalRecord
from tests.helpers import attach_to
from tests.integration.test_run import INFLIGHT, check_log_invariants, finish, kill_group, start, stats_json

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STEPS = 8


@pytest.mark.timeout(900)
def test_evaluations_run_beside_activations_and_name_their_versions(tmp_path, rl_model, run_server):
    config = tmp_path / "run.toml"
    config.write_text(f"""
[engine]
model = "{rl_model}"
{attach_to(run_server)}
[run]
progress = "plain"
tensorboard = false
[http]
enabled = false
[eval]
every_steps = 1
max_prompts = 8   # 32 samples, eval.max_inflight 16 at a time, queued behind 256 training rollouts
""")
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    proc = start([str(config), "--run-dir", str(run_dir), "--max-steps", str(STEPS)], log)
    try:
        finish(proc, log, timeout=800)
    finally:
        kill_group(proc)
    records = check_log_invariants(run_dir, STEPS)
    evals = [r for r in records if isinstance(r, EvalRecord)]
    activations = [a for a in records if isinstance(a, ActivationRecord) and a.outcome == "activated"]
    # Measured: the first (v0, at_start) takes about 28 s beside training, the run's 8 steps about as
    # long; later ones may be cut by the stop (an unfinished evaluation writes no record).
    assert evals and evals[0].due_version == 0, [(e.due_version, e.versions) for e in evals]

    for e in evals:
        per_sample = [v for p in e.results for v in p.versions]
        assert all(p.errored == 0 and len(p.versions) == len(p.rewards) == e.k for p in e.results), e.results
        # The record names every version its scored samples' tokens came from, and only those.
        assert e.versions == sorted({v for vs in per_sample for v in vs}) and e.version in e.versions
        assert e.mixed == sum(len(vs) > 1 for vs in per_sample)
        # No token older than the version live when it began.
        assert e.versions[0] >= e.due_version
        assert e.started_at is not None and e.at is not None and e.started_at < e.at
    # Evaluations run one after another: the next begins at a live version at least as new as
    # any that sampled a token of the one before (a version is live before it samples).
    for before, after in zip(evals, evals[1:]):
        assert after.due_version >= before.versions[-1]

    # A version went live while an evaluation ran (no activation waits for one) ...
    assert any(e.started_at < a.activated_at < e.at for e in evals for a in activations), (
        [(e.started_at, e.at) for e in evals], [(a.version, a.activated_at) for a in activations])
    # ... and the labels say so: some evaluation's tokens came from a version that went live after it began.
    assert any(e.versions[-1] > e.due_version for e in evals), [(e.due_version, e.versions) for e in evals]

    stats = stats_json(run_dir)
    assert [(x["version"], x["versions"], x["mixed"], x["due_version"]) for x in stats["eval"]] == [
        (e.version, e.versions, e.mixed, e.due_version) for e in evals]
    # The trainer's wait for every batch but its first is recorded.
    waits = {row["step"]: row.get("trainer_wait_s") for row in stats["per_step"]}
    assert all(waits[s] is not None and waits[s] >= 0 for s in range(2, STEPS + 1)), waits
    assert stats["trainer_wait_s"]["count"] == STEPS - 1

    # `inflight eval` on the finished run: one version, no activation, so every token is that version's.
    out = subprocess.run(INFLIGHT + ["eval", str(run_dir), "--version", "latest", "--json", "-k", "2",
                                     "--max-prompts", "4"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    offline = json.loads(out.stdout.strip().splitlines()[-1])
    assert offline["version"] == STEPS and offline["versions"] == [STEPS] and offline["mixed"] == 0
    assert offline["k"] == 2 and offline["prompts"] == 4
