"""`inflight bench orchestrator [--json]`: what the orchestrator costs per rollout, and what async buys.

1. Overhead. The real `RunLoop` (scheduler, dispatch journal, `Fleet` streaming and version
   tagging, replay writer thread, live stats, metrics) drives a zero-latency fake engine that
   streams 500 tokens in chunks of 16 per rollout, with an instant fake trainer; against it, in
   the same run, a bare anyio task group drives the same fake engine with the same number of
   rollouts in flight and nothing else. `overhead_ratio_cN` = orchestrator rollouts/s over bare
   rollouts/s at N in flight (goal >= 0.5); `scale_ratio_8192_vs_64` = orchestrator rollouts/s
   at 8192 over at 64 (goal >= 0.7). Where the c64 rollout's time goes (`orchestrator/bench/
   loop_costs.py`): each thread's CPU a rollout (`cpu_us_per_rollout_by_thread`), and
   `loop_split_c64`, the loop's fixed cost a rollout against its cost a chunk.
2. Scoring off the loop (`orchestrator/bench/scoring_overhead.py`): `score_overhead_ratio` =
   orchestrator rollouts/s with a 1 ms Python reward function (process pool) over with none,
   same run, on the zero-latency engine, where the loop alone saturates a core and scoring needs
   CPU the 2-core machine does not have; `score_overhead_ratio_paced` the same with the engine
   paced like a real one (a few hundred rollouts/s). Goal >= 0.9.
3. Flat memory: `rss_growth_ratio` = resident memory after `--soak-steps` steps over after a
   tenth of them, the real loop on the fake engine and trainer (goal <= 1.1).
4. Generation at the engine's speed: `generation_ratio` = completion tokens/s of the rollout path
   over offline `vllm.LLM.generate`, same prompts and engine settings (`orchestrator/bench/generation.py`,
   goal >= 0.8).
5. Multi-turn: `multi_turn_overhead_ratio` = 4-turn episodes/s through the environment protocol
   over (single-turn rollouts/s of the same turns / 4), same fake engine (`orchestrator/bench/multi_turn.py`,
   goal >= 0.8).
6. Async speed-up (`--digits-steps N`, real engine and trainer): the embedded default config
   run in async mode and in sync mode for the same number of steps; `async_speedup` = trainer
   steps per minute async over sync.
7. Hundreds of engines (`--fleet-scale 1 16 64 256`): `fleet_scale`, per fleet size, the loop's
   rollouts/s and event-loop lag, and one activation's time (`orchestrator/bench/fleet_scale.py`).
8. A join (`--join-engines 16`): `join_to_first_rollout_s`, an engine joining a busy fleet the way
   `inflight fleet add` brings one in, and the others' rate while it catches up
   (`orchestrator/bench/fleet_join.py`).

Each part can be skipped to run one alone, e.g. `--fleet-scale 1 16 64 256` with `--concurrency
--score-rollouts 0 --soak-steps 0 --generation-preset none --multi-turn-episodes 0 --digits-steps 0`.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import anyio

TOKENS = 500
CHUNK = 16


def register(bench_sub) -> None:
    p = bench_sub.add_parser("orchestrator", help="orchestrator rollouts/s vs a bare task group; async vs sync")
    p.add_argument("--concurrency", type=int, nargs="*", default=[64, 8192],
                   help="rollouts in flight (none given: skip the overhead measurements)")
    p.add_argument("--rollouts", type=int, default=16384, help="rollouts per measurement (at least 2 batches)")
    p.add_argument("--digits-steps", type=int, default=12,
                   help="trainer steps per mode for async_speedup on the digits task (0: skip; real engine)")
    p.add_argument("--soak-steps", type=int, default=2000,
                   help="steps of the memory soak (rss_growth_ratio: RSS at the end over RSS at a tenth; 0: skip)")
    p.add_argument("--generation-preset", default="tiny-rl", choices=["tiny-rl", "small", "none"],
                   help="generation_ratio: the rollout path against offline vllm.LLM.generate on this model "
                        "preset (real engine; none: skip)")
    p.add_argument("--multi-turn-episodes", type=int, default=1024,
                   help="episodes of the multi_turn_overhead_ratio measurement (0: skip; the tiny-rl tokenizer)")
    p.add_argument("--score-rollouts", type=int, default=None,
                   help="rollouts of the score_overhead_ratio measurements (default: --rollouts; 0: skip them)")
    p.add_argument("--fleet-scale", type=int, nargs="*", default=[1, 16, 64, 256],
                   help="fleet sizes of the fleet_scale rows (rollouts/s, loop lag, activation time with N "
                        "fake engines; none or 0: skip)")
    p.add_argument("--fleet-scale-rollouts", type=int, default=4096, help="rollouts per fleet_scale row")
    p.add_argument("--join-engines", type=int, default=16,
                   help="join_to_first_rollout_s: a fleet of this many fake engines that one more joins (0: skip)")
    p.add_argument("--fleet-scale-slow-ms", type=float, default=200.0,
                   help="fleet_scale_slow_engine: one of 64 engines answers every swap RPC this late (0: skip)")
    from orchestrator.bench.loop_costs import ablation_rounds

    p.add_argument("--loop-ablations", type=ablation_rounds, default=0, metavar="ROUNDS",
                   help="loop_ablations_c64: the c64 loop with one feature taken out at a time (scoring inline, "
                        "records not written, steps 8x rarer, the first two at once) beside the bare group, ROUNDS "
                        "alternating rounds (0: skip)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=bench_command)


# ---------------------------------------------------------------------------------------------
# The fake engine and the fake trainer.


def fake_engine(engine_id: str, tokens: int = TOKENS, chunk_delay_s: float = 0.0, swap_delay_s: float = 0.0,
                delayed: tuple[str, ...] | None = None, chunk: int = CHUNK):
    """`swap_delay_s`: every swap RPC (stage, status, apply, ...) takes that long, a slow engine
    among fast ones (`orchestrator/bench/fleet_scale.py`), or only the methods `delayed` names;
    `swap_delayed_s` adds up its waits."""
    from orchestrator.engines.base import Engine, TokenChunk, VersionSpan

    class ZeroLatencyEngine(Engine):
        """Streams `tokens` tokens in chunks of `chunk`, yielding to the loop between chunks."""

        def __init__(self) -> None:
            self.engine_id = engine_id
            self.version = 0
            self.staged = None
            self.swap_delayed_s = 0.0
            self._chunk_ids = list(range(chunk))
            self._chunk_lps = [-1.0] * chunk

        async def start(self): ...

        async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None, final_only=False):
            for start in range(0, tokens, chunk):
                if chunk_delay_s:
                    await anyio.sleep(chunk_delay_s)  # paced like a real engine's stream
                else:
                    await anyio.lowlevel.checkpoint()
                n = min(chunk, tokens - start)
                last = start + n >= tokens
                yield TokenChunk(self._chunk_ids[:n], self._chunk_lps[:n], finished=last,
                                 finish_reason="length" if last else None,
                                 version_spans=[VersionSpan(self.version, 0, tokens)] if last else None)

        async def abort(self, request_id): ...
        async def pause(self, mode="keep", clear_cache=True): ...
        async def resume(self): ...
        async def is_paused(self): return False
        async def healthy(self): return True
        async def set_weight_version(self, version): self.version = version
        async def reset_prefix_cache(self): ...
        async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
            # The swap extension's answers, instantly: a version staged is ready at once.
            if swap_delay_s and method.startswith("swap_") and (delayed is None or method in delayed):
                await anyio.sleep(swap_delay_s)
                self.swap_delayed_s += swap_delay_s
            if method == "swap_stage":
                self.staged = json.loads(args[0])["version"]
            if method == "swap_status":
                return [{"state": "staged", "version": self.staged}]
            if method == "swap_apply":
                return [{"version": self.staged, "requests": {}}]
            return [{}]
        async def shutdown(self): ...

    return ZeroLatencyEngine()


class InstantTrainer:
    """Answers every batch at once with a StepDone (advantages etc. left empty: not measured)."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.send_stream, self.recv_stream = anyio.create_memory_object_stream(100)
        self.alive = True
        self.process = None
        self.step_s = step_s  # > 0: each step takes this long (a version every step_s at most)

    @property
    def link(self):
        return self

    async def send(self, batch, timeout_s: float = 30.0) -> None:
        from orchestrator.trainer.link import StepDone

        if self.step_s:
            await anyio.sleep(self.step_s)
        await self.send_stream.send(StepDone(step=batch.step, version=batch.step, loss=0.0, reward_mean=1.0,
                                             metrics={}, seconds=0.0,
                                             rollout_ids=[s.rollout_id for s in batch.samples],
                                             advantages=b"", log_ratio_mean=b"", log_ratio_max_abs=b""))

    async def recv(self, timeout_s: float):
        with anyio.fail_after(timeout_s):
            return await self.recv_stream.receive()


