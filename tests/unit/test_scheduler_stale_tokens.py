"""Tokens dropped for staleness: `inflight stats --json` (dropped_stale_tokens, its share, the
per-length breakdown) against an independent count over the generated log of
test_replay_query, and the `/metrics` counter against the same statistics."""

from __future__ import annotations

import json

import pytest

from orchestrator.observe.metrics import RunMetrics
from replay.log import read_records
from replay.query import ColumnBuilder, Filters, compute_stats
from tests.unit.test_replay_query import generate_log, run_cli


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    truths, _ = generate_log(run_dir)
    return run_dir, truths


def stats_json(capsys, argv: list[str]) -> dict:
    assert run_cli(argv) == 0
    return json.loads(capsys.readouterr().out)


def is_stale(t) -> bool:
    return (t.status == "dropped" and t.reason == "stale") or t.discarded == "stale"


def bucket(n: int) -> tuple[int, int]:
    if n == 0:
        return 0, 0
    low = 1
    while low * 2 <= n:
        low *= 2
    return low, 2 * low - 1


def test_dropped_stale_tokens_equal_an_independent_count(generated, capsys):
    run_dir, truths = generated
    actual = stats_json(capsys, ["stats", str(run_dir), "--json"])
    stale = [t for t in truths if is_stale(t)]
    assert stale and any(t.status == "dropped" for t in stale) and any(t.discarded for t in stale)
    dropped_tokens = sum(len(t.token_versions) for t in stale)
    generated_tokens = sum(len(t.token_versions) for t in truths)
    assert actual["dropped_stale_tokens"] == dropped_tokens > 0
    assert actual["dropped_stale_token_share"] == pytest.approx(dropped_tokens / generated_tokens)
    expected: dict[tuple[int, int], list[int]] = {}
    for t in truths:
        n = len(t.token_versions)
        row = expected.setdefault(bucket(n), [0, 0, 0, 0])
        row[0] += 1
        row[1] += n
        if is_stale(t):
            row[2] += 1
            row[3] += n
    by_length = actual["dropped_stale_by_length"]
    assert [(b["min_tokens"], b["max_tokens"]) for b in by_length] == sorted(expected)
    for b in by_length:
        rollouts, tokens, dropped, dropped_tokens = expected[(b["min_tokens"], b["max_tokens"])]
        assert (b["rollouts"], b["tokens"], b["dropped_rollouts"], b["dropped_tokens"]) == (
            rollouts, tokens, dropped, dropped_tokens)
        assert b["dropped_token_share"] == (pytest.approx(dropped_tokens / tokens) if tokens else None)


def test_a_filter_narrows_the_dropped_tokens_too(generated, capsys):
    run_dir, truths = generated
    actual = stats_json(capsys, ["stats", str(run_dir), "--json", "--engine", "e1"])
    stale = [t for t in truths if is_stale(t) and t.engine == "e1"]
    assert actual["dropped_stale_tokens"] == sum(len(t.token_versions) for t in stale)
    assert sum(b["rollouts"] for b in actual["dropped_stale_by_length"]) == actual["rollouts"]["total"]


def test_the_metrics_counter_equals_the_statistics(generated):
    """`inflight_dropped_stale_tokens` counts, record by record, what the log's statistics say."""
    run_dir, _ = generated
    metrics = RunMetrics()
    builder = ColumnBuilder()
    for record in read_records(run_dir):
        metrics.on_record(record)
        builder.add(record)
    stats = compute_stats(builder.build(), Filters())
    assert metrics.dropped_stale_tokens._value.get() == stats["dropped_stale_tokens"] > 0
    assert b"inflight_dropped_stale_tokens_total" in metrics.render()
    assert len(metrics._unsettled_tokens) < stats["rollouts"]["completed"]  # consumed ones left it


def test_an_empty_log_has_no_share(tmp_path, capsys):
    from replay.log import ReplayLog

    ReplayLog.open(tmp_path).close()
    empty = stats_json(capsys, ["stats", str(tmp_path), "--json"])
    assert empty["dropped_stale_tokens"] == 0
    assert empty["dropped_stale_token_share"] is None  # no token generated: unknown, never 0.0
    assert empty["dropped_stale_by_length"] == []
