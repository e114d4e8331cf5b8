"""What happened to rollouts after generation (consumed, discarded; the first claim wins),
records of unknown types, rewards per step, and the live statistics, against the files."""

from __future__ import annotations

import json
import math

import msgspec
import pyarrow.parquet as pq
import pytest

from replay.export import export_parquet
from replay.log import LogReader, ReplayLog, frame, read_records, scan
from replay.query import Filters, LiveStats, stats_from_log
from replay.records import (
    ActivationRecord,
    ConsumptionRecord,
    DiscardRecord,
    Dropped,
    EngineActivation,
    PolicyIdentity,
    RolloutRecord,
    RunMetaRecord,
    Timings,
)

IDENTITY = PolicyIdentity("ckpt", "tok", "tmpl", "bf16")


def rollout(i: int, *, dispatched: int = 3, versions=None, consumed_step=None, reward=None,
            status=None, engine: str | None = None) -> RolloutRecord:
    n = len(versions) if versions else 2
    return RolloutRecord.from_lists(
        rollout_id=i, group_id=i // 2, prompt_id=f"p{i}", engine_id=engine or f"e{i % 2}",
        prompt_token_ids=[1, 2], completion_token_ids=list(range(n)), completion_logprobs=[-1.0] * n,
        dispatched_version=dispatched, token_versions=versions, identity=IDENTITY,
        timings=Timings(1.0), consumed_step=consumed_step,
        rewards={} if reward is None else {"reward": reward}, **({"status": status} if status else {}))


def write(run_dir, records, **options) -> None:
    with ReplayLog.open(run_dir, **options) as log:
        for record in records:
            log.append(record)


def both_ways(run_dir, filters=None) -> dict:
    """stats_from_log by a scan, then from the sidecars it wrote: they must agree."""
    scanned = stats_from_log(run_dir, filters)
    assert stats_from_log(run_dir, filters) == scanned
    assert stats_from_log(run_dir, filters, sidecars=False) == scanned
    return scanned


def exported(run_dir, tmp_path) -> dict[int, dict]:
    out = tmp_path / "out.parquet"
    export_parquet(run_dir, out)
    return {row["rollout_id"]: row for row in pq.read_table(out).to_pylist()}


# --- the first claim wins, for stats and export alike ----------------------------------------


@pytest.mark.parametrize("order", ["claims_after", "claims_before", "mixed"])
def test_a_rollout_consumed_twice_keeps_its_first_consumption(tmp_path, order):
    run_dir = tmp_path / "run"
    rollouts = [rollout(1), rollout(2), rollout(3, consumed_step=7)]
    first = ConsumptionRecord(step=5, rollout_ids=[1, 2])
    second = ConsumptionRecord(step=9, rollout_ids=[1, 3])  # 1 again; 3 carries its own step
    records = {
        "claims_after": [*rollouts, first, second],
        "claims_before": [first, second, *rollouts],
        "mixed": [rollouts[0], first, rollouts[1], second, rollouts[2]],
    }[order]
    write(run_dir, records, segment_bytes=400)  # several segments: claims cross sidecars
    stats = both_ways(run_dir)
    # 3's own consumed_step counts where its rollout record is: first only in "claims_after"
    step_of_3 = 7 if order == "claims_after" else 9
    steps = {row["step"]: row["rollouts"] for row in stats["per_step"]}
    assert steps == {5: 2, step_of_3: 1}
    assert stats["invalid_consumptions"] == 2  # 1 consumed again; 3 claimed twice
    rows = exported(run_dir, tmp_path)
    assert [rows[i]["consumed_step"] for i in (1, 2, 3)] == [5, 5, step_of_3]


