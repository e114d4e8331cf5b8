"""`inflight stats --json` against statistics computed independently, in plain Python, from
the parameters the test log was generated with (not from the query code or the records).

Staleness of a rollout consumed by trainer step s is (s - 1) - dispatched version (step s
trains from version s - 1), a token's lag (s - 1) - its version."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter
from dataclasses import dataclass

import pytest
import structlog

from replay import cli
from replay.log import FsyncPolicy, ReplayLog
from replay.query import ColumnBuilder, Filters, compute_stats
from replay.records import (
    ActivationRecord,
    Completed,
    ConsumptionRecord,
    DiscardRecord,
    Dropped,
    EngineActivation,
    Errored,
    PolicyIdentity,
    RolloutRecord,
    RunMetaRecord,
    Timings,
)

IDENTITY = PolicyIdentity("ckpt", "tok", "tmpl", "bf16")
ENGINES = ["e0", "e1", "e2"]
DISCARD_REASONS = ["stale", "stale", "trainer_lost"]
INVALID_CLAIMS = 2  # generate_log makes two


@dataclass
class Truth:
    """What the generator decided for one rollout."""

    rollout_id: int
    engine: str
    status: str
    reason: str | None
    dispatched: int
    token_versions: list[int]
    consumed: int | None
    reward: float | None = None  # rewards["reward"]
    discarded: str | None = None  # the reason of the DiscardRecord that claimed it
    finish: str | None = None  # the recorded finish reason (None: not recorded)


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="inflight")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_sub = sub.add_parser("bench").add_subparsers(dest="bench_command", required=True)
    cli.register(sub, bench_sub)
    args = parser.parse_args(argv)
    # As `inflight` itself does (orchestrator.observe.logging): log lines go to stderr, never stdout.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    try:
        return args.func(args)
    finally:
        structlog.reset_defaults()


def generate_log(run_dir, seed: int = 11) -> tuple[list[Truth], list[tuple[int, str, str, float, float]]]:
    rng = random.Random(seed)
    truths: list[Truth] = []
    activations = []  # (version, outcome, engine, transfer_s, pause_s)
    records: list = [RunMetaRecord(run_id="t", created_at=0.0, identity=IDENTITY)]
    by_step: dict[int, list[int]] = {}
    early_consumption = ConsumptionRecord(step=40, rollout_ids=[10_000])  # names a later rollout
    records.append(early_consumption)
    for i in range(400):
        dispatched = rng.randrange(0, 30)
        n_tokens = 0 if rng.random() < 0.05 else rng.randrange(1, 40)
        versions, version = [], dispatched + rng.choice([0, 0, 1])
        for _ in range(n_tokens):
            if rng.random() < 0.04:
                version += rng.choice([1, 2])
            versions.append(version)
        status, reason = "completed", None
        roll = rng.random()
        if roll < 0.08:
            status, reason = "dropped", rng.choice(["stale", "stale", "aborted"])
        elif roll < 0.11:
            status, reason = "errored", rng.choice(["engine_died", "timeout"])
        rollout_id, consumed, in_record = i, None, False
        if i == 399:  # consumed by `early_consumption`, which the log holds before it
            rollout_id, status, reason, consumed = 10_000, "completed", None, 40
        elif status == "completed" and rng.random() < 0.8:
            # step s trains from version s - 1: the earliest step that can consume a rollout
            # is one past the last version that sampled it
            consumed = (versions[-1] if versions else dispatched) + 1 + rng.randrange(0, 5)
            in_record = rng.random() < 0.3
            if not in_record:
                by_step.setdefault(consumed, []).append(rollout_id)
        truth = Truth(rollout_id, rng.choice(ENGINES), status, reason, dispatched, versions, consumed,
                      reward=(i % 7) / 7 if i % 3 else None, finish=(None, "length", "stop", "stop")[i % 4])
        truths.append(truth)
        records.append(RolloutRecord.from_lists(
            rollout_id=rollout_id, group_id=i // 4, prompt_id=f"p{i // 4}", engine_id=truth.engine,
            prompt_token_ids=[1, 2, 3], completion_token_ids=list(range(n_tokens)),
            completion_logprobs=[-1.0] * n_tokens, dispatched_version=dispatched,
            token_versions=versions or None,
            status={"completed": Completed(), "dropped": Dropped(reason or ""),
                    "errored": Errored(reason or "", "boom")}[status],
            identity=IDENTITY, timings=Timings(0.0), consumed_step=consumed if in_record else None,
            rewards={} if truth.reward is None else {"reward": truth.reward, "format": 1.0},
            finish_reason=truth.finish,
        ))
        if rng.random() < 0.05:
            version_number = len(activations) + 1
            outcome = rng.choice(["activated", "activated", "rolled_back"])
            engines = []
            for engine in ENGINES:
                transfer, pause = rng.uniform(0.1, 3.0), rng.uniform(0.001, 0.05)
                engines.append(EngineActivation(engine, transfer, pause))
                activations.append((version_number, outcome, engine, transfer, pause))
            records.append(ActivationRecord(version=version_number, outcome=outcome, engines=engines))
    for step in sorted(by_step):
        records.append(ConsumptionRecord(step=step, rollout_ids=by_step[step]))
    # Completed rollouts no step consumed: every third discarded (no random draws here, so the
    # rest of the log does not depend on it).
    unconsumed = [t for t in truths if t.status == "completed" and t.consumed is None]
    for k, truth in enumerate(unconsumed[::3]):
        truth.discarded = DISCARD_REASONS[k % len(DISCARD_REASONS)]
        records.append(DiscardRecord([truth.rollout_id], truth.discarded, step=30))
    # Two invalid claims: a second consumption of a consumed rollout, and a discard of another.
    consumed_twice = [t for t in truths if t.consumed is not None][:2]
    records.append(ConsumptionRecord(step=99, rollout_ids=[consumed_twice[0].rollout_id]))
    records.append(DiscardRecord([consumed_twice[1].rollout_id], "trainer_lost"))
    with ReplayLog.open(run_dir, fsync=FsyncPolicy.every(50), segment_bytes=8192) as log:
        for record in records:
            log.append(record)
    return truths, activations


# --- the independent computation -------------------------------------------------------------


def nearest_rank(values: list, q: float):
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def summary(values: list, histogram: bool = True) -> dict:
    result = {"count": len(values), "mean": sum(values) / len(values), "p50": nearest_rank(values, 50),
              "p90": nearest_rank(values, 90), "p99": nearest_rank(values, 99), "max": max(values)}
    if histogram:
        result["histogram"] = {str(k): v for k, v in sorted(Counter(values).items())}
    return result


def expected_stats(truths: list[Truth], activations: list, *, steps=(None, None), engines=(),
                   statuses=()) -> dict:
    lo, hi = steps
    chosen = []
    for t in truths:
        if (lo is not None or hi is not None) and t.consumed is None:
            continue
        if lo is not None and t.consumed < lo or hi is not None and t.consumed > hi:
            continue
        if engines and t.engine not in engines or statuses and t.status not in statuses:
            continue
        chosen.append(t)
    consumed = [t for t in chosen if t.consumed is not None]
    staleness = [(t.consumed - 1) - t.dispatched for t in consumed]
    spans = [(t.token_versions[-1] - t.token_versions[0]) if t.token_versions else 0 for t in consumed]
    with_tokens = [t for t in chosen if t.token_versions]
    distinct = [len(set(t.token_versions)) for t in with_tokens]
    multi = [t for t in with_tokens if len(set(t.token_versions)) > 1]
    token_lags = Counter((t.consumed - 1) - v for t in consumed for v in t.token_versions)
    total_tokens = sum(token_lags.values())
    acts = [a for a in activations if (lo is None or a[0] >= lo) and (hi is None or a[0] <= hi)]
    entries = [a for a in acts if not engines or a[2] in engines]
    per_activation = {(a[0], a[1]) for a in acts}
    per_step = []
    for step in sorted({t.consumed for t in consumed}):
        group = [t for t in consumed if t.consumed == step]
        lag = [(t.consumed - 1) - t.dispatched for t in group]
        rewards = [t.reward for t in group if t.reward is not None]
        flight = [(t.token_versions[-1] - t.token_versions[0]) if t.token_versions else 0 for t in group]
        per_step.append({
            "step": step, "rollouts": len(group), "tokens": sum(len(t.token_versions) for t in group),
            "staleness_mean": sum(lag) / len(group), "staleness_max": max(lag),
            "in_flight_lag_mean": sum(flight) / len(group),
            "queue_lag_mean": sum(a - b for a, b in zip(lag, flight)) / len(group),
            "multi_version_fraction": sum(len(set(t.token_versions)) > 1 for t in group) / len(group),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        })
    stale_in_flight = sum(t.status == "dropped" and t.reason == "stale" for t in chosen)
    stale_completed = sum(t.discarded == "stale" for t in chosen)
    per_engine = {}
    for name in sorted({t.engine for t in chosen}):
        mine = [t for t in chosen if t.engine == name]
        sampled = [t.token_versions for t in mine if t.token_versions]
        per_engine[name] = {"rollouts": len(mine), "completed": sum(t.status == "completed" for t in mine),
                            "tokens": sum(len(t.token_versions) for t in mine),
                            "first_version": min(v[0] for v in sampled) if sampled else None,
                            "last_version": max(v[-1] for v in sampled) if sampled else None}
    finished = [t.finish for t in chosen if t.status == "completed" and t.finish is not None]
    return {
        "truncated_share": finished.count("length") / len(finished) if finished else None,
        "engines": per_engine,
        "rollouts": {"completed": sum(t.status == "completed" for t in chosen),
                     "dropped": sum(t.status == "dropped" for t in chosen),
                     "errored": sum(t.status == "errored" for t in chosen), "total": len(chosen)},
        "staleness": summary(staleness),
        "in_flight_lag": summary(spans),
        "queue_lag": summary([s - f for s, f in zip(staleness, spans)]),
        "span_lengths": summary(distinct),
        "multi_version_fraction": len(multi) / len(with_tokens),
        "multi_version_token_fraction": sum(len(t.token_versions) for t in multi)
        / sum(len(t.token_versions) for t in with_tokens),
        "token_share_by_lag": {str(k): v / total_tokens for k, v in sorted(token_lags.items())},
        "dropped_for_staleness": stale_in_flight + stale_completed,
        "stale": {"in_flight": stale_in_flight, "completed": stale_completed},
        "discarded_by_reason": dict(Counter(t.discarded for t in chosen if t.discarded)),
        "invalid_consumptions": INVALID_CLAIMS,
        "dropped_by_reason": dict(Counter(t.reason for t in chosen if t.status == "dropped")),
        "errored_by_kind": dict(Counter(t.reason for t in chosen if t.status == "errored")),
        "activations": {
            "count": len(per_activation),
            "by_outcome": dict(Counter(outcome for _, outcome in per_activation)),
            "transfer_s": summary([a[3] for a in entries], histogram=False),
            "pause_s": summary([a[4] for a in entries], histogram=False),
        },
        "per_step": per_step,
    }


def assert_matches(actual: dict, expected: dict) -> None:
    """Every expected key is present in `actual` and equal (floats to 1e-9)."""
    for key, value in expected.items():
        assert key in actual, key
        assert _approx_nested(actual[key], value), key


def _approx_nested(actual, expected) -> bool:
    if isinstance(expected, dict):
        assert set(actual) == set(expected), (sorted(actual), sorted(expected))
        return all(_approx_nested(actual[k], v) for k, v in expected.items())
    if isinstance(expected, list):
        assert len(actual) == len(expected)
        return all(_approx_nested(a, e) for a, e in zip(actual, expected))
    if expected is None:  # unknown stays unknown: never a number
        assert actual is None
        return True
    assert actual == pytest.approx(expected, rel=1e-9, abs=1e-12), (actual, expected)
    return True


# --- tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    truths, activations = generate_log(run_dir)
    return run_dir, truths, activations


def stats_json(capsys, argv: list[str]) -> dict:
    assert run_cli(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_stats_json_equals_an_independent_computation(generated, capsys):
    run_dir, truths, activations = generated
    actual = stats_json(capsys, ["stats", str(run_dir), "--json"])
    assert {"rollouts", "staleness", "in_flight_lag", "queue_lag", "multi_version_fraction",
            "activations"} <= set(actual)
    for key in ("staleness", "in_flight_lag", "queue_lag"):
        assert {"mean", "p50", "p90", "p99", "max"} <= set(actual[key])
    assert_matches(actual, expected_stats(truths, activations))
    assert actual["log"]["corrupt_records"] == 0 and actual["unmatched_consumptions"] == 0
    assert actual["multi_version_fraction"] > 0  # the generated log exercises spans
    assert actual["stale"]["in_flight"] > 0 and actual["stale"]["completed"] > 0
    assert all(row["reward_mean"] is None or 0 <= row["reward_mean"] < 1 for row in actual["per_step"])


@pytest.mark.parametrize("argv, selection", [
    (["--step-min", "10", "--step-max", "25"], {"steps": (10, 25)}),
    (["--engine", "e1", "--engine", "e2"], {"engines": ("e1", "e2")}),
    (["--status", "completed"], {"statuses": ("completed",)}),
    (["--step-min", "20", "--engine", "e0", "--status", "completed"],
     {"steps": (20, None), "engines": ("e0",), "statuses": ("completed",)}),
])
def test_filters_select_the_same_rollouts_as_an_independent_filter(generated, capsys, argv, selection):
    run_dir, truths, activations = generated
    actual = stats_json(capsys, ["stats", str(run_dir), "--json", *argv])
    expected = expected_stats(truths, activations, **selection)
    assert_matches(actual, expected)
    assert actual["rollouts"]["total"] < len(truths)


def test_staleness_splits_into_in_flight_and_queue_lag(generated, capsys):
    run_dir, truths, _ = generated
    actual = stats_json(capsys, ["stats", str(run_dir), "--json"])
    total = actual["staleness"]["mean"]
    assert total == pytest.approx(actual["in_flight_lag"]["mean"] + actual["queue_lag"]["mean"])
    assert sum(actual["token_share_by_lag"].values()) == pytest.approx(1.0)


def test_live_columns_agree_with_the_offline_scan(generated, capsys):
    """The live /stats path (records fed one by one) gives what the files give."""
    from replay.log import read_records

    run_dir, _, _ = generated
    builder = ColumnBuilder()
    for record in read_records(run_dir):
        builder.add(record)
    live = compute_stats(builder.build(), Filters())
    offline = stats_json(capsys, ["stats", str(run_dir), "--json"])
    offline.pop("log")
    assert json.loads(json.dumps(live)) == offline


def test_an_empty_selection_gives_empty_summaries(generated, capsys):
    run_dir, _, _ = generated
    actual = stats_json(capsys, ["stats", str(run_dir), "--json", "--step-min", "100000"])
    assert actual["rollouts"]["total"] == 0
    assert actual["staleness"]["count"] == 0 and actual["staleness"]["p50"] is None
    assert actual["multi_version_fraction"] is None and actual["per_step"] == []


def test_unknown_status_filter_is_refused():
    with pytest.raises(ValueError, match="unknown status"):
        Filters(statuses=("finished",))


def test_stats_of_an_empty_log_and_of_activations_only(tmp_path, capsys):
    ReplayLog.open(tmp_path).close()
    empty = stats_json(capsys, ["stats", str(tmp_path), "--json"])
    assert empty["rollouts"]["total"] == 0 and empty["activations"]["count"] == 0
    assert empty["log"]["records"] == 0
    with ReplayLog.open(tmp_path) as log:
        log.append(ActivationRecord(version=1, outcome="rolled_back",
                                    engines=[EngineActivation("e0", 2.0, 0.5)]))
    only = stats_json(capsys, ["stats", str(tmp_path), "--json", "--engine", "e0"])
    assert only["activations"] == {
        "count": 1, "by_outcome": {"rolled_back": 1},
        "transfer_s": {"count": 1, "mean": 2.0, "p50": 2.0, "p90": 2.0, "p99": 2.0, "max": 2.0},
        "pause_s": {"count": 1, "mean": 0.5, "p50": 0.5, "p90": 0.5, "p99": 0.5, "max": 0.5},
    }
    assert run_cli(["stats", str(tmp_path)]) == 0  # the tables render with nothing to show
    assert "Activations: 1" in capsys.readouterr().out


def columns_from_log(run_dir):
    from replay.log import read_records

    builder = ColumnBuilder()
    for record in read_records(run_dir):
        builder.add(record)
    return builder.build()


def _ended(rollout_id: int, status, finish_reason: str | None) -> RolloutRecord:
    return RolloutRecord.from_lists(
        rollout_id=rollout_id, group_id=rollout_id, prompt_id=str(rollout_id), engine_id="e0",
        prompt_token_ids=[1, 2], completion_token_ids=[3, 4, 5], completion_logprobs=[-0.5] * 3,
        dispatched_version=0, identity=IDENTITY, timings=Timings(1.0), status=status,
        rewards={"reward": 0.0} if isinstance(status, Completed) else {}, finish_reason=finish_reason)


def test_truncated_share_counts_completed_rollouts_cut_by_a_length_limit(tmp_path, capsys):
    # completed: 2 cut ("length"), 3 not ("stop"), 4 without a recorded reason (an older writer);
    # an errored and a dropped rollout with a reason: not completed, not counted
    reasons = ["length"] * 2 + ["stop"] * 3 + [None] * 4
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(1000)) as log:
        for rid, reason in enumerate(reasons):
            log.append(_ended(rid, Completed(), reason))
        log.append(_ended(20, Errored("engine_died", "x"), "length"))
        log.append(_ended(21, Dropped("stale"), "abort"))
    scanned = stats_json(capsys, ["stats", str(tmp_path), "--json"])
    assert scanned["truncated_share"] == pytest.approx(2 / 5)
    live = compute_stats(columns_from_log(tmp_path), Filters())  # the live /stats path: one record at a time
    assert live["truncated_share"] == scanned["truncated_share"]
    errored = stats_json(capsys, ["stats", str(tmp_path), "--json", "--status", "errored"])
    assert errored["truncated_share"] is None, "no completed rollout selected: unknown, not 0"


def test_truncated_share_is_absent_when_no_finish_reason_was_recorded(tmp_path, capsys):
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(1000)) as log:
        for rid in range(3):
            log.append(_ended(rid, Completed(), None))
    assert stats_json(capsys, ["stats", str(tmp_path), "--json"])["truncated_share"] is None
