"""`inflight plan` and `inflight bench transports`. Registration imports nothing heavy.

The plan model (documented in docs/transports.md):

    bytes              = params x bytes_per_param(dtype)
    transfer_seconds   = bytes x passes / bandwidth
    stale_fraction     = transfer_seconds / step_seconds

`--bandwidth B` (GB/s) is one store-and-forward path: the bytes cross it twice (into the
staging area, then into the engine), passes = 2. `--bandwidth NxB` is N parallel direct links
(NVLink/InfiniBand collectives), each landing its 1/N shard in place: passes = 1, bandwidth N*B.
`--bandwidth measured` uses the best end-to-end figure `inflight bench transports` saved
(already send + apply): passes = 1. `--passes` overrides.
Worked example: 32e9 bf16 params at 2 GB/s -> 64e9 B x 2 / 2e9 B/s = 64 s = 21% of a 300 s
step; at 8x45 GB/s -> 64e9 / 360e9 = 0.18 s.

The activation estimate is the copy of staged weights into live ones at `--apply-bandwidth`
(device memory, default 100 GB/s); with double buffering it is a pointer flip instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transports.errors import TransportError  # light: the standard library only

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1,
               "float8": 1}
DEFAULT_RESULTS = Path(".inflight/bench-transports.json")


class UsageError(Exception):
    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


def error_line(exc: BaseException) -> str:
    """One line naming a transport error: its class and its message's first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def register(sub, bench_sub, *, end_to_end=None) -> None:
    """`end_to_end(names, model=...)`: what `bench transports --end-to-end` runs (engines and a
    fleet live in `orchestrator`, which hands it in: `transports` never imports `orchestrator`)."""
    plan = sub.add_parser("plan", help="weight-transfer time and staleness for a model size and bandwidth")
    plan.add_argument("--params", required=True, help="parameter count, e.g. 32e9 or 7B")
    plan.add_argument("--dtype", default="bf16", help="wire dtype: bf16, fp16, fp32, fp8")
    plan.add_argument("--bandwidth", required=True, help="GB/s of one path, NxGBPS for N parallel links, or 'measured'")
    plan.add_argument("--step-seconds", required=True, help="trainer step time in seconds")
    plan.add_argument("--passes", default=None, help="times the bytes cross the bandwidth (default: see docs)")
    plan.add_argument("--apply-bandwidth", default="100", help="GB/s of the staged -> live copy (activation)")
    plan.add_argument("--results", default=str(DEFAULT_RESULTS), help="saved `inflight bench transports` figures")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=plan_command)

    bench = bench_sub.add_parser("transports", help="each transport against its raw reference, same run")
    bench.add_argument("--size", default="256MiB", help="total bytes of the synthetic state dict (e.g. 256MiB, 1GiB)")
    bench.add_argument("--tensors", default="100", help="number of tensors")
    bench.add_argument("--bucket", default="32MiB", help="bucket size")
    bench.add_argument("--transports", default="filesystem,ipc,http,collective", help="comma-separated")
    bench.add_argument("--dir", default=None, help="directory for the filesystem transport (default: a temp dir)")
    bench.add_argument("--save", default=str(DEFAULT_RESULTS), help="where to save the figures for `inflight plan`")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.add_argument("--rounds", default="3", help="timed rounds of each transport and its reference (best counts)")
    bench.add_argument("--no-checksums", action="store_true",
                       help="send without the end-to-end crc32c per tensor (what the integrity check costs)")
    bench.add_argument("--end-to-end", action="store_true",
                       help="also measure trainer process -> live on two vLLM engines (small model; slow): "
                            "an `end_to_end` entry per transport")
    bench.add_argument("--model", default=None, help="--end-to-end: model directory (built with preset 'small' "
                                                    "when missing; default .inflight/bench-models/small)")
    bench.set_defaults(func=bench_command, end_to_end_runner=end_to_end)


# -- parsing ----------------------------------------------------------------------------------

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(flag: str, text: str) -> float:
    raw = text.strip().lower()
    scale = 1.0
    if raw and raw[-1] in _SUFFIX:
        raw, scale = raw[:-1], _SUFFIX[raw[-1]]
    try:
        value = float(raw) * scale
    except ValueError:
        raise UsageError(flag, f"not a number: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise UsageError(flag, f"must be a positive number, got {text!r}")
    return value


_BYTES = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9, "b": 1}


def parse_bytes(flag: str, text: str) -> int:
    raw = text.strip().lower()
    for suffix in sorted(_BYTES, key=len, reverse=True):
        if raw.endswith(suffix):
            return int(parse_count(flag, raw[: -len(suffix)]) * _BYTES[suffix])
    return int(parse_count(flag, raw))


def parse_bandwidth(flag: str, text: str) -> tuple[float, int]:
    """(bytes per second, default passes)."""
    raw = text.strip().lower()
    if "x" in raw:
        links, _, per = raw.partition("x")
        n = parse_count(flag, links)
        if n != int(n):
            raise UsageError(flag, f"the link count must be a whole number, got {links!r}")
        return n * parse_count(flag, per) * 1e9, 1
    return parse_count(flag, raw) * 1e9, 2


