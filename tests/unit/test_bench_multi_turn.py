"""`inflight bench orchestrator`'s multi_turn_overhead_ratio: episodes through the environment
protocol on the real RunLoop and the zero-latency fake engine, against the same turns as
single-turn rollouts. Figures, not asserted times: the keys exist and each measurement consumed
what it was asked to."""

from __future__ import annotations

from pathlib import Path

from orchestrator.bench.multi_turn import TURNS, multi_turn_overhead
from orchestrator.bench.orchestrator import BenchRun, orchestrator_rate

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-rl"


async def test_the_multi_turn_row_measures_episodes_on_and_off_the_loop():
    result = await multi_turn_overhead(BenchRun, orchestrator_rate, str(MODEL), concurrency=16, episodes=64,
                                      paced_episodes=32)
    assert result["multi_turn_episodes"]["rollouts"] == 64
    assert result["multi_turn_episodes_on_loop"]["rollouts"] == 64
    assert result["multi_turn_single_turn_rollouts"]["rollouts"] == 64 * TURNS
    assert result["multi_turn_episodes_paced"]["rollouts"] == 32
    assert all(result[k] > 0 for k in ("multi_turn_overhead_ratio", "multi_turn_overhead_ratio_on_loop",
                                       "multi_turn_overhead_ratio_paced"))
