"""`inflight stats`, `inflight export` and `inflight bench replay`, run in-process."""

from __future__ import annotations

import argparse
import json
import sys

import duckdb
import numpy as np
import pytest
import structlog

from replay import cli
from replay.log import FRAME_HEADER, FsyncPolicy, ReplayLog
from replay.records import (
    ActivationRecord,
    ConsumptionRecord,
    Dropped,
    EngineActivation,
    PolicyIdentity,
    RolloutRecord,
    SamplingSettings,
    Timings,
)

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

IDENTITY = PolicyIdentity("ckpt", "tok", "tmpl", "bf16")


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


def rollout(i: int, n_tokens: int, versions: list[int] | None = None, **overrides) -> RolloutRecord:
    arguments = dict(
        rollout_id=i, group_id=i // 2, prompt_id=f"p{i}", engine_id=f"e{i % 2}",
        prompt_token_ids=[5, 6], completion_token_ids=[100 + i + t for t in range(n_tokens)],
        completion_logprobs=[-0.5 - t / 8 for t in range(n_tokens)], dispatched_version=3,
        token_versions=versions, identity=IDENTITY, timings=Timings(10.0, 10.5, 11.0),
        rewards={"correct": float(i % 2)}, sampling=SamplingSettings(temperature=0.7, seed=i),
    )
    arguments.update(overrides)
    return RolloutRecord.from_lists(**arguments)


@pytest.fixture
def run_dir(tmp_path):
    records = [
        rollout(0, 4, [3, 3, 4, 4]),
        rollout(1, 3),
        rollout(2, 0, status=Dropped("stale")),
        rollout(3, 2, consumed_step=6),
        ActivationRecord(version=4, outcome="activated", engines=[EngineActivation("e0", 1.0, 0.01)]),
        ConsumptionRecord(step=5, rollout_ids=[0, 1]),
    ]
    with ReplayLog.open(tmp_path, fsync=FsyncPolicy.every(10)) as log:
        acks = [log.append(record) for record in records]
    return tmp_path, acks


def test_stats_prints_readable_tables(run_dir, capsys):
    path, _ = run_dir
    assert run_cli(["stats", str(path), "--per-step"]) == 0
    out = capsys.readouterr().out
    for text in ("Rollouts", "staleness", "in-flight lag", "queue lag", "Token share by version lag",
                 "Activations: 1", "Per trainer step", "stale"):
        assert text in out, text


