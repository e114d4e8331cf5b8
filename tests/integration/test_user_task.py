"""A user's own task through `inflight run` (real engine, real trainer, a task package in a
temporary directory that this project knows nothing of): it learns, its faults are recorded and
the run goes on, held-out evaluation runs beside activations, labelled with its versions, W&B gets the field's names,
and --resume after SIGKILL continues at the next dataset row (on the run the resume tests share,
of this module's package: tests/integration/conftest.py).

The learnable toy: docs/tasks.md's `digit_share` reward on "Write digits: ..." prompts from a JSONL
dataset (the share of the completion's non-space characters that are digits): the tiny-rl model
reaches 0.5 in about 20 steps like the built-in digits task (the learning test runs 30).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from replay.log import read_records
from replay.records import ConsumptionRecord, EvalRecord, RolloutRecord
from tests.doc_snippets import write_snippets
from tests.integration.test_run import finish, kill_group, start, stats_json

pytestmark = [pytest.mark.engine, pytest.mark.slow]

FAULTS = '''
import os
import time

HUNG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hung")


def trip(completion, mode="", **row):
    """Raises on rows marked "raise"; hangs on the first sample scored of a row marked "hang"
    (one timeout shows the property; each costs the timeout and a new scoring process); else 0."""
    if mode == "raise":
        raise RuntimeError(f"tripped on {row['answer']}")
    if mode == "hang":
        try:
            os.close(os.open(HUNG, os.O_CREAT | os.O_EXCL))  # the first caller only, even in parallel
        except FileExistsError:
            return 0.0
        time.sleep(60)
    return 0.0
'''


def digits_rows(n: int, seed: int, modes: dict[int, str] | None = None) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        digits = [str(rng.randrange(10)) for _ in range(3)]
        rows.append({"prompt": "Write digits: " + " ".join(digits), "answer": "".join(digits),
                     "mode": (modes or {}).get(i, "")})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def package(tmp_path: Path, model: Path, extra: str = "", faults: bool = False, run_extra: str = "",
            engine_extra: str = "") -> Path:
    """The guide's package, plus a dataset and a config, in a directory of its own."""
    write_snippets(tmp_path)
    # The seeded shuffle puts row 5 at group 100, 77 at 121 and 136 at 72: all three consumed
    # mid-run (steps 10 to 16 of 30), so the faults' records never hinge on the run's stop.
    modes = {5: "raise", 77: "raise", 136: "hang"} if faults else {}
    write_jsonl(tmp_path / "train.jsonl", digits_rows(256, 0, modes))
    write_jsonl(tmp_path / "heldout.jsonl", digits_rows(8, 1))
    (tmp_path / "faults.py").write_text(FAULTS)
    rewards = '{ fn = "my_task.rewards:digit_share", weight = 1.0 }'
    if faults:
        rewards += ', { fn = "faults:trip", weight = 0.0 }'
    config = tmp_path / "task.toml"
    config.write_text(f"""
[engine]
model = "{model}"
{engine_extra}
[task]
dataset = "train.jsonl"
rewards = [{rewards}]
score_timeout_s = 2.0
[run]
progress = "plain"
{run_extra}
[http]
enabled = false
{extra}
""")
    return config


def run_in(directory: Path, args: list[str], log: Path):
    """`inflight run` with `directory` as its working directory (the user's package lives there)."""
    cwd = os.getcwd()
    test = os.environ.pop("PYTEST_CURRENT_TEST", None)  # wandb-core writes no history under it (measured)
    os.chdir(directory)
    try:
        return start(args, log)
    finally:
        os.chdir(cwd)
        if test is not None:
            os.environ["PYTEST_CURRENT_TEST"] = test


