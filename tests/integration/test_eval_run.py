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


# The eval's reward holds its sample's slot until a version past the base model is live, so the
# evaluation due at v0 spans an activation on any machine (before, it raced the first step: on a fast
# CI host it ended 1.1 s before v1 went live). Its next samples are sent only as these free their
# slots, so they sample a later version. A real log read while the run writes it, no fake.
EVAL_REWARD = """
import time

from replay.log import read_records
from replay.records import ActivationRecord

RUN_DIR = {run_dir!r}


def once_a_version_is_live(completion, **row):
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if any(isinstance(r, ActivationRecord) and r.outcome == "activated"
                   for r in read_records(RUN_DIR, lenient=True)):
                return float(any(c.isdigit() for c in completion))
        except (OSError, ValueError):  # the log's first segment not written yet
            pass
        time.sleep(0.2)
    raise TimeoutError("no version went live within 240 s")
"""


@pytest.mark.timeout(900)
def test_evaluations_run_beside_activations_and_name_their_versions(tmp_path, rl_model, run_server):
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    (tmp_path / "eval_waits.py").write_text(EVAL_REWARD.format(run_dir=str(run_dir)))
    (tmp_path / "held_out.jsonl").write_text("".join(
        '{"prompt": "Write the digits of %d.", "answer": "%d"}\n' % (n, n) for n in (7, 42, 365, 2026)))
    config = tmp_path / "run.toml"
    config.write_text(f"""
[engine]
model = "{rl_model}"
{attach_to(run_server)}
[task]
score_timeout_s = 300   # the eval's reward waits for the first activation
[run]
progress = "plain"
tensorboard = false
[http]
enabled = false
[eval]
every_steps = 1
dataset = "{tmp_path / 'held_out.jsonl'}"
rewards = [{{ fn = "eval_waits:once_a_version_is_live" }}]
max_prompts = 4
samples_per_prompt = 4   # 16 samples, 8 at a time, beside 256 training rollouts
max_inflight = 8
""")
    proc = start([str(config), "--run-dir", str(run_dir), "--max-steps", str(STEPS)], log)
    try:
        finish(proc, log, timeout=800)
    finally:
        kill_group(proc)
    records = check_log_invariants(run_dir, STEPS)
    evals = [r for r in records if isinstance(r, EvalRecord)]
    activations = [a for a in records if isinstance(a, ActivationRecord) and a.outcome == "activated"]
    # Later evaluations may be cut by the stop (an unfinished evaluation writes no record).
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
    assert offline["task"] == "held_out"
