"""`inflight bench engine-start --json`: how long an engine takes from its start to serving, with its
processes forked (`engine.start_method = "fork"`, the default, transports.server_main) against
vLLM's own spawn, in one run of the command, rounds alternating so that both see the same load.

For each kind (a server, an in-process engine) and each start method: the median seconds from
`Engine.start()` to its return (a server: /health answers 200; in-process: AsyncLLM built, vLLM
imported in this process beforehand, as a run has done by then) and,
once started, one short generation that must return tokens (a started engine that cannot generate
is a failure, not a figure). `fork_over_spawn_<kind>` is the ratio of the medians (< 1: fork is
faster). The machine's load average at the start and the end is reported beside them.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

KINDS = ("server", "inproc")
METHODS = ("spawn", "fork")


def register(bench_sub) -> None:
    p = bench_sub.add_parser("engine-start", help="engine start-up: forked processes against vLLM's spawn",
                             description="Starts and stops engines of each kind and start method, alternating.")
    p.add_argument("--rounds", type=int, default=3, help="starts of each kind and method")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: server, inproc")
    p.add_argument("--model", default="models/tiny-rl", help="the engines' model (built if missing)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=bench_command)


def bench_command(args) -> int:
    from orchestrator.errors import ConfigError

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for kind in kinds:
        if kind not in KINDS:
            raise ConfigError("--kinds", f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    if args.rounds < 1:
        raise ConfigError("--rounds", f"must be >= 1, got {args.rounds}")
    result = run_bench(kinds, args.rounds, Path(args.model))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    return 0


def run_bench(kinds: list[str], rounds: int, model: Path) -> dict:
    import anyio

    from orchestrator.model import ensure_model

    model = Path(ensure_model(str(model), preset="tiny-rl")).resolve()
    result: dict = {"rounds": rounds, "load_at_start": os.getloadavg()[0]}
    if "inproc" in kinds:  # an in-process engine's first start would pay this process's own import
        import vllm.v1.engine.async_llm  # noqa: F401
    for kind in kinds:
        seconds: dict[str, list[float]] = {m: [] for m in METHODS}
        for r in range(rounds):
            for method in METHODS if r % 2 == 0 else METHODS[::-1]:
                seconds[method].append(anyio.run(_start_once, kind, method, model, f"{kind}-{method}-{r}"))
                _progress(f"{kind} {method} round {r + 1}/{rounds}: {seconds[method][-1]:.1f} s")
        for method in METHODS:
            result[f"{kind}_{method}_s"] = round(statistics.median(seconds[method]), 2)
            result[f"{kind}_{method}_all_s"] = [round(s, 2) for s in seconds[method]]
        result[f"fork_over_spawn_{kind}"] = round(result[f"{kind}_fork_s"] / result[f"{kind}_spawn_s"], 3)
    result["load_at_end"] = os.getloadavg()[0]
    return result


async def _start_once(kind: str, method: str, model: Path, engine_id: str) -> float:
    from orchestrator.config.run import SWAP_EXTENSION, EngineConfig
    from orchestrator.engines import make_engine
    from orchestrator.engines.base import SamplingSettings

    config = EngineConfig(model=str(model), kind=kind, max_model_len=256, max_num_seqs=4,
                          worker_extension_cls=SWAP_EXTENSION, start_method=method)
    engine = make_engine(config, engine_id)
    try:
        started = time.monotonic()
        await engine.start()
        took = time.monotonic() - started
        done = await engine.complete(f"{engine_id}-check", [1, 2, 3], SamplingSettings(max_tokens=4, ignore_eos=True))
        if len(done.token_ids) != 4:
            raise RuntimeError(f"{engine_id}: a started engine returned {len(done.token_ids)} tokens of 4")
        return took
    finally:
        await engine.shutdown()


def _progress(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)
