"""`inflight bench activation [--json]`: how long a weight update stalls generation, per strategy.

One real engine (a `small` model, >= 50M parameters, fp32) serves continuous streaming load;
in the same run, one update after another:

    baseline       pause, load the just-written filesystem checkpoint into the live model
                   (vLLM's reload, with its post-processing), resume: how prime-rl and NeMo-RL
                   apply full weights
    pause_swap     staged off-pause, copied into the live weights during the pause
    double_buffer  an engine-ready second copy prepared off-pause; pause, pointer flip, resume
    pause_free     the same flip between two engine steps, without a pause

For each: `stall_ms` = the longest interval without a token during the update minus the median
interval between engine steps (measured in the same run, without an update); `paused_ms` = from
the pause request until resume returns (0 for pause-free). `stall_ratio` = baseline stall over
pause-free stall (goal >= 10). `throughput_during_transfer_ratio` = tokens/s while a version is
being staged (double buffering: receive + repack on the staging thread) over tokens/s with no
update (goal >= 0.8: the staging thread is pinned off the worker's core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL_DIR = Path(".inflight") / "bench-models" / "small"


def register(bench_sub) -> None:
    p = bench_sub.add_parser("activation", help="stall and pause per activation strategy under streaming load")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR),
                   help="model directory (built with preset 'small' when missing)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streaming requests")
    p.add_argument("--idle-seconds", type=float, default=3.0, help="window measured without an update")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=bench_command)


def bench_command(args: argparse.Namespace) -> int:
    import anyio

    import sys

    # vLLM and its engine processes log to stdout: keep it for the result alone.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        result = anyio.run(run_bench, args)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name in ("baseline", "pause_swap", "double_buffer", "pause_free"):
            r = result[name]
            print(f"{name:14s} stall_ms={r['stall_ms']:9.1f}  paused_ms={r['paused_ms']:9.1f}  "
                  f"max_gap_ms={r['max_gap_ms']:9.1f}")
        print(f"median step interval  {result['median_step_ms']:.1f} ms")
        print(f"stall_ratio (baseline / pause_free)  {result['stall_ratio']:.1f}  (goal >= 10)")
        print(f"throughput_during_transfer_ratio     {result['throughput_during_transfer_ratio']:.2f}  (goal >= 0.8)")
    return 0


class _Load:
    """Continuous streaming load; records the arrival time of every chunk."""

    def __init__(self, fleet_or_engine, prompt: list[int], streams: int) -> None:
        self.target = fleet_or_engine
        self.prompt = prompt
        self.streams = streams
        self.arrivals: list[float] = []
        self.per_stream: dict[int, list[float]] = {i: [] for i in range(streams)}
        self.tokens = 0
        self.stop = False

    async def run(self, engine) -> None:
        import anyio

        from orchestrator.engines.base import SamplingSettings

        sampling = SamplingSettings(temperature=1.0, max_tokens=400, ignore_eos=True)

        async def stream(i: int) -> None:
            k = 0
            while not self.stop:
                k += 1
                async for chunk in engine.generate(f"bench-{i}-{k}-{os.urandom(3).hex()}", self.prompt, sampling):
                    now = time.monotonic()
                    if chunk.token_ids:
                        self.arrivals.append(now)
                        self.per_stream[i].append(now)
                        self.tokens += len(chunk.token_ids)
                    if self.stop:
                        break

        async with anyio.create_task_group() as tg:
            for i in range(self.streams):
                tg.start_soon(stream, i)

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(1 for t in self.arrivals if t0 <= t <= t1)

    def max_gap(self, t0: float, t1: float) -> float:
        """Longest interval without a token that overlaps [t0, t1] (up to the first token after t1)."""
        before = [t for t in self.arrivals if t < t0]
        inside = [t for t in self.arrivals if t0 <= t <= t1]
        after = [t for t in self.arrivals if t > t1]
        points = ([before[-1]] if before else [t0]) + inside + ([after[0]] if after else [t1])
        return max((b - a for a, b in zip(points, points[1:])), default=0.0)

    def median_step(self, t0: float, t1: float) -> float:
        gaps = []
        for times in self.per_stream.values():
            window = [t for t in times if t0 <= t <= t1]
            gaps += [b - a for a, b in zip(window, window[1:])]
        return statistics.median(gaps) if gaps else 0.0


class _Timed:
    """Records when pause was requested and when resume returned (delegates everything)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.engine_id = inner.engine_id
        self.pause_requested: float | None = None
        self.resume_returned: float | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)

    async def pause(self, mode="keep", clear_cache=True):
        self.pause_requested = time.monotonic()
        await self.inner.pause(mode, clear_cache)

    async def resume(self):
        await self.inner.resume()
        self.resume_returned = time.monotonic()

    def paused_ms(self) -> float:
        if self.pause_requested is None or self.resume_returned is None:
            return 0.0
        return (self.resume_returned - self.pause_requested) * 1e3


