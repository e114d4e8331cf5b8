"""`inflight run` end to end: real vLLM CPU engines, the real trainer process, real files,
signals and sockets. Each test runs the command as a user would, in its own process group.

What is checked is what the issue asks the product to show: the policy learns the digits task
with the async pipeline in the loop (staleness > 0 observed) and `inflight stats` reports the
staleness the run really had (sync mode's staleness 0: on the sync-mode runs of
test_any_model); a SIGKILL then --resume keeps every invariant (on the run the resume tests
share: tests/integration/conftest.py); an engine killed mid-run errors its rollouts and the
other engine carries on; live /stats and /metrics agree with the log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from replay.log import read_records
from replay.records import ActivationRecord, ConsumptionRecord, RolloutRecord

pytestmark = [pytest.mark.engine, pytest.mark.slow]
INFLIGHT = [sys.executable, "-m", "orchestrator.commands.cli"]


def write_config(path: Path, model: Path, extra: str = "") -> Path:
    path.write_text(f"""
[engine]
model = "{model}"
[run]
progress = "plain"
[http]
port = 0
{extra}
""")
    return path


def start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(INFLIGHT + ["run"] + args, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def health(run_dir: Path) -> dict | None:
    try:
        url = json.loads((run_dir / "http.json").read_text())["url"]
        return json.loads(get(url + "/healthz"))
    except (OSError, ValueError, KeyError):
        return None


def wait_for(predicate, timeout: float, proc: subprocess.Popen, log: Path, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"{what}: inflight run exited {proc.returncode}\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout}s\n{log.read_text()[-4000:]}")


def finish(proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"inflight run did not finish\n{log.read_text()[-4000:]}") from None
    assert code == 0, f"exit {code}\n{log.read_text()[-4000:]}"


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def stats_json(run_dir: Path, *extra: str) -> dict:
    out = subprocess.run(INFLIGHT + ["stats", str(run_dir), "--json", *extra], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check_log_invariants(run_dir: Path, steps: int) -> list:
    """Exactly one terminal record per dispatched rollout; each step consumed once; no sample
    beyond the bound; consumed rollouts completed."""
    from orchestrator.run.resume import read_journal

    records = list(read_records(run_dir))
    rollouts = [r for r in records if isinstance(r, RolloutRecord)]
    ids = [r.rollout_id for r in rollouts]
    assert len(ids) == len(set(ids)), "a rollout id appears twice"
    assert set(read_journal(run_dir)) == set(ids), "a dispatched rollout has no terminal record (or vice versa)"
    steps_seen = [c.step for c in records if isinstance(c, ConsumptionRecord)]
    assert sorted(steps_seen) == list(range(1, steps + 1)), steps_seen
    by_id = {r.rollout_id: r for r in rollouts}
    consumed = [rid for c in records if isinstance(c, ConsumptionRecord) for rid in c.rollout_ids]
    assert len(consumed) == len(set(consumed)), "a rollout was consumed twice"
    for c in records:
        if isinstance(c, ConsumptionRecord):
            for rid in c.rollout_ids:
                assert by_id[rid].status_name == "completed"
                assert 0 <= (c.step - 1) - by_id[rid].dispatched_version <= 4
    return records


def digest(version_dir: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for path in sorted(version_dir.glob("*.safetensors")):
        h.update(path.read_bytes())
    return h.hexdigest()


def reward_by_step(records) -> dict[int, float]:
    return {c.step: c.reward_mean for c in records if isinstance(c, ConsumptionRecord)}


@pytest.mark.timeout(1200)
def test_the_default_run_learns_digits_with_async_staleness_and_live_stats_match_the_log(tmp_path, rl_model):
    # Its own in-process engine, as `make run`'s: attached to the session's server (HTTP streaming),
    # its 60 steps took 101 s against 60 (a short run saves the start; a long one pays per token).
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", rl_model)
    config.write_text(config.read_text().replace("[run]\n", "[run]\nlinger_s = 120\n"))
    log = tmp_path / "out.log"
    proc = start([str(config), "--run-dir", str(run_dir), "--max-steps", "60"], log)
    try:
        wait_for(lambda: (health(run_dir) or {}).get("state") == "finished", 1100, proc, log, "run finished")
        url = json.loads((run_dir / "http.json").read_text())["url"]
        live = json.loads(get(url + "/stats"))
        live_window = json.loads(get(url + "/stats?step_min=10&step_max=20"))
        metrics = get(url + "/metrics").decode()
        offline = stats_json(run_dir)
        offline_window = stats_json(run_dir, "--step-min", "10", "--step-max", "20")
        with pytest.raises(urllib.error.HTTPError) as bad:
            get(url + "/stats?step_min=ten")
        assert bad.value.code == 400
        os.killpg(proc.pid, signal.SIGTERM)
        finish(proc, log)
    finally:
        kill_group(proc)
    records = check_log_invariants(run_dir, 60)
    rewards = reward_by_step(records)
    assert max(rewards[s] for s in range(1, 31)) >= 0.5, rewards
    assert max(rewards[s] for s in range(1, 61)) >= 0.9, rewards
    # the async pipeline was in the loop: some sample was consumed by a step two or more
    # versions after the one that sampled it, and `inflight stats` says so
    assert offline["staleness"]["max"] >= 1, offline["staleness"]
    assert all("reward_mean" in row for row in offline["per_step"])
    assert [row["step"] for row in offline["per_step"]] == list(range(1, 61))
    # live /stats is the same code over the same records
    assert live == offline
    assert live_window == offline_window
    # /metrics parses with prometheus_client's own parser and its counters equal the log's
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    counted: dict[str, float] = {}
    for sample in families["inflight_rollouts"].samples:
        if sample.name.endswith("_total"):
            counted[sample.labels["status"]] = counted.get(sample.labels["status"], 0) + sample.value
    for status in ("completed", "dropped", "errored"):
        assert counted.get(status, 0) == offline["rollouts"][status], (status, counted, offline["rollouts"])
    activations = [r for r in records if isinstance(r, ActivationRecord)]
    assert activations and all(a.outcome == "activated" for a in activations)
    # the run directory holds what the docs say
    for name in ("config.json", "orchestrator.jsonl", "trainer.log", "weights", "trainer", "tensorboard"):
        assert (run_dir / name).exists(), name


def activated(records) -> list[int]:
    return [a.version for a in records if isinstance(a, ActivationRecord) and a.outcome == "activated"]


@pytest.mark.timeout(1500)
def test_sigkill_then_resume_keeps_every_invariant_and_reaches_the_step_count(crash_resume_run):
    """On the shared run of tests/integration/conftest.py (a user's dataset task): SIGKILLed as a
    process group after 6 steps, resumed (its trainer then dies after a checkpoint: the exactly-once
    test's part), resumed again to the step count."""
    run = crash_resume_run
    records = check_log_invariants(run.run_dir, run.max_steps)
    before = run.killed
    # completed rollouts from before the crash were not redone: their records are unchanged
    # and appear once; rollouts in flight at the crash ended `dropped: crashed`
    old = {r.rollout_id for r in before if isinstance(r, RolloutRecord)}
    new = [r for r in records[len(before):] if isinstance(r, RolloutRecord)]
    assert not old & {r.rollout_id for r in new}
    # A version number never names two sets of weights: every version on disk before a crash
    # holds the same bytes after the resumes (the resumed engines re-activate the newest one),
    # and the versions each resumed run activated are one of those, then only new numbers.
    seen = activated(before)
    republished = {json.loads(line)["version"] for line in (run.run_dir / "trainer.log").read_text().splitlines()
                   if line.startswith("{") and '"trainer.republished"' in line}
    for stopped, resumed, published in ((before, run.crashed, run.published_at_kill),
                                        (run.crashed, records, run.published_at_crash)):
        assert published and all(digest(run.run_dir / "weights" / v) == d for v, d in published.items())
        new_versions = activated(resumed[len(stopped):])
        newest = max(int(v[1:]) for v in published)
        # The resumed run first activates the newest version on disk, or the one after it when
        # the crash came between that step's checkpoint or journal entry and its publish: the
        # resumed trainer then published it (the same weights; no engine had served it).
        assert new_versions[0] <= newest or (new_versions[0] == newest + 1 and new_versions[0] in republished), \
            (published, new_versions, republished)
        assert not set(new_versions[1:]) & set(seen + new_versions[:1]), (seen, new_versions)
        assert len(new_versions[1:]) == len(set(new_versions[1:])), new_versions
        seen += new_versions
    assert max(seen) >= run.max_steps - 1


@pytest.mark.timeout(1200)
def test_one_of_two_engines_killed_mid_run_is_replaced_and_the_run_goes_on(tmp_path, rl_model):
    """`fleet.replace`: the killed engine's rollouts end errored, a new engine of the same settings
    joins (at the live version) and serves; with `fleet.min_engines = 2` no new group is admitted
    until it does."""
    import psutil

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", rl_model, extra="[fleet]\nreplace = true\nmin_engines = 2\n")
    config.write_text("engines = 2\n" + config.read_text())
    log = tmp_path / "out.log"
    proc = start([str(config), "--run-dir", str(run_dir), "--max-steps", "14"], log)
    try:
        wait_for(lambda: ((health(run_dir) or {}).get("step") or 0) >= 3, 600, proc, log, "three steps")
        cores = [p for p in psutil.Process(proc.pid).children(recursive=True) if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
        assert len(cores) == 2, [(p.name(), p.cmdline()) for p in psutil.Process(proc.pid).children(recursive=True)]
        cores[0].kill()
        finish(proc, log)
    finally:
        kill_group(proc)
    records = check_log_invariants(run_dir, 14)
    rollouts = [r for r in records if isinstance(r, RolloutRecord)]
    errored = [r for r in rollouts if r.status_name == "errored"]
    fenced = [json.loads(line) for line in (run_dir / "orchestrator.jsonl").read_text().splitlines()
              if '"fleet.fenced"' in line]
    assert len({f["engine"] for f in fenced}) == 1, fenced  # the killed engine, and only it
    dead = fenced[0]["engine"]
    # Its rollouts in flight end errored; there may be none (it can die while it stages a version,
    # with nothing in flight, and is then fenced before anything more is sent to it).
    assert all(r.engine_id == dead and r.status.kind in {"engine_died", "engine_fenced"} for r in errored), errored
    from datetime import datetime

    fenced_at = datetime.fromisoformat(fenced[0]["timestamp"].replace("Z", "+00:00")).timestamp()
    after = max([fenced_at] + [r.timings.dispatched_at for r in errored])
    late = [r for r in rollouts if r.status_name == "completed" and r.timings.dispatched_at > after]
    assert late and all(r.engine_id != dead for r in late)
    history = [json.loads(line) for line in (run_dir / "fleet.jsonl").read_text().splitlines()]
    replacement = [h for h in history if h["source"] == f"replacement of {dead}"]
    assert [h["state"] for h in replacement] == ["joining", "serving"], history
    assert ("lost" in [h["state"] for h in history if h["engine"] == dead]), history
    served = [r for r in late if r.engine_id == replacement[0]["engine"]]
    joined = [json.loads(line) for line in (run_dir / "orchestrator.jsonl").read_text().splitlines()
              if '"fleet.joined"' in line]
    assert [j["engine"] for j in joined] == [replacement[0]["engine"]], joined
    assert served and min(r.version_span[0] for r in served) >= joined[0]["version"] >= 1, joined
    paused = [json.loads(line) for line in (run_dir / "orchestrator.jsonl").read_text().splitlines()
              if '"fleet.below_minimum"' in line]
    assert paused, "one engine serving below fleet.min_engines = 2 paused admission"
    rewards = reward_by_step(records)
    assert rewards[14] > rewards[1]
