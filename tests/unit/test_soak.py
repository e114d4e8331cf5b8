"""Flat memory over a long run: the real RunLoop for 2,000 trainer steps (32,000 rollouts) on the
zero-latency fake engine and the instant fake trainer of `inflight bench orchestrator`."""

from __future__ import annotations

import pytest

from orchestrator.bench.orchestrator import soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.light_lane]


async def test_a_2000_step_soak_holds_nothing_per_rollout_and_memory_stays_flat():
    result = await soak(steps=2000, warmup=200)
    assert result["soak_rollouts"] == 2000 * 16
    # nothing the loop held for a rollout or a group outlives its consumption
    assert result["inflight_records_held_at_end"] == 0 and result["prompts_held_at_end"] == 0
    # resident memory at step 2,000 within 10% of step 200 (what grows is the live statistics'
    # columns: a few numbers per rollout for /stats)
    assert result["rss_growth_ratio"] <= 1.1, result