@pytest.mark.timeout(1500)
def test_a_user_task_package_learns_records_its_faults_evaluates_and_tracks(tmp_path, rl_model):
    config = package(tmp_path, rl_model, faults=True,
                     run_extra='wandb = { project = "inflight-test", mode = "offline" }', extra="""
[eval]
every_steps = 10
dataset = "heldout.jsonl"
samples_per_prompt = 4
max_prompts = 8
""")
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    proc = run_in(tmp_path, [str(config), "--run-dir", str(run_dir), "--max-steps", "30"], log)
    try:
        finish(proc, log, timeout=1400)
    finally:
        kill_group(proc)
    records = list(read_records(run_dir))
    rollouts = {r.rollout_id: r for r in records if isinstance(r, RolloutRecord)}
    steps = [c for c in records if isinstance(c, ConsumptionRecord)]
    assert [c.step for c in steps] == list(range(1, 31))

    # It learns: the reward (the user's digit_share) rises within the run.
    rewards = [c.reward_mean for c in steps]
    assert max(rewards[-10:]) >= 0.5 and max(rewards[-10:]) >= sum(rewards[:5]) / 5 + 0.3, rewards
    # Every component is recorded per rollout and per step.
    completed = [r for r in rollouts.values() if r.status_name == "completed"]
    assert completed and all({"reward", "digit_share", "trip"} <= set(r.rewards) for r in completed)
    stats = stats_json(run_dir)
    assert all(row["reward_components"]["digit_share"] == pytest.approx(row["reward_mean"])
               for row in stats["per_step"])

    # A raising reward errors its rollouts with the message; a hanging one times out; the run finished.
    errored = [r for r in rollouts.values() if r.status_name == "errored"]
    kinds = {r.status.kind for r in errored}
    assert {"reward_error", "reward_timeout"} <= kinds, kinds
    assert any("tripped on" in r.status.message for r in errored if r.status.kind == "reward_error")
    # Both rows marked "raise" errored (how many of a group's samples are scored before the group
    # fails after its retries depends on timing: 3 to 8 each), and stats count what the log holds.
    raised = [r for r in errored if r.status.kind == "reward_error"]
    assert len({r.status.message for r in raised}) == 2, sorted({r.status.message for r in raised})
    assert stats["errored_by_kind"]["reward_error"] == len(raised)

    # Evaluation: due at the configured versions, beside activations (each record names the
    # versions of its tokens: tests/integration/test_eval_run.py), never trained on.
    evals = [r for r in records if isinstance(r, EvalRecord)]
    assert len(evals) >= 2 and evals[0].due_version == 0
    rounds = [e.due_version // 10 for e in evals]  # one per multiple of 10 (those due mid-evaluation skipped)
    assert rounds == sorted(set(rounds)), [(e.due_version, e.versions) for e in evals]
    for before, after in zip(evals, evals[1:]):  # one at a time: the next begins once the one before ended
        assert after.due_version >= before.versions[-1]
    for e in evals:
        assert e.k == 4 and e.prompts == 8 and e.task == "heldout"
        assert all(len(p.rewards) == len(p.versions) == 4 and p.errored == 0 for p in e.results)
        assert e.version in e.versions and e.versions[0] >= e.due_version
        passed = sum(any(x >= e.pass_threshold for x in p.rewards) for p in e.results)
        assert e.pass_at_k == passed / len(e.results)
        assert e.mean_at_k == pytest.approx(sum(x for p in e.results for x in p.rewards) / (4 * len(e.results)))
    assert [(x["step"], x["version"], x["pass_at_k"]) for x in stats["eval"]] == [
        (e.step, e.version, e.pass_at_k) for e in evals]
    consumed = [rid for c in steps for rid in c.rollout_ids]
    assert len(consumed) == 30 * 64 and set(consumed) <= set(rollouts)
    assert not any(r.prompt_id.startswith("heldout") for r in rollouts.values())

    # W&B offline: the run directory holds an offline run with the field's metric names.
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((run_dir / "wandb").rglob("*"))
    data = runs[0].read_bytes()
    for name in ("reward/mean", "reward/digit_share", "staleness/mean", "staleness/max", "mismatch/kl",
                 "timing/pause_s", "throughput/tokens_per_s", "eval/heldout/pass@4", "eval/heldout/mean@4"):
        assert name.encode() in data, name


@pytest.mark.timeout(1500)
def test_resume_after_sigkill_continues_at_the_next_dataset_row(crash_resume_run, rl_model):
    """On the shared run of tests/integration/conftest.py: this module's package, SIGKILLed as a
    process group after 6 steps, then resumed (twice: the second part's trainer dies after a
    checkpoint, the exactly-once test's part) to its step count."""
    run = crash_resume_run
    before, records = run.killed, run.records
    assert len(records) > len(before)
    tmp_path, config = run.package_dir, run.config
    # Each group is one prompt index; index g names row order[g] of the epoch (seeded shuffle).
    sys.path.insert(0, str(tmp_path))
    cwd = os.getcwd()
    try:
        from orchestrator.config.run import load_config
        from orchestrator.tasks import make_task

        os.chdir(tmp_path)
        task = make_task(load_config(config).task, str(rl_model), search_path=[str(tmp_path)])
    finally:
        os.chdir(cwd)
        sys.path.remove(str(tmp_path))
    rows_by_group: dict[int, set[str]] = {}
    for r in records:
        if isinstance(r, RolloutRecord):
            rows_by_group.setdefault(r.group_id, set()).add(r.prompt_id)
    groups = sorted(rows_by_group)
    assert groups == list(range(len(groups))), "a prompt index was skipped"
    assert len(groups) < task.rows  # one epoch: every row at most once
    for g in groups:
        number, _ = task.row_at(g)
        assert rows_by_group[g] == {f"{task.name}-{number:06d}"}, g
    rows = [next(iter(rows_by_group[g])) for g in groups]
    assert len(rows) == len(set(rows)), "a row was repeated within the epoch"
    # The resumed run drew its next rows where the first stopped: its first new group follows the last old one.
    # A group the first run dispatched is old even when its only records are the resume's `crashed` drops
    # (every rollout of it was still in flight, e.g. its reward still being scored, at the SIGKILL).
    after = [r for r in records[len(before):] if isinstance(r, RolloutRecord)]
    crashed = {r.group_id for r in after if r.status_name == "dropped" and r.status.reason == "crashed"}
    old_groups = {r.group_id for r in before if isinstance(r, RolloutRecord)} | crashed
    new_groups = {r.group_id for r in after} - old_groups
    # (With eager admission the first run may have dispatched every group the remaining steps
    # need: then the resumed run re-samples the crashed ones under their ids and draws no new row.)
    assert not new_groups or min(new_groups) == max(old_groups) + 1
