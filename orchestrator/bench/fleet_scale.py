"""`inflight bench orchestrator --fleet-scale 1 16 64 256`: the orchestrator with hundreds of engines.

One row per fleet size N (key `fleet_scale`), all on the zero-latency fake engine of
`orchestrator/bench/orchestrator.py` (its `collective_rpc` answers the swap RPCs at once):

* `rollouts_per_s`: the real `RunLoop` (`orchestrator_rate`) with N fake engines and the SAME
  total concurrency as the `orchestrator_c64` measurement (64 rollouts in flight, spread over the
  N engines), so that the rows differ by the number of engines alone. The instant fake trainer
  publishes a version every step, so this rate also pays one activation of all N engines per step.
* `loop_lag_p99_ms`: the event loop's lag during that measurement: the 99th percentile of how
  late a task sleeping 10 ms woke (`sample_loop_lag`).
* `activation_ms`: one `Fleet.activate(v)` of N engines, every engine applied (median of a few),
  with the fleet idle; `activation_cpu_ms` the event loop thread's CPU time in it (other
  processes on the machine inflate it less than the wall time); `activation_busy_ms` the same
  with rollouts streaming on the engines (paced like a real engine's stream);
  `activation_latent_ms` the idle fleet where every swap RPC takes RPC_LATENCY_S (10 ms, a real
  engine's answer, which a concurrent fan-out overlaps); `engines_applied` how many engines hold
  the last version.

`fleet_scale_slow_engine` (key of its own): one engine among 64 whose every swap RPC takes
`swap_delay_ms` (stage, status, apply: `slow_engine_own_ms` per activation). A fleet that fans
out concurrently pays that engine's own time once, not once per engine: `activation_ms` ~
`fleet_activation_ms` (the same fleet without the slow engine) + `slow_engine_own_ms`;
`excess_ms` is what is left over.

The fake engine and the loop's rate come in as arguments (`make_engine`: `fake_engine`, `rate`:
`orchestrator_rate` of `orchestrator/bench/orchestrator.py`, which calls this module).
"""

from __future__ import annotations

import statistics
import time

import anyio

SIZES = (1, 16, 64, 256)
CONCURRENCY = 64  # as orchestrator_c64
ACTIVATIONS = 5  # per median
BUSY_CHUNK_DELAY_S = 0.01  # rollouts in flight during an activation: a chunk of 16 tokens every 10 ms
BUSY_TOKENS = 500
RPC_LATENCY_S = 0.01


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def activation_times(make_engine, engines: int, *, activations: int = ACTIVATIONS, busy: int = 0, slow: int = 0,
                           swap_delay_s: float = 0.2) -> dict:
    """`activations` activations (versions 1, 2, ...) of a fleet of `engines` fake engines, the
    first `slow` of them with slow swap RPCs; `busy` rollouts kept streaming meanwhile (each
    re-sent as it ends, on the engines in turn). Seconds per activation, and how many engines
    applied the last version."""
    from orchestrator.engines.base import SamplingSettings
    from orchestrator.fleet.fleet import Fleet

    fakes = [make_engine(f"fake-{i}", BUSY_TOKENS, BUSY_CHUNK_DELAY_S, swap_delay_s if i < slow else 0.0)
             for i in range(engines)]
    fleet = Fleet(fakes)
    sampling = SamplingSettings(max_tokens=BUSY_TOKENS)
    seconds: list[float] = []
    cpu: list[float] = []
    outcomes: list[str] = []

    async def stream(k: int) -> None:
        while True:
            await fleet.generate([1, 2, 3], sampling, engine_id=fakes[k % engines].engine_id,
                                 redispatch=False, final_only=True)

    async with anyio.create_task_group() as tg:
        for k in range(busy):
            tg.start_soon(stream, k)
        await anyio.sleep(2 * BUSY_CHUNK_DELAY_S if busy else 0)  # every stream has started
        for version in range(1, activations + 1):
            started, thread = time.perf_counter(), time.thread_time()
            record = await fleet.activate(version)
            seconds.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - thread)
            outcomes.append(record.outcome)
        tg.cancel_scope.cancel()
    return {"seconds": seconds, "cpu_seconds": cpu, "outcomes": outcomes,
            "engines_applied": sum(f.version == activations for f in fakes),
            "slow_engine_own_s": (fakes[0].swap_delayed_s / activations) if slow else 0.0}


async def fleet_scale_row(make_engine, rate, engines: int, rollouts: int, concurrency: int = CONCURRENCY,
                          activations: int = ACTIVATIONS) -> dict:
    lags: list[float] = []
    measured = await rate(concurrency, max(rollouts, 2 * concurrency), engines=engines, loop_lags=lags)
    idle = await activation_times(make_engine, engines, activations=activations)
    busy = await activation_times(make_engine, engines, activations=activations, busy=concurrency)
    latent = await activation_times(make_engine, engines, activations=activations, slow=engines,
                                    swap_delay_s=RPC_LATENCY_S)
    return {"engines": engines, "rollouts_per_s": measured["rollouts_per_s"], "loop_lag_p99_ms": 1e3 * p99(lags),
            "activation_ms": 1e3 * statistics.median(idle["seconds"]),
            "activation_cpu_ms": 1e3 * statistics.median(idle["cpu_seconds"]),
            "activation_busy_ms": 1e3 * statistics.median(busy["seconds"]),
            "activation_latent_ms": 1e3 * statistics.median(latent["seconds"]),
            "engines_applied": min(m["engines_applied"] for m in (idle, busy, latent)),
            "activation_outcomes": sorted({o for m in (idle, busy, latent) for o in m["outcomes"]}),
            "rollouts": measured["rollouts"], "concurrency": concurrency}


async def slow_engine(make_engine, engines: int = 64, swap_delay_s: float = 0.2, activations: int = 3) -> dict:
    fast = await activation_times(make_engine, engines, activations=activations)
    slow = await activation_times(make_engine, engines, activations=activations, slow=1, swap_delay_s=swap_delay_s)
    fleet_ms = 1e3 * statistics.median(fast["seconds"])
    slow_ms = 1e3 * statistics.median(slow["seconds"])
    own_ms = 1e3 * slow["slow_engine_own_s"]
    return {"engines": engines, "slow_engines": 1, "swap_delay_ms": 1e3 * swap_delay_s,
            "slow_engine_own_ms": own_ms, "fleet_activation_ms": fleet_ms, "activation_ms": slow_ms,
            "excess_ms": slow_ms - fleet_ms - own_ms, "engines_applied": slow["engines_applied"]}


async def fleet_scale(make_engine, rate, sizes=SIZES, rollouts: int = 4096, slow_delay_s: float = 0.2,
                      activations: int = ACTIVATIONS, concurrency: int = CONCURRENCY, slow_fleet: int = 64) -> dict:
    """The `fleet_scale` rows and the slow-engine comparison (`slow_fleet` engines, one slow;
    skipped with `slow_delay_s` 0)."""
    rows = [await fleet_scale_row(make_engine, rate, n, rollouts, concurrency, activations) for n in sizes]
    out: dict = {"fleet_scale": rows}
    if slow_delay_s:
        out["fleet_scale_slow_engine"] = await slow_engine(make_engine, slow_fleet, slow_delay_s)
    by_n = {r["engines"]: r for r in rows}
    if 16 in by_n and 256 in by_n:  # the goal: <= 4
        for key in ("activation_ms", "activation_cpu_ms", "activation_busy_ms", "activation_latent_ms"):
            out[f"fleet_scale_{key[:-3]}_ratio_256_vs_16"] = by_n[256][key] / by_n[16][key]
    return out
