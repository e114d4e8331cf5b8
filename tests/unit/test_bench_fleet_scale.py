"""`inflight bench orchestrator --fleet-scale`: the real RunLoop and `Fleet.activate` with N fake
engines. Figures, not asserted times: the rows have the contract's keys, every measurement did
what it was asked (every engine applied every version), and the flags select the part alone."""

from __future__ import annotations

import argparse

from orchestrator.bench.fleet_scale import activation_times, fleet_scale
from orchestrator.bench.orchestrator import fake_engine, orchestrator_rate, register, run_bench

CONTRACT = {"engines", "rollouts_per_s", "loop_lag_p99_ms", "activation_ms"}


async def test_the_fleet_scale_rows_measure_every_size_and_every_engine_applies():
    out = await fleet_scale(fake_engine, orchestrator_rate, sizes=[1, 8], rollouts=64, concurrency=16,
                            activations=2, slow_delay_s=0.02, slow_fleet=8)
    rows = out["fleet_scale"]
    assert [r["engines"] for r in rows] == [1, 8]
    for row in rows:
        assert CONTRACT <= set(row)
        assert all(isinstance(row[k], float) and row[k] >= 0 for k in CONTRACT - {"engines"})
        assert row["rollouts_per_s"] > 0 and row["rollouts"] >= 64
        assert {"activation_cpu_ms", "activation_busy_ms", "activation_latent_ms"} <= set(row)
        assert row["engines_applied"] == row["engines"], "an engine did not apply the version"
        assert row["activation_outcomes"] == ["activated"]
    slow = out["fleet_scale_slow_engine"]
    assert slow["engines"] == 8 and slow["engines_applied"] == 8
    assert slow["slow_engine_own_ms"] >= 20, "the slow engine's swap RPCs did not wait"


async def test_an_activation_with_rollouts_in_flight_applies_on_every_engine():
    result = await activation_times(fake_engine, 4, activations=3, busy=8)
    assert result["outcomes"] == ["activated"] * 3
    assert result["engines_applied"] == 4


async def test_the_fleet_scale_part_runs_alone():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["orchestrator", "--concurrency", "--score-rollouts", "0", "--soak-steps", "0",
                              "--multi-turn-episodes", "0", "--fleet-scale", "2", "--fleet-scale-rollouts", "64",
                              "--fleet-scale-slow-ms", "0"])
    result = await run_bench(args)
    assert [r["engines"] for r in result["fleet_scale"]] == [2]
    assert not [k for k in result if k.startswith(("orchestrator_c", "score_", "soak", "multi_turn"))]
    skipped = parser.parse_args(["orchestrator", "--fleet-scale", "0"])
    assert [n for n in skipped.fleet_scale if n > 0] == []
