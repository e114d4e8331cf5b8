"""The `inflight` command: argument parsing and dispatch only.

Each package contributes its own sub-commands through a light `register(...)` function
(no heavy imports at registration time: `inflight --help` must not import torch or vLLM).
A command's handler takes the parsed arguments and returns the process exit code.

    inflight model init DIR        orchestrator.model
    inflight generate ...          orchestrator.generate
    inflight stats / export        replay.cli
    inflight bench replay          replay.cli
    inflight plan / bench transports   transports.cli
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from orchestrator import commands
    from replay import cli as replay_cli
    from transports import cli as transports_cli

    parser = argparse.ArgumentParser(
        prog="inflight",
        description="Asynchronous RL orchestration on vLLM: engines, replay log, weight sync.",
    )
    parser.add_argument("--log-format", choices=["auto", "json", "console"], default="auto",
                        help="structlog output: JSON lines, readable console, or auto (console on a terminal)")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = sub.add_parser("bench", help="measure throughput and latency against raw limits")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="WHAT", required=True)

    commands.register(sub, bench_sub)
    replay_cli.register(sub, bench_sub)
    transports_cli.register(sub, bench_sub, end_to_end=_bench_end_to_end)
    return parser


def _bench_end_to_end(names, model=None):
    """`inflight bench transports --end-to-end`: handed to `transports.cli` (which never imports
    `orchestrator`); imports the engines only when run."""
    from orchestrator.bench_end_to_end import run_end_to_end

    return run_end_to_end(names, model=model)


def main(argv: Sequence[str] | None = None) -> int:
    from orchestrator.errors import InflightError
    from orchestrator.logging import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    # vLLM logs every request and shutdown step at INFO; keep a user's terminal readable.
    if args.log_level.lower() != "debug":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        return int(args.func(args) or 0)
    except InflightError as exc:
        # Expected failures (bad input, an engine that died) get one readable line, no traceback.
        print(f"inflight: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("inflight: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and friends: not an error. Silence the flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
