"""Where `inflight bench orchestrator`'s rollout costs go: by thread, and per rollout against per chunk.

Two figures beside `overhead_ratio_c64`, so that docs/architecture.md's account of one rollout's
cost is a command's output, not a one-off script's:

* `cpu_us_per_rollout_by_thread` (in each `orchestrator_cN` row): the CPU time (each thread's
  CPU-time clock, Linux) each Python thread of the process spent while the loop ran, over the
  rollouts consumed, grouped by the thread's role: `loop` (the event loop's thread),
  `replay_writer` (the replay log's writer: append, CRC, live statistics, metrics),
  `anyio_threads` (anyio's worker threads: the dispatch journal's write and fsync, the recorder's
  flush wait, any `to_thread`), `scoring` (the scorer's threads), `other`; and `process`, the
  whole process's CPU. The threads share one GIL, so where the loop saturates a core the wall
  time a rollout is about their sum. A thread started during the run counts from its start; one
  that ended before the run did (anyio keeps its idle workers 10 s; the scorer ends a hung
  call's thread) is only in `process`; off Linux the key is absent.
* `loop_split_c64`: the same run with the fake engine's 500 tokens in one chunk instead of 32,
  for the loop and for the bare task group: `fixed_us_per_rollout` is what the loop spends on a
  rollout beyond the bare group's whatever its chunks (dispatch, the request's track, scoring,
  the scheduler, the record, the writer's share), `loop_us_per_chunk` and `bare_us_per_chunk` what
  each further chunk costs the loop and the bare group.
* `loop_ablations_c64` (`--loop-ablations N`): the loop with one of its features taken out at a
  time, in N rounds that alternate the variants (medians, wall µs a rollout, and the process's
  CPU), so that what each feature costs the run is measured beside the whole, in one run:
  `scoring_inline` scores on the loop (no thread hop), `records_not_written` keeps every record
  the loop builds but hands none to the replay writer (no encoding, log, statistics or metrics),
  `steps_8x_rarer` a batch eight times as large (a trainer step's bookkeeping and activation
  shared by eight times as many rollouts), `neither_written_nor_scored_off_loop` both of the
  first two at once (what is left: dispatch, the fleet's stream, the scheduler, the record's
  build, the steps); `bare_us`, the bare task group in the same rounds, and `<variant>_ratio`,
  bare over the variant (as `overhead_ratio_c64`): the ratio the loop would reach with that
  feature free; and `record_build_us`, `build_rollout_record` alone on a rollout the run's fleet
  streamed from the fake engine.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

_ROLES = (("MainThread", "loop"), ("replay-writer", "replay_writer"), ("AnyIO worker thread", "anyio_threads"),
          ("inflight-score", "scoring"))


def thread_cpu_s() -> dict[int, tuple[str, float]] | None:
    """Each live thread's kernel id -> (its role, CPU seconds so far, to the nanosecond), and 0 ->
    ("process", the whole process's); None off Linux. The clock is named by the kernel id (Linux's thread CPU-time clock, as glibc's
    pthread_getcpuclockid makes it), not from a pthread handle, which is not safe to use once its
    thread has ended: a thread that ended meanwhile is an OSError here, and skipped."""
    if not sys.platform.startswith("linux"):
        return None
    out: dict[int, tuple[str, float]] = {0: ("process", time.process_time())}  # no thread has id 0
    for thread in threading.enumerate():
        if thread.native_id is None:  # not started yet
            continue
        try:
            out[thread.native_id] = (_role(thread.name), time.clock_gettime(_thread_cpu_clock(thread.native_id)))
        except OSError:
            continue
    return out


def _thread_cpu_clock(native_id: int) -> int:
    # Linux's CPU-time clock of one thread: MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED).
    return (~native_id << 3) | 6


def _role(name: str) -> str:
    for prefix, role in _ROLES:
        if name.startswith(prefix):
            return role
    return "other"


def cpu_by_role(before: dict | None, after: dict | None, rollouts: int) -> dict[str, float] | None:
    """µs of CPU a rollout per role, over the threads alive at the end (those started since
    `before` from their start)."""
    if before is None or after is None or not rollouts:
        return None
    out: dict[str, float] = {}
    for tid, (role, seconds) in after.items():
        since = before[tid][1] if tid in before else 0.0
        out[role] = out.get(role, 0.0) + 1e6 * (seconds - since) / rollouts
    return out


async def loop_split(orchestrator_rate, bare_rate, rollouts: int, tokens: int, chunk: int,
                     streamed: dict, bare_streamed: dict, concurrency: int = 64) -> dict:
    """`loop_split_c64`: `streamed`/`bare_streamed` are the chunked run's rows (same rollouts)."""
    one = await orchestrator_rate(concurrency, rollouts, chunk=tokens)
    bare_one = await bare_rate(concurrency, rollouts, chunk=tokens)
    chunks = -(-tokens // chunk)
    us = lambda row: 1e6 / row["rollouts_per_s"]  # noqa: E731 - wall µs a rollout
    split = {"chunks_per_rollout": chunks,
             "loop_us_per_rollout_one_chunk": us(one), "bare_us_per_rollout_one_chunk": us(bare_one),
             "fixed_us_per_rollout": us(one) - us(bare_one)}
    if chunks > 1:  # streamed in one chunk already: no cost a further chunk to tell
        split["loop_us_per_chunk"] = (us(streamed) - us(one)) / (chunks - 1)
        split["bare_us_per_chunk"] = (us(bare_streamed) - us(bare_one)) / (chunks - 1)
    return {f"orchestrator_c{concurrency}_one_chunk": one, f"bare_c{concurrency}_one_chunk": bare_one,
            f"loop_split_c{concurrency}": split}


# ---------------------------------------------------------------------------------------------
# Ablations: what each feature costs, the loop without it beside the loop with it.

ABLATIONS = {  # variant -> orchestrator_rate's keyword arguments
    "full": {"record_build": True},
    "scoring_inline": {"pool": "inline"},
    "records_not_written": {"recording": False},
    "steps_8x_rarer": {"batch_scale": 8},
    "neither_written_nor_scored_off_loop": {"recording": False, "pool": "inline"},
}


def ablation_rounds(value: str) -> int:
    """`--loop-ablations`' argument: 0 (skip) or more rounds."""
    import argparse

    try:
        rounds = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"rounds must be a whole number, got {value!r}") from None
    if rounds < 0:
        raise argparse.ArgumentTypeError(f"rounds must be 0 (skip) or more, got {rounds}")
    return rounds


