"""The running half of `inflight bench activation`: engine, streaming load, interleaved rounds.

See `orchestrator.bench.activation` for what is measured and `activation_measure` for how.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from orchestrator.bench.activation_lora import MAX_LORAS, RANK, LoraRow
from orchestrator.bench.activation_measure import (
    Sample,
    measure,
    median_interval,
    summarize,
)

STRATEGIES = ("baseline", "pause_swap", "double_buffer", "pause_free", "lora")
#: The stagings the throughput-during-transfer ratio is measured over (double-buffer staging).
THROUGHPUT_FROM = ("double_buffer", "pause_free")
PUBLISH_TIMEOUT_S = 600.0
RPC_TIMEOUT_S = 120.0
#: How long to wait for the engine's normal step rhythm after an update (a recompute can take seconds).
RHYTHM_TIMEOUT_S = 120.0
RHYTHM_STEPS = 3


class Load:
    """Continuous streaming load; records the arrival time and size of every chunk."""

    def __init__(self, prompt: list[int], streams: int) -> None:
        from orchestrator.bench.activation_lora import AdapterLoad

        self.prompt = prompt
        self.streams = streams
        self.adapters = AdapterLoad()  # the live adapter once the lora row activated one
        self.arrivals: list[tuple[float, int]] = []  # (monotonic arrival, tokens), in order
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
                adapter = self.adapters.adapter
                kwargs = {"adapter": adapter} if adapter is not None else {}
                version = adapter.int_id if adapter is not None else 0
                self.adapters.in_use[version] += 1
                try:
                    async for chunk in engine.generate(f"bench-{i}-{k}-{os.urandom(3).hex()}", self.prompt, sampling,
                                                       **kwargs):
                        if chunk.token_ids:
                            self.arrivals.append((time.monotonic(), len(chunk.token_ids)))
                            self.tokens += len(chunk.token_ids)
                        if self.stop:
                            break
                finally:
                    self.adapters.in_use[version] -= 1

        async with anyio.create_task_group() as tg:
            for i in range(self.streams):
                tg.start_soon(stream, i)


class Timed:
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

    def reset(self) -> None:
        self.pause_requested = self.resume_returned = None

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


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.samples: list[Sample] = []
        self.steps: list[list[float]] = []  # [start, end, wall_end, requests, tokens] per engine step
        self.version = 0
        self.live = 0
        self.typical_step = 0.1

    # -- publishing, off the measuring loop ---------------------------------------------------
    async def _in_process(self, fn, *args):
        import anyio
        import anyio.to_process

        with anyio.fail_after(PUBLISH_TIMEOUT_S):
            return await anyio.to_process.run_sync(fn, *args, cancellable=True, limiter=self.limiter)

    async def publish(self) -> int:
        from orchestrator.bench.activation_publish import publish_version

        self.version += 1
        await self._in_process(publish_version, str(self.model_dir), str(self.root), self.version)
        return self.version

    async def fetch_steps(self) -> None:
        since = self.steps[-1][1] if self.steps else float("-inf")
        answer = (await self.raw.collective_rpc("swap_step_times", args=(json.dumps({"since": since}),),
                                                timeout=RPC_TIMEOUT_S))[0]
        self.steps.extend(s for s in answer["steps"] if s[1] > since)

    # -- the run ------------------------------------------------------------------------------
    async def run(self) -> dict:
        import anyio

        from orchestrator.bench.activation_publish import describe
        from orchestrator.config.run import EngineConfig
        from orchestrator.engines.inproc import InProcessEngine
        from orchestrator.model import ensure_model

        args = self.args
        self.limiter = anyio.CapacityLimiter(1)  # one publishing process, reused (it caches the base)
        self.model_dir = ensure_model(args.model, preset="small")
        self.root = Path(tempfile.mkdtemp(prefix="inflight-bench-activation-"))
        info = await self._in_process(describe, str(self.model_dir))
        self.plan_json = info["plan"]
        # LoRA enabled for every row: the lora row runs on the same engine as the full-model ones.
        config = EngineConfig(model=str(self.model_dir), kind="inproc", max_model_len=1024, max_num_seqs=32,
                              enable_prefix_caching=True, enable_lora=True, max_lora_rank=RANK, max_loras=MAX_LORAS,
                              worker_extension_cls="transports.swap.SwapWorkerExtension")
        self.raw = InProcessEngine(config, "bench-activation")
        self.engine = Timed(self.raw)
        load = Load([3 + (i * 7) % 200 for i in range(32)], args.streams)
        self.lora = LoraRow(self.engine, self.root, load.adapters)
        idle_windows: list[tuple[float, float]] = []
        try:
            await self.raw.start()
            await self.fetch_steps()  # installs the worker's step clock
            async with anyio.create_task_group() as tg:
                tg.start_soon(load.run, self.raw)
                with anyio.fail_after(300):
                    while load.tokens < args.streams * 4:
                        await anyio.sleep(0.05)
                await anyio.sleep(1.0)  # warm
                for rep in range(args.repetitions):
                    i0 = time.monotonic()
                    await anyio.sleep(args.idle_seconds)
                    idle_windows.append((i0, time.monotonic()))
                    await self.fetch_steps()
                    durations = [s[1] - s[0] for s in self.steps if i0 <= s[0] and s[1] <= idle_windows[-1][1]]
                    self.typical_step = statistics.median(durations) if durations else 0.1
                    for name in STRATEGIES:
                        sample = await self.one(name, rep)
                        sample.idle_rate_window = idle_windows[-1]
                        self.samples.append(sample)
                    await self.fetch_steps()
                load.stop = True
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.raw.shutdown()
            shutil.rmtree(self.root, ignore_errors=True)
        result = self.results(info["parameters"], load, idle_windows)
        result["lora_row"] = self.lora.summary(result)
        return result

    async def one(self, name: str, rep: int) -> Sample:
        """One activation of `name` and its idle twin."""
        import anyio

        from orchestrator.fleet.fleet import Fleet
        from transports.filesystem import version_dir

        settle = self.args.settle_seconds
        if name == "lora":
            return await self.one_lora(rep)
        version = await self.publish()  # another process; done before the window opens
        await anyio.sleep(settle)
        engine, raw = self.engine, self.raw
        engine.reset()
        staging = None
        recompute = self.args.kv_policy == "recompute"
        if name == "baseline":
            await engine.pause("keep", recompute)
            await raw.collective_rpc("swap_load_dir", args=(json.dumps({"path": str(version_dir(self.root, version))}),),
                                     timeout=RPC_TIMEOUT_S)
            await raw.reset_prefix_cache()
            await raw.set_weight_version(version)
            await engine.resume()
            t0, t1 = engine.pause_requested, engine.resume_returned
        else:
            policy = "keep" if name == "pause_free" else self.args.kv_policy
            fleet = Fleet([engine], strategy=name, kv_policy=policy, live_version=self.live)
            await fleet.setup(self.plan_json, str(self.root), timeout_s=RPC_TIMEOUT_S)
            record = await fleet.activate(version)
            t1 = time.monotonic()
            if record.outcome != "activated":
                raise RuntimeError(f"{name}: activation {record.outcome}: {record.message}")
            begun = fleet.coordinator.started_at
            staged_at = begun + max((eo.transfer_s for eo in record.engines), default=0.0)
            staging = (begun, staged_at)
            # the update window: from the pause request, or (pause-free) the end of staging
            t0 = engine.pause_requested if name != "pause_free" and engine.pause_requested else staged_at
        self.live = version
        # The idle twin is measured in the engine's normal rhythm, not inside a recompute that
        # the update started (its steps can last seconds).
        in_rhythm = await self.back_in_rhythm(t1)
        await anyio.sleep(settle)
        idle_t0 = time.monotonic()
        await anyio.sleep((t1 - t0) + settle)  # the idle twin, and time for the token that ends it
        return Sample(name, rep, t0, t1, idle_t0, paused_ms=0.0 if name == "pause_free" else engine.paused_ms(),
                      staging=staging, in_rhythm=in_rhythm)

    async def one_lora(self, rep: int) -> Sample:
        """One adapter version: published (another process), activated, and its idle twin."""
        import anyio

        from orchestrator.bench.activation_lora import publish_adapter

        self.version += 1
        sizes = await self._in_process(publish_adapter, str(self.model_dir), str(self.root), self.version)
        self.lora.sizes.append((sizes["adapter_bytes"], sizes["model_bytes"]))
        await anyio.sleep(self.args.settle_seconds)
        t0, t1, staging = await self.lora.activate(self.version, self.live)
        self.live = self.version
        in_rhythm = await self.back_in_rhythm(t1)
        await anyio.sleep(self.args.settle_seconds)
        idle_t0 = time.monotonic()
        idle_s = max(t1 - t0, staging[1] - staging[0])  # the twin of the flip window and of the staging
        await anyio.sleep(idle_s + self.args.settle_seconds)
        return Sample("lora", rep, t0, t1, idle_t0, paused_ms=0.0, staging=staging, in_rhythm=in_rhythm,
                      idle_s=idle_s)

    async def back_in_rhythm(self, after: float) -> bool:
        """Waits (bounded) until `RHYTHM_STEPS` engine steps in a row ended after `after`, each
        no longer than twice the round's typical step (+5 ms). False on timeout."""
        import anyio

        limit = 2 * self.typical_step + 0.005
        deadline = time.monotonic() + RHYTHM_TIMEOUT_S
        while time.monotonic() < deadline:
            await anyio.sleep(0.1)
            await self.fetch_steps()
            run = 0
            for start, end, *_ in self.steps:
                if end > after:
                    run = run + 1 if end - start <= limit else 0
            if run >= RHYTHM_STEPS:
                return True
        return False

    def results(self, parameters: int, load: Load, idle_windows: list[tuple[float, float]]) -> dict:
        steps = sorted(self.steps, key=lambda s: s[1])
        engine_times = [s[1] for s in steps]
        engine_tokens = [(s[1], int(s[3])) for s in steps]
        client_times = [t for t, _ in load.arrivals]
        for sample in self.samples:
            measure(sample, engine_times, client_times, engine_tokens, load.arrivals)
        out: dict = {"model_parameters": parameters, "streams": self.args.streams,
                     "idle_seconds": self.args.idle_seconds,
                     "kv_policy": getattr(self.args, "kv_policy", "keep")}
        out.update(summarize(self.samples, STRATEGIES, throughput_from=THROUGHPUT_FROM))
        steps_ms = [median_interval(engine_times, a, b) for a, b in idle_windows]
        out["median_step_ms"] = sorted(steps_ms)[len(steps_ms) // 2] * 1e3 if steps_ms else 0.0
        out["engine_steps_recorded"] = len(steps)
        out["goals"] = {"stall_ratio": 10.0, "throughput_during_transfer_ratio": 0.8}
        out["idle_twins_out_of_rhythm"] = sum(1 for s in self.samples if not s.in_rhythm)
        out["samples"] = [{"strategy": s.strategy, "repetition": s.repetition,
                           **{k: round(v, 3) for k, v in s.measured.items()}} for s in self.samples]
        return out
