"""`inflight stats`, `inflight export` and `inflight bench replay`.

`register` only declares arguments; numpy, pyarrow and rich are imported by the handlers.
Handlers return the exit code: 0, or 2 with one `inflight: error: ...` line on stderr for an
expected failure (a corrupt record, a missing log).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from replay.cli_progress import progress_bars

STATUSES = ("completed", "dropped", "errored")  # = replay.records.STATUS_NAMES, kept light here
ERROR_EXIT = 2


def register(sub: argparse._SubParsersAction, bench_sub: argparse._SubParsersAction) -> None:
    stats = sub.add_parser("stats", help="staleness statistics of a run's replay log",
                           description="Staleness, version spans, drops and activations of a "
                                       "run's replay log (RUN_DIR/replay or the log directory).")
    stats.add_argument("run_dir", metavar="RUN_DIR")
    stats.add_argument("--json", action="store_true", help="print JSON instead of tables")
    stats.add_argument("--lenient", action="store_true",
                       help="skip and count corrupt or invalid records instead of failing")
    stats.add_argument("--step-min", type=int, help="only rollouts consumed at this step or later")
    stats.add_argument("--step-max", type=int, help="only rollouts consumed at this step or earlier")
    stats.add_argument("--engine", action="append", default=[], metavar="ENGINE_ID",
                       help="only this engine (repeatable)")
    stats.add_argument("--status", action="append", default=[], choices=STATUSES,
                       help="only rollouts with this terminal status (repeatable)")
    stats.add_argument("--per-step", action="store_true", help="also print the per-step table")
    stats.add_argument("--verify", action="store_true",
                       help="decode and validate every record, ignoring the segments' sidecar "
                            "summaries (they are used when they match a segment byte for byte)")
    stats.set_defaults(func=run_stats)

    export = sub.add_parser("export", help="export a replay log to Parquet",
                            description="One Parquet row per rollout; with --tokens also one "
                                        "row per completion token.")
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--parquet", required=True, metavar="OUT", help="rollout rows go here")
    export.add_argument("--tokens", nargs="?", const="", default=None, metavar="TOKENS_OUT",
                        help="also write token rows (default path: OUT with .tokens.parquet)")
    export.add_argument("--lenient", action="store_true",
                        help="skip and count corrupt or invalid records instead of failing")
    export.set_defaults(func=run_export)

    bench = bench_sub.add_parser("replay", help="replay log: append, scan and stats speed",
                                 description="Append (vs a raw framed write), scan and "
                                             "statistics speed of the replay log.")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.add_argument("--records", type=int, default=10_000,
                       help="records for the fsync-every-100 append and the scan")
    bench.add_argument("--fsync1-records", type=int, default=1_000,
                       help="records for the fsync-every-record append")
    bench.add_argument("--stats-rows", type=int, default=1_000_000,
                       help="rollouts for the statistics timing")
    bench.add_argument("--dir", default=None,
                       help="where to create the scratch directory (default: the system temp dir)")
    bench.set_defaults(func=run_bench)
    __import__("replay.cli_replay").cli_replay.register(sub, bench_sub)  # inflight replay, bench replay-analysis


@contextmanager
def _expected_failures() -> Iterator[list[int]]:
    """Turns ReplayError into one stderr line and exit code 2 (the caller reads code[0])."""
    from replay.errors import ReplayError

    code = [0]
    try:
        yield code
    except ReplayError as exc:
        print(f"inflight: error: {exc}", file=sys.stderr)
        code[0] = ERROR_EXIT


# --- stats ------------------------------------------------------------------------------------


def run_stats(args: argparse.Namespace) -> int:
    from replay.query import Filters, stats_from_log

    filters = Filters(step_min=args.step_min, step_max=args.step_max,
                      engines=tuple(args.engine), statuses=tuple(args.status))
    with _expected_failures() as code, progress_bars() as progress:
        advance = progress("reading replay log", None)
        stats = stats_from_log(args.run_dir, filters, lenient=args.lenient,
                               on_record=lambda: advance(1), sidecars=not args.verify)
    if code[0]:
        return code[0]
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        render_stats(stats, per_step=args.per_step)
    return 0


def render_stats(stats: dict[str, Any], *, per_step: bool = False, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    log = stats.get("log", {})
    if log:
        console.print(f"[bold]{log['directory']}[/]: {log['records']} records, "
                      f"{log['corrupt_records']} corrupt and {log['invalid_records']} invalid "
                      f"skipped, {log.get('unknown_records', 0)} of unknown types skipped, "
                      f"{log.get('missing_segments', 0)} segments missing, "
                      f"torn tail {log['torn_tail_bytes']} bytes")

    counts = Table(title="Rollouts")
    for name in ("total", *STATUSES, "dropped for staleness", "(in flight", "completed)"):
        counts.add_column(name, justify="right")
    rollouts, stale = stats["rollouts"], stats["stale"]
    counts.add_row(*(str(rollouts[name]) for name in ("total", *STATUSES)),
                   str(stats["dropped_for_staleness"]), str(stale["in_flight"]),
                   str(stale["completed"]))
    console.print(counts)
    if stats["invalid_consumptions"]:
        console.print(f"[bold red]{stats['invalid_consumptions']} invalid consumptions[/] (a "
                      f"rollout consumed or discarded again; the first record counts)")

    lags = Table(title="Staleness ((trainer step - 1) - dispatched version: the version the "
                       "trainer held minus the one that sampled it) and version spans")
    for name in ("", "count", "mean", "p50", "p90", "p99", "max"):
        lags.add_column(name, justify="right" if name else "left")
    for key, label in (("staleness", "staleness"), ("in_flight_lag", "in-flight lag"),
                       ("queue_lag", "queue lag"), ("span_lengths", "versions per rollout")):
        summary = stats[key]
        lags.add_row(label, *(_cell(summary[k]) for k in ("count", "mean", "p50", "p90", "p99", "max")))
    console.print(lags)
    console.print(f"spanning more than one version: {_percent(stats['multi_version_fraction'])} "
                  f"of rollouts, {_percent(stats['multi_version_token_fraction'])} of tokens")

    shares = Table(title="Token share by version lag", min_width=32)
    shares.add_column("lag", justify="right")
    shares.add_column("share", justify="right")
    for lag, share in stats["token_share_by_lag"].items():
        shares.add_row(lag, _percent(share))
    console.print(shares)

    for key, title in (("dropped_by_reason", "Dropped by reason"),
                       ("discarded_by_reason", "Completed but discarded, by reason"),
                       ("errored_by_kind", "Errored by kind")):
        if stats[key]:
            table = Table(title=title)
            table.add_column("reason" if "reason" in key else "kind")
            table.add_column("rollouts", justify="right")
            for name, count in stats[key].items():
                table.add_row(name, str(count))
            console.print(table)

    activations = stats["activations"]
    table = Table(title=f"Activations: {activations['count']} "
                        f"({', '.join(f'{k} {v}' for k, v in activations['by_outcome'].items()) or 'none'})")
    for name in ("per engine", "count", "mean", "p50", "p90", "p99", "max"):
        table.add_column(name, justify="left" if name == "per engine" else "right")
    for key, label in (("transfer_s", "transfer (s)"), ("pause_s", "pause (s)")):
        summary = activations[key]
        table.add_row(label, *(_cell(summary[k]) for k in ("count", "mean", "p50", "p90", "p99", "max")))
    console.print(table)

    engines = stats.get("engines") or {}
    if len(engines) > 1 or stats.get("fleet"):
        table = Table(title="Engines")
        for name in ("engine", "rollouts", "completed", "tokens", "versions", "history"):
            table.add_column(name, justify="left" if name in ("engine", "history") else "right")
        history: dict[str, list[str]] = {}
        for change in stats.get("fleet") or []:
            history.setdefault(change["engine"], []).append(change["state"])
        for name in sorted(set(engines) | set(history)):
            e = engines.get(name, {})
            versions = "-" if e.get("first_version") is None else f"{e['first_version']}..{e['last_version']}"
            table.add_row(name, str(e.get("rollouts", 0)), str(e.get("completed", 0)), str(e.get("tokens", 0)),
                          versions, " -> ".join(history.get(name, [])))
        console.print(table)

    wait = stats.get("trainer_wait_s") or {}
    if wait.get("count"):
        console.print(f"trainer waited for its batch: mean {_cell(wait['mean'])}s, p90 {_cell(wait['p90'])}s, "
                      f"max {_cell(wait['max'])}s over {wait['count']} steps")

    if stats.get("eval"):
        evals = Table(title="Held-out evaluations (version: the one that sampled most tokens)")
        for name in ("step", "version", "versions", "mixed", "task", "k", "pass@k", "mean@k"):
            evals.add_column(name, justify="left" if name in ("versions", "task") else "right")
        for e in stats["eval"]:
            versions = e.get("versions") or [e["version"]]
            evals.add_row(str(e["step"]), str(e["version"]), ",".join(map(str, versions)), str(e.get("mixed", 0)),
                          e["task"], str(e["k"]), _cell(e["pass_at_k"]), _cell(e["mean_at_k"]))
        console.print(evals)

    if per_step and stats["per_step"]:
        steps = Table(title="Per trainer step")
        # every row's keys: some rows lack one (trainer_wait_s of a trainer process's first step)
        names = list(dict.fromkeys(name for row in stats["per_step"] for name in row))
        for name in names:
            steps.add_column(name.replace("_", " "), justify="right")
        for row in stats["per_step"]:
            steps.add_row(*(_cell(row.get(name)) for name in names))
        console.print(steps)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


# --- export -----------------------------------------------------------------------------------


def run_export(args: argparse.Namespace) -> int:
    from replay.export import default_tokens_path, export_parquet

    tokens_out = None
    if args.tokens is not None:
        tokens_out = args.tokens or default_tokens_path(args.parquet)
    with _expected_failures() as code, progress_bars() as progress:
        advance = progress("exporting", None)
        result = export_parquet(args.run_dir, args.parquet, tokens_out=tokens_out,
                                lenient=args.lenient, on_record=lambda: advance(1))
    if code[0]:
        return code[0]
    where = f"{args.parquet}" + (f" and {result.tokens} token rows to {tokens_out}" if tokens_out else "")
    skipped = ", ".join(f"{count} {what}" for count, what in (
        (result.corrupt_records, "corrupt records"), (result.invalid_records, "invalid records"),
        (result.unknown_records, "records of unknown types"),
        (result.missing_segments, "missing segments"),
        (result.invalid_consumptions, "invalid consumptions")) if count)
    print(f"exported {result.rollouts} rollouts to {where}"
          + (f" (skipped: {skipped})" if skipped else ""), file=sys.stderr)
    return 0


# --- bench ------------------------------------------------------------------------------------


def run_bench(args: argparse.Namespace) -> int:
    from replay.bench.log import GOALS
    from replay.bench.log import run_bench as bench

    with _expected_failures() as code, progress_bars() as progress:
        result = bench(records=args.records, fsync1_records=args.fsync1_records,
                       stats_rows=args.stats_rows, directory=args.dir, progress=progress)
    if code[0]:
        return code[0]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"replay log: {result['prompt_tokens']}+{result['completion_tokens']}-token "
                        f"records, {result['record_bytes']} bytes each")
    for name in ("measure", "value", "raw limit / goal", "met"):
        table.add_column(name, justify="left" if name == "measure" else "right")
    for every in ("1", "100"):
        table.add_row(f"append records/s, fsync every {every}",
                      f"{result[f'append_records_per_s_fsync{every}']:,.0f}",
                      f"{result[f'raw_records_per_s_fsync{every}']:,.0f}", "")
        table.add_row(f"  ratio to raw, fsync every {every}", f"{result[f'append_ratio_fsync{every}']:.2f}",
                      f">= {GOALS['append_ratio']}", _yes(result["goals"][f"append_ratio_fsync{every}"]))
    table.add_row("scan + verify + decode records/s", f"{result['scan_records_per_s']:,.0f}",
                  f">= {GOALS['scan_records_per_s']:,}", _yes(result["goals"]["scan_records_per_s"]))
    table.add_row(f"stats over {result['stats_rows']:,} rollouts (s)", f"{result['stats_1m_seconds']:.3f}",
                  f"<= {GOALS['stats_1m_seconds']}", _yes(result["goals"]["stats_1m_seconds"]))
    table.add_row("stats from the log, records/s", f"{result['stats_from_log_records_per_s']:,.0f}", "", "")
    Console().print(table)
    return 0


def _yes(met: bool) -> str:
    return "yes" if met else "no"