class FixedTask:
    """One prompt; a score that costs `score_ms` of Python work (a busy loop holding the GIL, like
    a real reward function's parsing), or nothing. Picklable: a process pool's workers build it
    with `functools.partial(FixedTask, score_ms)`."""

    rows = None

    def __init__(self, score_ms: float = 0.0) -> None:
        from orchestrator.tasks.base import Prompt

        self._prompt = Prompt(prompt_id="bench", index=0, text="bench", token_ids=tuple(range(1, 17)))
        self.score_s = score_ms / 1000

    async def prompt(self, index: int):
        return self._prompt

    def score_sync(self, prompt, completion_token_ids):
        if self.score_s:
            end = time.perf_counter() + self.score_s
            while time.perf_counter() < end:
                pass
        return {"reward": 1.0}


class InlineScorer:
    """Scores on the event loop itself: the baseline that costs no hop (a free score only)."""

    def __init__(self, task) -> None:
        self.task = task

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def score(self, prompt, completion_token_ids):
        return self.task.score_sync(prompt, completion_token_ids)


class BenchRun:
    """What `RunLoop` needs of a `Run`, with the fakes above and the real recorder and journal.
    `pool`: "thread" or "process" (`task.score_pool`), or "inline" (on the loop: a baseline)."""

    def __init__(self, run_dir: Path, concurrency: int, rollouts: int, score_ms: float = 0.0,
                 tokens: int = TOKENS, pool: str = "thread", chunk_delay_s: float = 0.0, engines: int = 1,
                 chunk: int = CHUNK, recording: bool = True, batch_scale: int = 1) -> None:
        from orchestrator.config.run import RunConfig, RunSection, SchedulerConfig
        from orchestrator.fleet.fleet import Fleet
        from orchestrator.observe.metrics import RunMetrics
        from orchestrator.observe.progress import Progress, ProgressState
        from orchestrator.run.recording import Recorder
        from orchestrator.run.resume import DispatchJournal
        from orchestrator.run.startup import StartupClock
        from orchestrator.scheduling import scheduler as sch
        from orchestrator.scoring.scorer import make_scorer
        from replay.records import PolicyIdentity, SamplingSettings

        group = 8
        batch_groups = max(1, concurrency // group) * batch_scale
        batch = group * batch_groups
        self.max_steps = max(2, rollouts // batch)
        scheduler = SchedulerConfig(group_size=group, batch_groups=batch_groups, max_off_policy_steps=4,
                                    max_inflight=concurrency)
        self.config = RunConfig(scheduler=scheduler, run=RunSection(shutdown_grace_s=30.0))
        self.run_dir = run_dir
        self.metrics = RunMetrics()
        if recording:
            self.recorder = Recorder(run_dir, on_record=self.metrics.on_record)
        else:  # loop_ablations' records_not_written
            from orchestrator.bench.loop_costs import UnwrittenRecords

            self.recorder = UnwrittenRecords()
        self.journal = DispatchJournal(run_dir)
        ids = [f"fake-{i}" for i in range(engines)]
        self.fleet = Fleet([fake_engine(e, tokens, chunk_delay_s, chunk=chunk) for e in ids])
        self.scheduler = sch.Scheduler(scheduler, ids, max_steps=self.max_steps)
        self.trainer = InstantTrainer()
        self.task = FixedTask(score_ms)
        # No spare process: its build would run inside the timed window (nothing here times out).
        self.scorer = InlineScorer(self.task) if pool == "inline" else make_scorer(
            self.task, pool=pool, workers=4, timeout_s=60.0, builder=functools.partial(FixedTask, score_ms),
            spare=False)
        self.evaluator = None
        self.tracking = None
        self.startup = StartupClock()
        self.progress = Progress(ProgressState(self.max_steps), "none")
        self.identity = PolicyIdentity("bench", "", "", "float32", logprobs_mode="raw_logprobs")
        self.sampling = SamplingSettings(max_tokens=tokens)
        self.http = None

    def record_activation(self, record) -> None: ...

    def tensorboard_step(self, m, staleness, components=None) -> None: ...


async def orchestrator_rate(concurrency: int, rollouts: int, score_ms: float = 0.0, pool: str = "thread",
                            chunk_delay_s: float = 0.0, tokens: int = TOKENS, engines: int = 1,
                            loop_lags: list[float] | None = None, chunk: int = CHUNK, recording: bool = True,
                            batch_scale: int = 1, record_build: bool = False) -> dict:
    """Rollouts/s of the real RunLoop, and the event loop thread's CPU per rollout (and every
    thread's: `loop_costs.cpu_by_role`). `engines` fake engines share the rollouts; `loop_lags`
    (a list) gets the event loop's lag, sampled all along (`sample_loop_lag`). `recording`,
    `batch_scale`, `record_build`: see `loop_costs.loop_ablations`."""
    from orchestrator.bench.loop_costs import cpu_by_role, record_build_us, thread_cpu_s
    from orchestrator.run.loop import RunLoop

    with tempfile.TemporaryDirectory(prefix="inflight-bench-") as tmp:
        run = BenchRun(Path(tmp), concurrency, rollouts, score_ms, tokens=tokens, pool=pool,
                       chunk_delay_s=chunk_delay_s, engines=engines, chunk=chunk, recording=recording,
                       batch_scale=batch_scale)
        loop = RunLoop(run)
        run.loop = loop
        await run.scorer.start()
        try:
            async with anyio.create_task_group() as tg:
                if loop_lags is not None:
                    tg.start_soon(sample_loop_lag, loop_lags)
                started, cpu, threads = time.perf_counter(), time.thread_time(), thread_cpu_s()
                with anyio.fail_after(600):
                    await loop.main(run.scheduler.start())
                elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu
                threads = cpu_by_role(threads, thread_cpu_s(), run.scheduler.done_steps * run.scheduler.batch_size)
                tg.cancel_scope.cancel()
        finally:
            await run.scorer.aclose()
        consumed = run.scheduler.done_steps * run.scheduler.batch_size
        await run.recorder.flush()
        run.recorder.close()
        run.journal.close()
        row = {"rollouts": consumed, "seconds": elapsed, "rollouts_per_s": consumed / elapsed,
               "records": run.recorder.written, "loop_cpu_us_per_rollout": 1e6 * cpu / consumed}
        if threads is not None:
            row["cpu_us_per_rollout_by_thread"] = threads
        if record_build:
            row["record_build_us"] = await record_build_us(run)
        return row


async def sample_loop_lag(lags: list[float], period_s: float = 0.01) -> None:
    """Appends, until cancelled, how late each `period_s` sleep woke (seconds): what every task
    on the event loop waits beyond its due time, at that moment."""
    while True:
        before = time.perf_counter()
        await anyio.sleep(period_s)
        lags.append(max(0.0, time.perf_counter() - before - period_s))


async def bare_rate(concurrency: int, rollouts: int, chunk: int = CHUNK) -> dict:
    """The simplest alternative: N tasks, each draining the fake engine's stream in a loop."""
    from orchestrator.engines.base import SamplingSettings

    engine = fake_engine("bare", chunk=chunk)
    sampling = SamplingSettings(max_tokens=TOKENS)
    remaining = [rollouts]

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            tokens: list[int] = []
            async for chunk in engine.generate("r", [1], sampling):
                tokens.extend(chunk.token_ids)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    elapsed = time.perf_counter() - started
    return {"rollouts": rollouts, "seconds": elapsed, "rollouts_per_s": rollouts / elapsed}


def digits_speedup(steps: int) -> dict:
    """The embedded default, async then sync, `steps` trainer steps each (real engine)."""
    import subprocess

    out: dict = {}
    for mode in ("async", "sync"):
        with tempfile.TemporaryDirectory(prefix=f"inflight-bench-{mode}-") as tmp:
            config = Path(tmp) / "config.toml"
            config.write_text(f'[scheduler]\nmode = "{mode}"\n[run]\nprogress = "none"\ntensorboard = false\n'
                              f'[http]\nenabled = false\n')
            started = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", "run", str(config), "--run-dir",
                                   str(Path(tmp) / "run"), "--max-steps", str(steps)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{mode} run failed: {proc.stderr[-2000:]}")
            lines = [json.loads(x) for x in (Path(tmp) / "run" / "orchestrator.jsonl").read_text().splitlines()
                     if x.startswith("{")]
            first = next(x for x in lines if x.get("event") == "trainer.step_done")
            last = next(x for x in reversed(lines) if x.get("event") == "trainer.step_done")
            out[mode] = {"wall_s": time.perf_counter() - started,
                         "steps_per_min": 60 * (steps - 1) / (_t(last) - _t(first))}
            if mode == "async":  # the share of generated tokens dropped as too stale (issue 18)
                from replay.query import stats_from_log

                out["dropped_stale_token_share"] = stats_from_log(Path(tmp) / "run")["dropped_stale_token_share"]
    out["async_speedup"] = out["async"]["steps_per_min"] / out["sync"]["steps_per_min"]
    return out


def _t(line: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


async def run_bench(args: argparse.Namespace) -> dict:
    result: dict = {"tokens_per_rollout": TOKENS, "chunk_tokens": CHUNK}
    rates = {}
    for c in args.concurrency:
        n = max(args.rollouts, 2 * c)
        bare = await bare_rate(c, n)
        orch = await orchestrator_rate(c, n)
        rates[c] = orch["rollouts_per_s"]
        result[f"bare_c{c}"] = bare
        result[f"orchestrator_c{c}"] = orch
        result[f"overhead_ratio_c{c}"] = orch["rollouts_per_s"] / bare["rollouts_per_s"]
        if c == 64:  # where the c64 rollout's cost goes: per rollout against per chunk
            from orchestrator.bench.loop_costs import loop_split

            result.update(await loop_split(orchestrator_rate, bare_rate, n, TOKENS, CHUNK, orch, bare))
    if args.loop_ablations:
        from orchestrator.bench.loop_costs import loop_ablations

        result.update(await loop_ablations(orchestrator_rate, bare_rate, args.rollouts, args.loop_ablations))
    if 64 in rates and 8192 in rates:
        result["scale_ratio_8192_vs_64"] = rates[8192] / rates[64]
    score_rollouts = args.rollouts if args.score_rollouts is None else args.score_rollouts
    if score_rollouts:
        from orchestrator.bench.scoring_overhead import score_overhead, score_overhead_paced

        result.update(await score_overhead(orchestrator_rate, score_rollouts))
        result.update(await score_overhead_paced(orchestrator_rate))
    sizes = [n for n in args.fleet_scale if n > 0]
    if sizes:
        from orchestrator.bench.fleet_scale import fleet_scale

        result.update(await fleet_scale(fake_engine, orchestrator_rate, sizes, rollouts=args.fleet_scale_rollouts,
                                        slow_delay_s=args.fleet_scale_slow_ms / 1000))
    if args.join_engines:
        from orchestrator.bench.fleet_join import join_to_first_rollout

        result.update(await join_to_first_rollout(BenchRun, fake_engine, engines=args.join_engines))
    if args.soak_steps:
        result.update(await soak(args.soak_steps, max(1, args.soak_steps // 10)))
    if args.multi_turn_episodes:
        from orchestrator.bench.multi_turn import multi_turn_overhead
        from orchestrator.model import ensure_model

        model = await anyio.to_thread.run_sync(lambda: ensure_model("models/tiny-rl", preset="tiny-rl"))
        result.update(await multi_turn_overhead(BenchRun, orchestrator_rate, str(model),
                                                episodes=args.multi_turn_episodes))
    return result


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def soak(steps: int = 2000, warmup: int = 200, concurrency: int = 16, tokens: int = 16) -> dict:
    """The real RunLoop for `steps` trainer steps on the zero-latency fake engine and the instant
    fake trainer; resident memory after `warmup` steps and at the end. Nothing the loop holds per
    rollout outlives its consumption, so the ratio stays near 1 (goal <= 1.1): what still grows
    is the live statistics' columns (a few numbers per rollout, what /stats answers from)."""
    import gc

    from orchestrator.run.loop import RunLoop

    marks: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="inflight-soak-") as tmp:
        run = BenchRun(Path(tmp), concurrency, concurrency * steps, tokens=tokens)
        run.scheduler.max_steps = run.max_steps = steps
        loop = RunLoop(run)
        run.loop = loop

        def measure(line) -> None:
            if line.step in (warmup, steps):
                gc.collect()
                marks[line.step] = rss_bytes()

        run.progress.step = measure
        started = time.perf_counter()
        with anyio.fail_after(3600):
            await loop.main(run.scheduler.start())
        elapsed = time.perf_counter() - started
        await run.recorder.flush()
        run.recorder.close()
        run.journal.close()
        held = len(loop.inflight), len(loop.prompts)
    return {"soak_steps": steps, "soak_rollouts": steps * run.scheduler.batch_size, "soak_seconds": elapsed,
            "rss_after_warmup_mb": marks[warmup] / 2**20, "rss_end_mb": marks[steps] / 2**20,
            "rss_growth_ratio": marks[steps] / marks[warmup], "inflight_records_held_at_end": held[0],
            "prompts_held_at_end": held[1]}


def bench_command(args: argparse.Namespace) -> int:
    from orchestrator.observe.logging import configure_logging

    configure_logging("json", "warning")
    result = anyio.run(run_bench, args)
    if args.generation_preset != "none":
        from orchestrator.bench.generation import generation_ratio

        result.update(anyio.run(lambda: generation_ratio(preset=args.generation_preset)))
    if args.digits_steps:
        result.update(digits_speedup(args.digits_steps))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for row in result.get("fleet_scale", []):
            print(f"fleet_scale engines={row['engines']:<4d} rollouts/s={row['rollouts_per_s']:8.1f} "
                  f"loop_lag_p99_ms={row['loop_lag_p99_ms']:6.1f} activation_ms={row['activation_ms']:7.1f} "
                  f"(cpu {row['activation_cpu_ms']:.1f}, busy {row['activation_busy_ms']:.1f}, 10 ms RPCs {row['activation_latent_ms']:.1f})")
        for key, value in result.items():
            if not isinstance(value, (dict, list)):
                print(f"{key:28s} {value:.3f}" if isinstance(value, float) else f"{key:28s} {value}")
    return 0