def test_consumed_and_discarded_the_first_record_counts(tmp_path):
    run_dir = tmp_path / "run"
    write(run_dir, [
        rollout(1), rollout(2), rollout(3), rollout(4, reward=0.5),
        ConsumptionRecord(step=6, rollout_ids=[1]),
        DiscardRecord([1, 2], "stale", step=6),  # 1: already consumed -> invalid; 2: discarded
        ConsumptionRecord(step=7, rollout_ids=[2, 4]),  # 2: already discarded -> invalid
        DiscardRecord([3], "trainer_lost", step=7),
    ])
    stats = both_ways(run_dir)
    assert stats["invalid_consumptions"] == 2
    assert stats["discarded_by_reason"] == {"stale": 1, "trainer_lost": 1}
    assert stats["stale"] == {"in_flight": 0, "completed": 1}
    assert stats["dropped_for_staleness"] == 1
    assert [(row["step"], row["rollouts"]) for row in stats["per_step"]] == [(6, 1), (7, 1)]
    assert stats["staleness"]["count"] == 2  # a discarded rollout is not consumed
    rows = exported(run_dir, tmp_path)
    assert [rows[i]["consumed_step"] for i in (1, 2, 3, 4)] == [6, None, None, 7]
    assert [rows[i]["discard_reason"] for i in (1, 2, 3, 4)] == [None, "stale", "trainer_lost", None]
    assert rows[2]["discard_step"] == 6 and rows[2]["staleness"] is None


def test_stale_drops_of_both_kinds_are_counted(tmp_path):
    run_dir = tmp_path / "run"
    write(run_dir, [
        rollout(1, status=Dropped("stale")), rollout(2, status=Dropped("aborted")),
        rollout(3, status=Dropped("group_failed")), rollout(4), rollout(5),
        DiscardRecord([4, 5], "stale", step=9), DiscardRecord([77], "stale"),
    ])
    stats = both_ways(run_dir)
    assert stats["dropped_for_staleness"] == 3
    assert stats["stale"] == {"in_flight": 1, "completed": 2}
    assert stats["dropped_by_reason"] == {"stale": 1, "aborted": 1, "group_failed": 1}
    assert stats["discarded_by_reason"] == {"stale": 2}
    assert stats["unmatched_discards"] == 1 and stats["unmatched_consumptions"] == 0
    engine_0 = both_ways(run_dir, Filters(engines=("e0",)))  # rollouts 2 and 4
    assert engine_0["stale"] == {"in_flight": 0, "completed": 1}


def test_staleness_is_zero_for_synchronous_rl(tmp_path):
    """Step s trains from version s - 1: a rollout sampled under that version has lag 0."""
    run_dir = tmp_path / "run"
    records = []
    for step in range(1, 5):
        records += [rollout(10 * step + k, dispatched=step - 1) for k in range(3)]
        records.append(ConsumptionRecord(step=step, rollout_ids=[10 * step + k for k in range(3)]))
    write(run_dir, records)
    stats = both_ways(run_dir)
    assert stats["staleness"]["histogram"] == {"0": 12}
    assert stats["token_share_by_lag"] == {"0": 1.0}
    assert all(row["staleness_max"] == 0 for row in stats["per_step"])


def test_per_step_reward_mean_never_invents_a_reward(tmp_path):
    run_dir = tmp_path / "run"
    write(run_dir, [
        rollout(1, reward=1.0), rollout(2, reward=0.0), rollout(3),  # 3 has no "reward"
        rollout(4), rollout(5),
        ConsumptionRecord(step=4, rollout_ids=[1, 2, 3]),
        ConsumptionRecord(step=5, rollout_ids=[4, 5]),
    ])
    stats = both_ways(run_dir)
    by_step = {row["step"]: row["reward_mean"] for row in stats["per_step"]}
    assert by_step == {4: 0.5, 5: None}
    assert "NaN" not in json.dumps(stats)


# --- record types from a newer writer --------------------------------------------------------


def future_payload() -> bytes:
    return msgspec.msgpack.encode({"type": "future_thing", "blob": b"\x00" * 8, "n": 3})


