"""`inflight bench orchestrator`'s scoring rows: what scoring off the loop costs the run.

`orchestrator_rate` (of `orchestrator/bench/orchestrator.py`, which calls this module) comes in as
an argument.
"""

from __future__ import annotations


async def score_overhead(orchestrator_rate, rollouts: int, concurrency: int = 64, score_ms: float = 1.0) -> dict:
    """Rollouts/s with a `score_ms` Python reward function against with none (scored on the
    loop, free), in the same run: `score_overhead_ratio` with the process pool (the default,
    goal >= 0.9), `score_overhead_ratio_thread` with threads, `score_ipc_ratio` the process pool
    with a free function (its hop alone). Every scored run also needs `score_ms` of CPU per
    rollout besides the loop's: with few cores that, not the hop, is the limit."""
    import os

    none = await orchestrator_rate(concurrency, rollouts, 0.0, pool="inline")
    ipc = await orchestrator_rate(concurrency, rollouts, 0.0, pool="process")
    scored = await orchestrator_rate(concurrency, rollouts, score_ms, pool="process")
    thread = await orchestrator_rate(concurrency, rollouts, score_ms, pool="thread")
    rate = none["rollouts_per_s"]
    return {"score_ms": score_ms, "cpus": os.cpu_count(), "orchestrator_unscored": none,
            "orchestrator_process_free_score": ipc, "orchestrator_scored": scored,
            "orchestrator_scored_thread": thread, "score_ipc_ratio": ipc["rollouts_per_s"] / rate,
            "score_overhead_ratio": scored["rollouts_per_s"] / rate,
            "score_overhead_ratio_thread": thread["rollouts_per_s"] / rate}


async def score_overhead_paced(orchestrator_rate, rollouts: int = 2048, concurrency: int = 64,
                               score_ms: float = 1.0, chunk_delay_s: float = 0.01) -> dict:
    """The same comparison with the fake engine paced like a real one (a chunk of 16 tokens every
    `chunk_delay_s`: a few hundred rollouts/s, the loop no longer saturating a core by itself):
    whether scoring off the loop throttles a run that is not already CPU-bound."""
    none = await orchestrator_rate(concurrency, rollouts, 0.0, pool="inline", chunk_delay_s=chunk_delay_s)
    scored = await orchestrator_rate(concurrency, rollouts, score_ms, pool="process", chunk_delay_s=chunk_delay_s)
    thread = await orchestrator_rate(concurrency, rollouts, score_ms, pool="thread", chunk_delay_s=chunk_delay_s)
    rate = none["rollouts_per_s"]
    return {"paced_chunk_delay_s": chunk_delay_s, "orchestrator_unscored_paced": none,
            "orchestrator_scored_paced": scored, "orchestrator_scored_thread_paced": thread,
            "score_overhead_ratio_paced": scored["rollouts_per_s"] / rate,
            "score_overhead_ratio_thread_paced": thread["rollouts_per_s"] / rate}