def measured_bandwidth(path: Path) -> tuple[float, str]:
    if not path.exists():
        raise UsageError("--bandwidth", f"'measured' needs {path}; run `inflight bench transports` first")
    try:
        results = json.loads(path.read_text())
        best = max(results["transports"].items(), key=lambda kv: kv[1]["gbps"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError("--bandwidth", f"unreadable bench results in {path}: {exc}") from None
    return best[1]["gbps"] * 1e9, best[0]


def compute_plan(*, params: float, dtype: str, bandwidth_bps: float, passes: float, step_seconds: float,
                 apply_bps: float) -> dict[str, float]:
    nbytes = params * DTYPE_BYTES[dtype]
    transfer = nbytes * passes / bandwidth_bps
    return {
        "params": params,
        "bytes": nbytes,
        "passes": passes,
        "bandwidth_gbps": bandwidth_bps / 1e9,
        "transfer_seconds": transfer,
        "activation_seconds": nbytes / apply_bps,
        "step_seconds": step_seconds,
        "stale_fraction": transfer / step_seconds,
    }


def plan_command(args: argparse.Namespace) -> int:
    try:
        params = parse_count("--params", args.params)
        dtype = args.dtype.strip().lower()
        if dtype not in DTYPE_BYTES:
            raise UsageError("--dtype", f"unknown dtype {args.dtype!r}; choose bf16, fp16, fp32 or fp8")
        step = parse_count("--step-seconds", args.step_seconds)
        source = "given"
        if args.bandwidth.strip().lower() == "measured":
            bandwidth, source = measured_bandwidth(Path(args.results))
            passes: float = 1
        else:
            bandwidth, passes = parse_bandwidth("--bandwidth", args.bandwidth)
        if args.passes is not None:
            passes = parse_count("--passes", args.passes)
        apply_bps = parse_count("--apply-bandwidth", args.apply_bandwidth) * 1e9
    except UsageError as exc:
        print(f"inflight: error: {exc}", file=sys.stderr)
        return 2
    result = compute_plan(params=params, dtype=dtype, bandwidth_bps=bandwidth, passes=passes, step_seconds=step,
                          apply_bps=apply_bps)
    result["bandwidth_source"] = source
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{params:.3g} parameters in {dtype}: {result['bytes'] / 1e9:.3g} GB; "
              f"{passes:g} pass(es) at {bandwidth / 1e9:.3g} GB/s ({source})")
        print(f"transfer    {result['transfer_seconds']:.3g} s")
        print(f"activation  {result['activation_seconds']:.3g} s (copy at {apply_bps / 1e9:.3g} GB/s; "
              "a pointer flip with double buffering)")
        print(f"stale       {result['stale_fraction']:.1%} of a {step:g} s step samples on the previous version")
    return 0


def bench_command(args: argparse.Namespace) -> int:
    try:
        size = parse_bytes("--size", args.size)
        bucket = parse_bytes("--bucket", args.bucket)
        tensors = int(parse_count("--tensors", args.tensors))
        rounds = int(parse_count("--rounds", getattr(args, "rounds", "3")))
        if rounds < 1:
            raise UsageError("--rounds", f"needs at least 1 round, got {rounds}")
        names = [t.strip() for t in args.transports.split(",") if t.strip()]
        unknown = [t for t in names if t not in ("filesystem", "ipc", "http", "collective")]
        if unknown or not names:
            raise UsageError("--transports", f"unknown transport(s) {unknown}; choose filesystem, ipc, http, collective")
    except UsageError as exc:
        print(f"inflight: error: {exc}", file=sys.stderr)
        return 2
    from transports.bench.transports import run_bench

    try:
        results = run_bench(size=size, tensors=tensors, bucket_bytes=bucket, transports=names, directory=args.dir,
                            rounds=rounds, checksums=not getattr(args, "no_checksums", False))
        if getattr(args, "end_to_end", False):
            # Engines and a fleet live in orchestrator, which registered the runner.
            run_end_to_end = getattr(args, "end_to_end_runner", None)
            if run_end_to_end is None:
                print("inflight: error: --end-to-end: no end-to-end runner registered (run it through "
                      "the `inflight` command)", file=sys.stderr)
                return 2
            for name, row in run_end_to_end(names, model=args.model).items():
                results["transports"].setdefault(name, {})["end_to_end"] = row
    except TransportError as exc:
        # The error tree's promise: exit 2 with one line naming the error, never a traceback.
        print(f"inflight: error: {error_line(exc)}", file=sys.stderr)
        return 2
    if args.save:
        path = Path(args.save)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
    if args.json:
        print(json.dumps(results))
    else:
        from transports.bench.transports import print_table

        print_table(results)
    return 0
