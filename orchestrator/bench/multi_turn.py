"""`multi_turn_overhead_ratio` of `inflight bench orchestrator` (issue #19): what the environment
protocol costs per turn.

The real `RunLoop` on the zero-latency fake engine and the instant fake trainer, twice in one
run: (a) episodes of `TURNS` turns through the environment protocol (the environment's `step`
in a worker thread, the chat template's delta rendered and tokenized per turn, each turn a
request of `TURN_TOKENS` tokens to the episode's engine); (b) the same number of turns as
independent single-turn rollouts of `TURN_TOKENS` tokens. The ratio is episodes/s over
(single-turn rollouts/s / TURNS): 1.0 means a turn of an episode costs what a rollout costs
(goal >= 0.8). `multi_turn_overhead_ratio` runs the environment off the run's loop (the
default: its environment thread, one hop per reset and step); `..._on_loop` the same
environment declaring `on_loop = True` (an async environment that never blocks);
`..._paced` the default again with the fake engine paced like a real one (a chunk every 10 ms, as
`score_overhead_ratio_paced`): where the run's loop is not saturated, a thread hop costs nothing
that shows (on the zero-latency engine each hop waits for the busy loop thread to hand over the
GIL).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import anyio

from orchestrator.tasks.env import Environment, Episode

TURNS = 4
PACED_CHUNK_DELAY_S = 0.01  # the paced row: a chunk of 16 tokens every 10 ms, like a real engine's stream
TURN_TOKENS = 500  # the orchestrator bench's rollout (TOKENS): a turn is a rollout
PAIRS = 3  # paired measurements behind each zero-latency ratio (their median)


class EchoEnvironment(Environment):
    """Answers each turn with one short user message; reward 1.0 after the last turn."""

    max_turns = TURNS
    max_episode_tokens = 1 << 20
    name = "bench-echo"

    def row(self, index: int) -> dict:
        return {"index": index}

    async def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": "Write digits."}]

    async def step(self, episode: Episode) -> tuple[list[dict], float | None, bool]:
        if episode.turns < self.max_turns:
            return [{"role": "user", "content": "More."}], None, False
        return [], 1.0, True


def episode_task(model_dir: str):
    from transformers import AutoTokenizer

    from orchestrator.config.run import TaskConfig
    from orchestrator.tasks.dataset import load_rows
    from orchestrator.tasks.episodes import environment_task

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return environment_task(EchoEnvironment(), tokenizer, TaskConfig(entrypoint="bench:echo"), where="task",
                            scan=True, load_rows=load_rows)


async def episodes_rate(bench_run, task, concurrency: int, episodes: int, chunk_delay_s: float = 0.0) -> dict:
    """Episodes/s of the real RunLoop with `task` (episodic) on the fake engine (`bench_run`:
    orchestrator.bench.orchestrator.BenchRun, passed in: that module calls this one)."""
    import msgspec

    from orchestrator.run.loop import RunLoop

    with tempfile.TemporaryDirectory(prefix="inflight-bench-mt-") as tmp:
        run = bench_run(Path(tmp), concurrency, episodes, tokens=TURN_TOKENS, chunk_delay_s=chunk_delay_s)
        run.task = task
        run.config = msgspec.structs.replace(run.config, engine=msgspec.structs.replace(
            run.config.engine, max_model_len=1 << 20))
        return await _timed(run, RunLoop)


async def _timed(run, loop_type) -> dict:
    loop = run.loop = loop_type(run)
    started = time.perf_counter()
    with anyio.fail_after(600):
        await loop.main(run.scheduler.start())
    elapsed = time.perf_counter() - started
    done = run.scheduler.done_steps * run.scheduler.batch_size
    await run.recorder.flush()
    run.recorder.close()
    run.journal.close()
    return {"rollouts": done, "seconds": elapsed, "rollouts_per_s": done / elapsed}


async def multi_turn_overhead(bench_run, orchestrator_rate, model_dir: str, concurrency: int = 64,
                              episodes: int = 1024, paced_episodes: int = 256, pairs: int = PAIRS) -> dict:
    """`bench_run`, `orchestrator_rate`: orchestrator.bench.orchestrator's (its caller).

    The zero-latency ratios are the median of `pairs` paired measurements (episodes, then the
    single-turn rollouts right after): this machine's speed drifts by a third between runs of a
    few seconds, and a pair sees the same drift on both sides (`..._pairs` lists each)."""
    import statistics

    task = await anyio.to_thread.run_sync(episode_task, model_dir)

    async def single() -> dict:
        return await orchestrator_rate(concurrency, episodes * TURNS, 0.0, pool="inline", tokens=TURN_TOKENS)

    def ratio(multi: dict, one: dict) -> float:
        return multi["rollouts_per_s"] / (one["rollouts_per_s"] / TURNS)

    threaded = [(await episodes_rate(bench_run, task, concurrency, episodes), await single()) for _ in range(pairs)]
    paced = await episodes_rate(bench_run, task, concurrency, paced_episodes, chunk_delay_s=PACED_CHUNK_DELAY_S)
    task.runner.close()
    task.runner.env.on_loop = True
    on_loop = [(await episodes_rate(bench_run, task, concurrency, episodes), await single()) for _ in range(pairs)]
    single_paced = await orchestrator_rate(concurrency, paced_episodes * TURNS, 0.0, pool="inline",
                                           tokens=TURN_TOKENS, chunk_delay_s=PACED_CHUNK_DELAY_S)
    def median_pair(measured: list[tuple[dict, dict]], ratios: list[float]) -> tuple[dict, dict]:
        return measured[sorted(range(pairs), key=lambda i: ratios[i])[pairs // 2]]

    ratios = [ratio(m, one) for m, one in threaded]
    on_loop_ratios = [ratio(m, one) for m, one in on_loop]
    shown = median_pair(threaded, ratios)  # the median pair's figures
    return {"multi_turn_turns": TURNS, "multi_turn_turn_tokens": TURN_TOKENS,
            "multi_turn_episodes": shown[0], "multi_turn_single_turn_rollouts": shown[1],
            "multi_turn_episodes_on_loop": median_pair(on_loop, on_loop_ratios)[0],
            "multi_turn_episodes_paced": paced, "multi_turn_single_turn_rollouts_paced": single_paced,
            "multi_turn_overhead_ratio": statistics.median(ratios),
            "multi_turn_overhead_ratio_pairs": ratios,
            "multi_turn_overhead_ratio_on_loop": statistics.median(on_loop_ratios),
            "multi_turn_overhead_ratio_on_loop_pairs": on_loop_ratios,
            "multi_turn_overhead_ratio_paced": ratio(paced, single_paced)}