class UnwrittenRecords:
    """A recorder that keeps count and writes nothing (`records_not_written`): no encoding, no
    log, no writer thread, no statistics or metrics."""

    def __init__(self) -> None:
        self.submitted = 0
        self.written = 0

    def submit(self, record) -> None:
        self.submitted += 1

    async def flush(self, timeout_s: float = 60.0) -> None:
        return None

    def close(self, timeout_s: float = 60.0) -> None:
        return None


async def loop_ablations(orchestrator_rate, bare_rate, rollouts: int, rounds: int, concurrency: int = 64) -> dict:
    """`loop_ablations_c64`: each variant of ABLATIONS once a round, in turn, then the bare group;
    medians."""
    rows: dict[str, list[dict]] = {name: [] for name in ABLATIONS}
    bare: list[dict] = []
    for _ in range(rounds):
        for name, kwargs in ABLATIONS.items():
            rows[name].append(await orchestrator_rate(concurrency, rollouts, **kwargs))
        bare.append(await bare_rate(concurrency, rollouts))
    us = lambda row: 1e6 / row["rollouts_per_s"]  # noqa: E731 - wall µs a rollout
    out: dict = {"rounds": rounds, "rollouts": rollouts}
    if bare:
        out["bare_us"] = statistics.median(us(r) for r in bare)
    for name, runs in rows.items():
        out[f"{name}_us"] = statistics.median(us(r) for r in runs)
        cpu = [r["cpu_us_per_rollout_by_thread"]["process"] for r in runs if r.get("cpu_us_per_rollout_by_thread")]
        if cpu:
            out[f"{name}_process_cpu_us"] = statistics.median(cpu)
        if name != "full":
            out[f"{name}_saves_us"] = out["full_us"] - out[f"{name}_us"]
        if bare:
            out[f"{name}_ratio"] = out["bare_us"] / out[f"{name}_us"]
    built = rows["full"][-1].get("record_build_us")
    if built is not None:
        out["record_build_us"] = built
    return {f"loop_ablations_c{concurrency}": out}


async def record_build_us(run, repeat: int = 2000) -> float:
    """`build_rollout_record` alone, µs a call, on a rollout the run's fleet streams from its fake
    engine (the loop's inputs: its context, outcome, completion and rewards)."""
    from orchestrator.run.recording import RolloutContext, build_rollout_record
    from orchestrator.scheduling.scheduler import Terminal

    prompt = (await run.task.prompt(0)).token_ids
    completion = await run.fleet.generate(prompt, run.sampling, request_id="rollout-0", redispatch=False,
                                          final_only=True)
    ctx = RolloutContext(0, 0, "bench", tuple(prompt), time.time(), completion.dispatched_version,
                         completion.engine_id)
    terminal = Terminal(rollout_id=0, status="completed")
    rewards = run.task.score_sync(None, completion.token_ids)
    started = time.perf_counter()
    for _ in range(repeat):
        build_rollout_record(ctx, terminal, completion, rewards, identity=run.identity, sampling=run.sampling)
    return 1e6 * (time.perf_counter() - started) / repeat