async def run_bench(args: argparse.Namespace) -> dict:
    import anyio
    import torch

    from orchestrator.config import EngineConfig
    from orchestrator.engines.inproc import InProcessEngine
    from orchestrator.fleet import Fleet
    from orchestrator.model import ensure_model
    from transports.filesystem import FilesystemSender, version_dir
    from transports.refit.plan import RefitPlan

    model_dir = ensure_model(args.model, preset="small")
    from safetensors.torch import load_file

    base: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        base.update(load_file(f))
    n_params = sum(v.numel() for v in base.values())
    root = Path(tempfile.mkdtemp(prefix="inflight-bench-activation-"))
    plan = RefitPlan.build({k: (tuple(v.shape), v.dtype) for k, v in base.items()}, wire_dtype=None)

    def publish(version: int) -> None:
        g = torch.Generator().manual_seed(version)
        state = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        sender = FilesystemSender(root, keep_last=3, fsync=False)
        sender.begin(version, plan.bucket_count)
        for header, payload in plan.pack(state, version=version):
            sender.send(header, payload)
        sender.commit(version)

    config = EngineConfig(model=str(model_dir), kind="inproc", max_model_len=1024, max_num_seqs=32,
                          enable_prefix_caching=True,
                          worker_extension_cls="transports.swap.SwapWorkerExtension")
    raw = InProcessEngine(config, "bench-activation")
    engine = _Timed(raw)
    await raw.start()
    results: dict = {"model_parameters": n_params, "streams": args.streams}
    load = _Load(engine, [3 + (i * 7) % 200 for i in range(32)], args.streams)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run, raw)
            while load.tokens < args.streams * 4:
                await anyio.sleep(0.05)
            await anyio.sleep(1.0)  # warm
            t0 = time.monotonic()
            await anyio.sleep(args.idle_seconds)
            t1 = time.monotonic()
            idle_rate = load.tokens_between(t0, t1) / (t1 - t0)
            median_step = load.median_step(t0, t1)
            results["median_step_ms"] = median_step * 1e3
            results["idle_tokens_per_s"] = idle_rate
            version = 0

            # -- baseline: load-in-pause ------------------------------------------------------
            version += 1
            publish(version)
            engine.pause_requested = engine.resume_returned = None
            s0 = time.monotonic()
            await engine.pause("keep", True)
            await raw.collective_rpc("swap_load_dir", args=(json.dumps({"path": str(version_dir(root, version))}),),
                                     timeout=300)
            await raw.reset_prefix_cache()
            await raw.set_weight_version(version)
            await engine.resume()
            s1 = time.monotonic()
            await anyio.sleep(0.5)
            results["baseline"] = _entry(load, s0, s1, median_step, engine.paused_ms())
            live = version

            # -- the three strategies through the fleet -------------------------------------
            for name in ("pause_swap", "double_buffer", "pause_free"):
                policy = "keep" if name == "pause_free" else "recompute"
                fleet = Fleet([engine], strategy=name, kv_policy=policy, live_version=live)
                await fleet.setup(plan.encode().decode(), str(root), timeout_s=120)
                if name == "double_buffer":
                    # the first staging also builds the second copy; measure throughput meanwhile
                    version += 1
                    publish(version)
                    results["throughput"] = await _staging_throughput(raw, load, version, idle_rate)
                version += 1
                publish(version)
                engine.pause_requested = engine.resume_returned = None
                s0 = time.monotonic()
                record = await fleet.activate(version)
                s1 = time.monotonic()
                if record.outcome != "activated":
                    raise RuntimeError(f"{name}: activation {record.outcome}: {record.message}")
                live = version
                # the update window: from the end of staging (when the engine is touched) to the end
                staged_at = s0 + max((eo.transfer_s for eo in record.engines), default=0.0)
                await anyio.sleep(0.5)
                results[name] = _entry(load, staged_at, s1, median_step,
                                       0.0 if name == "pause_free" else engine.paused_ms())
                results[name]["staging_ms"] = (staged_at - s0) * 1e3
            load.stop = True
            tg.cancel_scope.cancel()
    finally:
        await raw.shutdown()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    base_stall = results["baseline"]["stall_ms"]
    free_stall = results["pause_free"]["stall_ms"]
    results["stall_ratio"] = base_stall / max(free_stall, 1e-3 * max(1.0, results["median_step_ms"]))
    results["throughput_during_transfer_ratio"] = results["throughput"]["ratio"]
    results["goals"] = {"stall_ratio": 10.0, "throughput_during_transfer_ratio": 0.8}
    return results


def _entry(load: _Load, t0: float, t1: float, median_step: float, paused_ms: float) -> dict:
    gap = load.max_gap(t0, t1)
    return {"stall_ms": max(0.0, (gap - median_step) * 1e3), "paused_ms": paused_ms, "max_gap_ms": gap * 1e3}


async def _staging_throughput(raw, load: _Load, version: int, idle_rate: float) -> dict:
    import anyio

    t0 = time.monotonic()
    await raw.collective_rpc("swap_stage", args=(json.dumps({"version": version}),), timeout=60)
    while True:
        status = (await raw.collective_rpc("swap_status", timeout=60))[0]
        if status["state"] != "staging":
            break
        await anyio.sleep(0.02)
    t1 = time.monotonic()
    await raw.collective_rpc("swap_drop", timeout=60)
    if status["state"] != "staged":
        raise RuntimeError(f"staging failed: {status}")
    rate = load.tokens_between(t0, t1) / max(t1 - t0, 1e-9)
    return {"staging_s": t1 - t0, "tokens_per_s": rate, "idle_tokens_per_s": idle_rate,
            "ratio": rate / idle_rate if idle_rate else 0.0}
