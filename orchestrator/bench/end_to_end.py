"""The `end_to_end` row of `inflight bench transports --end-to-end`: per transport, the bytes a
trainer process publishes until the version is live on two engines, against the sum of the
transport's raw transfer time and the measured activation time, in the same run.

Per transport (the `small` preset, 69M parameters, fp32 on the wire; two in-process vLLM engines
running `transports.swap.SwapWorkerExtension`, continuous streaming load on both):

* **raw transfer** (`raw_transfer_s`): the same trainer weights through the same transport into
  two plain receiving processes (`transports.local.ProcessEngine`: receive, validate, stage; no
  engine), the best of `rounds` versions after a warm-up.
* **end to end** (`end_to_end_s`): a trainer process (`transports.bench.end_to_end`) starts
  `sync_weights()` at t0 (its `time.monotonic()`, system-wide); the fleet activates the version
  meanwhile (`Fleet.activate`, `pause_free` by default); the version is live on both engines when
  `activate` returns (t1). Best of `rounds` after a warm-up version.
* **activation** (`activation_s`): t1 minus the moment the last engine reported the version
  staged (`swap_status`).
* `ratio` = (raw transfer + activation) / end to end (1.0: the path adds nothing to its parts).
* `tokens_per_s_transfer`: the engines' tokens/s (client side, both engines) from t0 to the
  last staged report; `tokens_per_s_idle`: the same over an equal window with no transfer,
  taken right before; `throughput_during_transfer_ratio` the quotient.

The engine side imports orchestrator; the trainer side lives in `transports` (which never
imports orchestrator).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL_DIR = Path(".inflight") / "bench-models" / "small"
PROMPT = [5, 17, 42, 8, 23, 11, 3, 29] * 4
RPC_TIMEOUT_S = 300.0


class _StageSpy:
    """An `Engine` proxy that notes when its worker first reports a version staged."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.engine_id = inner.engine_id
        self.staged_at: dict[int, float] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)

    async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        result = await self.inner.collective_rpc(method, args=args, kwargs=kwargs, timeout=timeout)
        if method == "swap_status":
            first = result[0] if isinstance(result, list) and result else result
            if isinstance(first, str):
                first = json.loads(first)
            if isinstance(first, dict) and first.get("state") == "staged" and first.get("version") is not None:
                self.staged_at.setdefault(int(first["version"]), time.monotonic())
        return result


