"""The `inflight` command: argument parsing and dispatch only.

Each package contributes its own sub-commands through a light `register(...)` function
(no heavy imports at registration time: `inflight --help` must not import torch or vLLM).
A command's handler takes the parsed arguments and returns the process exit code.

    inflight model init DIR        orchestrator.model
    inflight generate ...          orchestrator.commands.generate
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
    from orchestrator.commands import subcommands as commands
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
    from orchestrator.bench.end_to_end import run_end_to_end

    return run_end_to_end(names, model=model)


def main(argv: Sequence[str] | None = None) -> int:
    from orchestrator.observe.logging import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    # vLLM logs every request and shutdown step at INFO; keep a user's terminal readable.
    if args.log_level.lower() != "debug":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM logs to stdout by default: stdout is the command's output (`--json` is piped into jq).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # Output piped into `head` and friends: not an error. Silence the flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BaseException as exc:  # noqa: BLE001 - sorted by exit_code; a bug (or SystemExit) is re-raised
        code = exit_code(exc, args.log_format)
        if code is None:
            raise
        return code


def expected_errors() -> tuple[type[BaseException], ...]:
    """The failures a user can act on, reported as one line: ours, the replay log's and the
    transports' (`replay` and `transports` keep their own error trees, see errors.py)."""
    from orchestrator.errors import InflightError
    from replay.errors import ReplayError
    from transports.errors import TransportError

    return InflightError, ReplayError, TransportError


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; `exc` itself when it is not
    a group. anyio task groups wrap whatever a task raised, a set-up error included."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


def exit_code(exc: BaseException, log_format: str = "auto") -> int | None:
    """130 for an interrupt, 2 (after reporting it) when every leaf is an expected error, None
    for anything else: a bug, whose traceback the user should see."""
    found = leaves(exc)
    if any(isinstance(leaf, KeyboardInterrupt) for leaf in found):
        print("inflight: interrupted", file=sys.stderr)
        return 130
    if found and all(isinstance(leaf, expected_errors()) for leaf in found):
        report_error(found[0], log_format)
        return 2
    return None


def report_error(exc: BaseException, log_format: str = "auto") -> None:
    """Expected failures (bad input, an engine that died) get one readable line, no traceback;
    with `--log-format json`, one JSON error event instead."""
    if log_format == "json":
        import json
        from datetime import datetime, timezone

        event = {"event": "error", "error": str(exc), "kind": type(exc).__name__, "level": "error",
                 "timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}
        print(json.dumps(event), file=sys.stderr)
    else:
        print(f"inflight: error: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
