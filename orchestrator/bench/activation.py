"""`inflight bench activation [--json]`: how long a weight update stalls generation, per strategy.

One real engine (a `small` model, >= 50M parameters, fp32) serves continuous streaming load;
in the same run, repeated in interleaved rounds (`--repetitions`, default 10), one update after
another:

    baseline       pause, load the just-published filesystem checkpoint into the live model
                   (vLLM's reload, with its post-processing), resume: how prime-rl and NeMo-RL
                   apply full weights
    pause_swap     staged off-pause, copied into the live weights during the pause
    double_buffer  an engine-ready second copy prepared off-pause; pause, pointer flip, resume
    pause_free     the same flip between two engine steps, without a pause
    lora           a rank-16 LoRA adapter as the version, loaded beside the serving ones and
                   made live at one instant, no pause (`activation_lora`); with `lora_row`:
                   its stall against pause_free and pause_swap, bytes per version against the model's

Every version is published the way a trainer does it: by another process
(`activation_publish`), finished before the measured window opens; nothing the benchmark
does for itself blocks the loop that timestamps tokens. The update window runs from the pause
request (baseline, pause_swap, double_buffer) or the end of staging (pause_free) until resume
(or the activation) returned. Stalls are measured on two clocks (`activation_measure`):
the worker's own per-step times (`swap_step_times`) and the client's chunk arrivals.

Paused strategies keep the KV of running requests by default (`--kv-policy keep`, as the
pause-free flip must), so the stalls compare the update mechanisms alone; `--kv-policy
recompute` adds the recompute of every running request (seconds per update on two cores).

Per strategy (medians over the repetitions, with p90): `stall_ms` = the longest token-free
interval of the update window minus the longest one of an idle window of the same length
measured after it, once the engine's steps are back to their normal length (the engine's own
jitter, `jitter_ms`), floored at zero, on the engine
clock (`client_stall_ms`: the same on the client clock); `paused_ms` = pause request until
resume returned (0 for pause-free). `stall_ratio` = baseline over pause-free median stall
(goal >= 10). `throughput_during_transfer_ratio` = engine tokens/s while a double-buffer version
is staged over tokens/s in the round's idle window, median over the stagings (goal >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from orchestrator.bench.activation_run import STRATEGIES, THROUGHPUT_FROM  # noqa: F401 - light imports only

DEFAULT_MODEL_DIR = Path(".inflight") / "bench-models" / "small"


def register(bench_sub) -> None:
    p = bench_sub.add_parser("activation", help="stall and pause per activation strategy under streaming load")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR),
                   help="model directory (built with preset 'small' when missing)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streaming requests")
    p.add_argument("--repetitions", type=int, default=10,
                   help="activations per strategy, in interleaved rounds (default 10)")
    p.add_argument("--idle-seconds", type=float, default=2.0,
                   help="idle throughput window at the start of every round")
    p.add_argument("--settle-seconds", type=float, default=0.3,
                   help="pause between a publish, an update window and an idle window")
    p.add_argument("--kv-policy", choices=("keep", "recompute"), default="keep",
                   help="KV of requests in flight across a paused update (baseline, pause_swap, double_buffer); "
                        "pause_free always keeps. keep (default): every strategy keeps its KV, so the stall "
                        "compares the update mechanisms alone; recompute adds the recompute of every running "
                        "request (seconds on two cores)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="limit for the whole benchmark")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=bench_command)


def bench_command(args: argparse.Namespace) -> int:
    import sys

    import anyio

    if args.repetitions < 1:
        print("--repetitions must be >= 1", file=sys.stderr)
        return 2
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
        print(format_text(result))
    return 0


def format_text(result: dict) -> str:
    lines = [(f"{result.get('repetitions', 0)} repetitions per strategy, {result.get('streams')} streams, "
              f"median engine step {result.get('median_step_ms', 0.0):.1f} ms, "
              f"jitter {result.get('jitter_ms', 0.0):.1f} ms")]
    for name in STRATEGIES:
        r = result.get(name)
        if r is None:
            continue
        lines.append(f"{name:14s} stall_ms={r['stall_ms']:8.1f} (p90 {r['stall_ms_p90']:8.1f})  "
                     f"paused_ms={r['paused_ms']:8.1f} (p90 {r['paused_ms_p90']:8.1f})  "
                     f"client_stall_ms={r['client_stall_ms']:8.1f}  jitter_ms={r['jitter_ms']:6.1f}")
    if "stall_ratio" in result:
        lines.append(f"stall_ratio (baseline / pause_free)  {result['stall_ratio']:.1f}  (goal >= 10; "
                     f"client clock {result['client_stall_ratio']:.1f})")
    row = result.get("lora_row") or {}
    if row:
        lines.append(f"lora (rank {row['rank']})  stall_ms {row['stall_ms']:.1f} (p90 {row['stall_ms_p90']:.1f}) vs "
                     f"pause_free {row.get('pause_free_stall_ms', float('nan')):.1f} "
                     f"(p90 {row.get('pause_free_stall_ms_p90', float('nan')):.1f}) and pause_swap "
                     f"{row.get('pause_swap_stall_ms', float('nan')):.1f};  bytes per version "
                     f"{row['adapter_bytes']:,} of the model's {row['model_bytes']:,} ({row['bytes_ratio']:.1%}, "
                     f"goal <= 5%)")
    if "throughput_during_transfer_ratio" in result:
        lines.append(f"throughput_during_transfer_ratio     {result['throughput_during_transfer_ratio']:.2f}  "
                     f"(goal >= 0.8)")
    return "\n".join(lines)


async def run_bench(args: argparse.Namespace) -> dict:
    import anyio

    from orchestrator.bench.activation_run import Bench

    with anyio.fail_after(args.timeout_s):
        return await Bench(args).run()