def test_stats_json_has_the_contract_keys(run_dir, capsys):
    path, _ = run_dir
    assert run_cli(["stats", str(path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["rollouts"] == {"completed": 3, "dropped": 1, "errored": 0, "total": 4}
    # staleness = (consuming step - 1) - dispatched version: rollout 3, consumed by step 6
    assert stats["staleness"]["max"] == 2 and stats["in_flight_lag"]["max"] == 1
    assert stats["multi_version_fraction"] == pytest.approx(1 / 3)
    assert stats["activations"]["count"] == 1
    assert stats["dropped_for_staleness"] == 1


def test_stats_on_a_corrupt_record_fails_naming_segment_and_offset(run_dir, capsys):
    path, acks = run_dir
    segment = path / "replay" / acks[1].segment
    data = bytearray(segment.read_bytes())
    data[acks[1].offset + FRAME_HEADER.size + 2] ^= 0x10
    segment.write_bytes(bytes(data))

    assert run_cli(["stats", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("inflight: error: ")
    assert f"segment {acks[1].segment} at byte offset {acks[1].offset}" in captured.err

    assert run_cli(["stats", str(path), "--json", "--lenient"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["log"]["corrupt_records"] == 1
    assert stats["rollouts"]["total"] == 3


def test_stats_on_a_missing_log_is_one_line_error(tmp_path, capsys):
    assert run_cli(["stats", str(tmp_path / "nowhere")]) == 2
    assert "no replay log" in capsys.readouterr().err


@pytest.fixture
def exported(run_dir, tmp_path):
    path, _ = run_dir
    out = tmp_path / "rollouts.parquet"
    assert run_cli(["export", str(path), "--parquet", str(out), "--tokens"]) == 0
    return out, tmp_path / "rollouts.tokens.parquet"


def test_exported_parquet_reads_with_duckdb(exported):
    out, tokens = exported
    con = duckdb.connect()
    rollouts = con.execute(
        f"SELECT rollout_id, status, consumed_step, staleness, span_end, drop_reason, seed "
        f"FROM '{out}' ORDER BY rollout_id").fetchall()
    assert rollouts == [(0, "completed", 5, 1, 4, None, 0), (1, "completed", 5, 1, 3, None, 1),
                        (2, "dropped", None, None, 3, "stale", 2), (3, "completed", 6, 2, 3, None, 3)]
    rows = con.execute(
        f"SELECT rollout_id, count(*), sum(logprob), min(version), max(version), max(lag) "
        f"FROM '{tokens}' GROUP BY rollout_id ORDER BY rollout_id").fetchall()
    assert [(r[0], r[1], r[3], r[4], r[5]) for r in rows] == [  # lag: (step - 1) - version
        (0, 4, 3, 4, 1), (1, 3, 3, 3, 1), (3, 2, 3, 3, 2)]
    expected_sum = float(np.sum(np.float32([-0.5 - t / 8 for t in range(4)])))
    assert rows[0][2] == pytest.approx(expected_sum, rel=1e-6)
    positions = con.execute(f"SELECT list(position ORDER BY position) FROM '{tokens}' "
                            f"WHERE rollout_id = 0").fetchone()[0]
    assert positions == [0, 1, 2, 3]
    token_ids = con.execute(f"SELECT list(token_id ORDER BY position) FROM '{tokens}' "
                            f"WHERE rollout_id = 1").fetchone()[0]
    assert token_ids == [101, 102, 103]


def test_exported_parquet_reads_with_polars(exported):
    import polars as pl  # a test dependency (pyproject [test] extra)

    out, tokens = exported
    frame = pl.read_parquet(out).sort("rollout_id")
    assert frame["rollout_id"].to_list() == [0, 1, 2, 3]
    assert frame["status"].to_list() == ["completed", "completed", "dropped", "completed"]
    assert frame["consumed_step"].to_list() == [5, 5, None, 6]
    assert frame["staleness"].to_list() == [1, 1, None, 2]
    assert frame["prompt_tokens"].to_list() == [2, 2, 2, 2]
    token_frame = pl.read_parquet(tokens)
    assert token_frame.height == 9
    assert token_frame.filter(pl.col("rollout_id") == 0)["version"].to_list() == [3, 3, 4, 4]


def test_export_of_a_corrupt_log_fails_unless_lenient(run_dir, tmp_path, capsys):
    path, acks = run_dir
    segment = path / "replay" / acks[0].segment
    data = bytearray(segment.read_bytes())
    data[acks[0].offset + FRAME_HEADER.size + 1] ^= 0x01
    segment.write_bytes(bytes(data))
    out = tmp_path / "out.parquet"
    assert run_cli(["export", str(path), "--parquet", str(out)]) == 2
    assert f"at byte offset {acks[0].offset}" in capsys.readouterr().err
    assert run_cli(["export", str(path), "--parquet", str(out), "--lenient"]) == 0
    ids = duckdb.connect().execute(f"SELECT list(rollout_id ORDER BY rollout_id) FROM '{out}'").fetchone()[0]
    assert ids == [1, 2, 3]


def test_bench_replay_reports_ratios_and_cleans_up(tmp_path, capsys):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert run_cli(["bench", "replay", "--json", "--records", "300", "--fsync1-records", "20",
                    "--stats-rows", "20000", "--dir", str(scratch)]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("append_ratio_fsync1", "append_ratio_fsync100", "scan_records_per_s", "stats_1m_seconds"):
        assert result[key] > 0, key
    assert result["record_bytes"] > 200 * 4 + 500 * 8
    assert set(result["goals"]) == {"append_ratio_fsync1", "append_ratio_fsync100",
                                    "scan_records_per_s", "stats_1m_seconds"}
    assert list(scratch.iterdir()) == []


def test_the_inflight_command_dispatches_stats(run_dir, capsys):
    from orchestrator.commands.cli import main

    path, _ = run_dir
    try:
        assert main(["stats", str(path), "--json"]) == 0
    finally:
        structlog.reset_defaults()  # main() points structlog at this test's captured stderr
    assert json.loads(capsys.readouterr().out)["rollouts"]["total"] == 4