class _Tokens:
    """Streaming load over a fleet, with (monotonic time, tokens so far) samples."""

    def __init__(self, fleet, engine_ids: list[str], streams: int) -> None:
        self.fleet = fleet
        self.engine_ids = engine_ids
        self.streams = streams
        self.total = 0
        self.samples: list[tuple[float, int]] = []
        self.stop = False

    async def run(self) -> None:
        import anyio

        from orchestrator.engines.base import SamplingSettings

        sampling = SamplingSettings(temperature=1.0, max_tokens=256, ignore_eos=True)

        async def stream(i: int) -> None:
            while not self.stop:
                c = await self.fleet.generate(PROMPT, sampling, engine_id=self.engine_ids[i % len(self.engine_ids)])
                self.total += len(c.token_ids)

        async def sample() -> None:
            while not self.stop:
                live = sum(t.n_tokens for t in self.fleet.tracks.values())
                self.samples.append((time.monotonic(), self.total + live))
                await anyio.sleep(0.02)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sample)
            for i in range(self.streams):
                tg.start_soon(stream, i)

    def rate(self, start: float, end: float) -> float | None:
        """Tokens per second between two instants (nearest samples); None without two samples."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def raw_transfer_seconds(transport: str, model_dir: str, rounds: int, timeout_s: float) -> float:
    """Best `sync_weights()` time of the model into two plain receiving processes."""
    import torch

    from transports.bench.end_to_end import perturbed_state
    from transports.factory import TrainCluster, create_weight_synchronizer
    from transports.local import ProcessEngine
    from transports.lora import load_safetensors_dir

    base = load_safetensors_dir(model_dir, torch.float32)
    state = {k: v.clone() for k, v in base.items()}
    engines = [ProcessEngine(transport, timeout_s=timeout_s) for _ in range(2)]
    sync = create_weight_synchronizer(
        state_dict=lambda: state, engines=engines, colocated=transport in ("ipc", "http"), transport=transport,
        train_cluster=TrainCluster(), inference_world_size=2, wire_dtype=None, timeout_s=timeout_s)
    best = float("inf")
    try:
        sync.init_communicator()
        for i in range(rounds + 1):  # the first is a warm-up
            state.update(perturbed_state(base, 900 + i))
            sync.mark_stale()
            started = time.monotonic()
            sync.sync_weights()
            if i:
                best = min(best, time.monotonic() - started)
    finally:
        sync.shutdown()
        for e in engines:
            e.stop()
    return best


async def end_to_end(transports: list[str], *, model: str | None = None, rounds: int = 2, streams: int = 4,
                     strategy: str = "pause_free", timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
    """{transport: figures} (see the module docstring)."""
    import tempfile

    import anyio

    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.inproc import InProcessEngine
    from orchestrator.fleet.fleet import Fleet, FleetTimeouts
    from orchestrator.model import ensure_model
    from transports.bench.end_to_end import TrainerProcess, end_to_end_figures

    model_dir = str(ensure_model(model or DEFAULT_MODEL_DIR, preset="small"))
    raw = {t: await anyio.to_thread.run_sync(raw_transfer_seconds, t, model_dir, rounds, timeout_s)
           for t in transports}
    config = EngineConfig(model=model_dir, kind="inproc", max_model_len=1024, max_num_seqs=16,
                          worker_extension_cls="transports.swap.SwapWorkerExtension")
    engines = []
    results: dict[str, dict[str, Any]] = {}
    try:
        for i in range(2):
            engine = InProcessEngine(config, f"e2e-{i}")
            await engine.start()
            engines.append(engine)
        spies = [_StageSpy(e) for e in engines]
        ids = [e.engine_id for e in engines]
        live = 0
        for transport in transports:
            with tempfile.TemporaryDirectory(prefix="inflight-e2e-") as root:
                trainer = TrainerProcess({"transport": transport, "model_dir": model_dir, "engines": 2,
                                          "timeout_s": timeout_s, "root": root, "start_version": live})
                try:
                    hello = await anyio.to_thread.run_sync(trainer.read, timeout_s, abandon_on_cancel=True)
                    fleet = Fleet(spies, strategy=strategy, kv_policy="keep", live_version=live,
                                  fleet_timeouts=FleetTimeouts(rpc_s=RPC_TIMEOUT_S))
                    await fleet.setup(hello["plan"], root, timeout_s=timeout_s, transport=transport,
                                      engine_options=dict(zip(ids, hello["options"], strict=True)))
                    connected = await anyio.to_thread.run_sync(trainer.read, timeout_s, abandon_on_cancel=True)
                    if not connected.get("connected"):
                        raise RuntimeError(f"{transport}: the trainer could not connect: {connected}")
                    load = _Tokens(fleet, ids, streams)
                    samples = []
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(load.run)
                        await anyio.sleep(2.0)  # the load reaches its rhythm
                        for i in range(rounds + 1):  # the first is a warm-up
                            live += 1
                            window = samples[-1]["end_to_end_s"] if samples else 2.0
                            idle_start = time.monotonic()
                            await anyio.sleep(window)
                            idle = load.rate(idle_start, time.monotonic())
                            answer: dict = {}

                            async def publish(version=live, answer=answer, trainer=trainer) -> None:
                                trainer.send(cmd="sync", seed=1000 + version)
                                answer.update(await anyio.to_thread.run_sync(trainer.read, timeout_s,
                                                                             abandon_on_cancel=True))

                            async with anyio.create_task_group() as inner:
                                inner.start_soon(publish)
                                record = await fleet.activate(live)
                            live_at = time.monotonic()
                            if record.outcome != "activated" or not answer.get("ok"):
                                raise RuntimeError(f"{transport}: version {live} {record.outcome}: "
                                                   f"{record.message} / trainer {answer}")
                            staged_at = max(s.staged_at[live] for s in spies)
                            if i:
                                samples.append(end_to_end_figures(
                                    end_to_end_s=live_at - answer["started"], raw_transfer_s=raw[transport],
                                    activation_s=live_at - staged_at,
                                    tokens_per_s_transfer=load.rate(answer["started"], staged_at),
                                    tokens_per_s_idle=idle))
                        load.stop = True
                    best = min(samples, key=lambda s: s["end_to_end_s"])
                    results[transport] = {**best, "strategy": strategy, "engines": 2, "model": "small",
                                          "rounds": rounds, "samples": samples}
                finally:
                    await anyio.to_thread.run_sync(trainer.close)
    finally:
        for engine in engines:
            await engine.shutdown()
    return results


def run_end_to_end(transports: list[str], **kwargs: Any) -> dict[str, dict[str, Any]]:
    """Runs `end_to_end` with file descriptor 1 pointed at stderr meanwhile: vLLM's engine
    processes (which inherit it) and this process's logs print there, and the stdout that
    carries `--json` stays pure."""
    import sys

    import anyio

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        return anyio.run(lambda: end_to_end(transports, **kwargs))
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