def test_records_of_an_unknown_type_are_skipped_and_counted(tmp_path):
    run_dir = tmp_path / "run"
    write(run_dir, [RunMetaRecord("r", 0.0), rollout(1)])
    segment = run_dir / "replay" / "00000001.seg"
    with segment.open("ab") as f:
        f.write(frame(future_payload()))
    write(run_dir, [rollout(2), ConsumptionRecord(step=5, rollout_ids=[1, 2])])

    assert [r.rollout_id for r in read_records(run_dir) if isinstance(r, RolloutRecord)] == [1, 2]
    for lenient in (False, True):
        reader = LogReader(run_dir, lenient=lenient)
        assert len(list(reader)) == 4
        assert (reader.unknown_records, reader.invalid_records, reader.corrupt_records) == (1, 0, 0)
    result = scan(run_dir)
    assert result.unknown_records == 1 and result.invalid_records == 0
    stats = both_ways(run_dir)  # the count survives the sidecar
    assert stats["log"]["unknown_records"] == 1 and stats["log"]["records"] == 4
    assert stats["rollouts"]["total"] == 2
    result = export_parquet(run_dir, tmp_path / "out.parquet")
    assert result.rollouts == 2 and result.unknown_records == 1


# --- live statistics -------------------------------------------------------------------------


def live_records() -> list:
    records = [RunMetaRecord("live", 0.0, identity=IDENTITY),
               ConsumptionRecord(step=9, rollout_ids=[40])]  # before its rollout
    for i in range(60):
        versions = [i // 6] * 3 + [i // 6 + (i % 3 == 0)] * 2
        status = Dropped("stale") if i % 11 == 5 else None
        records.append(rollout(i, dispatched=i // 6, versions=versions, status=status,
                               reward=None if i % 4 == 0 else i / 60,
                               consumed_step=i // 6 + 2 if i % 13 == 0 else None))
        if i % 10 == 9:
            records.append(ActivationRecord(version=i // 10 + 1, outcome="activated",
                                            engines=[EngineActivation("e0", 0.5 + i / 100, 0.01),
                                                     EngineActivation("e1", 0.7, 0.02)]))
            ids = [j for j in range(i - 9, i + 1) if j % 13 and j % 11 != 5 and j != 40]
            records.append(ConsumptionRecord(step=i // 6 + 2, rollout_ids=ids[:6]))
            records.append(DiscardRecord(ids[6:], "stale" if i % 20 == 9 else "trainer_lost"))
    records.append(ConsumptionRecord(step=12, rollout_ids=[1, 999]))  # 1 again; 999 unmatched
    records.append(rollout(40, dispatched=6))
    return records


@pytest.mark.parametrize("filters", [None, Filters(step_min=3, step_max=8), Filters(engines=("e1",)),
                                     Filters(statuses=("dropped",)),
                                     Filters(step_min=4, engines=("e0",), statuses=("completed",))])
def test_live_stats_equal_the_statistics_of_the_files(tmp_path, filters):
    records = live_records()
    live = LiveStats()
    with ReplayLog.open(tmp_path, segment_bytes=2048) as log:
        for record in records:
            log.append(record)
            live.add(record)
        log_info = {"directory": log.log_dir, "records": len(records), "corrupt_records": 0,
                    "invalid_records": 0, "unknown_records": 0, "torn_tail_bytes": 0}
    offline = stats_from_log(tmp_path, filters)
    assert live.snapshot(filters, log_info=log_info) == offline
    assert json.dumps(live.snapshot(filters, log_info=log_info)) == json.dumps(offline)  # key order
    assert stats_from_log(tmp_path, filters) == offline  # from sidecars, too
    assert offline["invalid_consumptions"] == 1 and offline["unmatched_consumptions"] == 1
    assert live.snapshot(filters, log_info={"directory": log_info["directory"]}) == offline


def test_live_stats_snapshots_while_records_keep_coming(tmp_path):
    records = live_records()
    live = LiveStats()
    with ReplayLog.open(tmp_path) as log:
        for k, record in enumerate(records):
            log.append(record)
            live.add(record)
            if k % 17 == 0 or k == len(records) - 1:
                log.flush()
                info = {"directory": log.log_dir}
                assert live.snapshot(log_info=info) == stats_from_log(tmp_path, sidecars=False)
    assert not math.isnan(live.snapshot(log_info=info)["staleness"]["mean"])
