"""`inflight replay RUN_DIR ...` and `inflight bench replay-analysis`.

`register` only declares arguments; torch, transformers and matplotlib are imported by the
handlers. Exit codes: 0; 1 when `--verify-spans` finds a token its recorded version does not
reproduce within the tolerance (where provenance must be exact); 2 with one
`inflight: error: ...` line for an expected failure (no log, a corrupt record, no base model).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

ERROR_EXIT = 2
VERIFY_FAILED_EXIT = 1


def register(sub: argparse._SubParsersAction, bench_sub: argparse._SubParsersAction) -> None:
    replay = sub.add_parser(
        "replay", help="off-policy analysis: recompute logprobs under any recorded version",
        description="Recompute the logprob of every recorded token under a target policy and "
                    "report importance ratios, KL estimators (k1, k2, k3), effective sample size "
                    "and the truncated-IS clip share by version lag, span, position and KV "
                    "carry-over; --verify-spans recomputes every token under its own version.")
    replay.add_argument("run_dir", metavar="RUN_DIR")
    replay.add_argument("--target", default="latest", metavar="latest|VERSION|MODEL_DIR",
                        help="the target policy: the newest activated version (default), a "
                             "version number, or a Hugging Face model directory")
    replay.add_argument("--limit", type=int, default=None, metavar="N",
                        help="only the first N rollouts (log order, after --steps)")
    replay.add_argument("--steps", default=None, metavar="A:B",
                        help="only rollouts consumed by trainer steps A..B (inclusive; 'A:' or ':B')")
    replay.add_argument("--clip", type=float, default=2.0, metavar="C",
                        help="truncated-IS clip for clip_fraction (default 2)")
    replay.add_argument("--verify-spans", action="store_true",
                        help="recompute every token under its recorded version; exit 1 when a "
                             "token whose provenance must be exact (fp32, no KV carried) differs "
                             "by more than --tolerance")
    replay.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest |recomputed - sampled| --verify-spans accepts (default 1e-3)")
    replay.add_argument("--json", action="store_true", help="print the report as JSON")
    replay.add_argument("--plots", default=None, metavar="DIR",
                        help="write PNG plots, report.md and a self-contained report.html here")
    replay.add_argument("--parquet", default=None, metavar="FILE",
                        help="write the per-token table (rollout, position, token, version, lag, "
                             "sampled/target logprob, log ratio)")
    replay.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    replay.add_argument("--lenient", action="store_true",
                        help="skip and count corrupt or invalid records instead of failing")
    replay.set_defaults(func=run_replay)

    bench = bench_sub.add_parser(
        "replay-analysis", help="replay analysis: recompute tokens/s against a plain forward",
        description="Tokens/s of `inflight replay` recomputation against a plain batched "
                    "transformers forward over the same tokens, on a synthetic log of a small "
                    "random model (recompute_ratio; goal >= 0.8).")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.add_argument("--rollouts", type=int, default=256)
    bench.add_argument("--device", default=None)
    bench.add_argument("--dir", default=None, help="scratch directory parent (default: system temp)")
    bench.set_defaults(func=run_bench_analysis)


def run_replay(args: argparse.Namespace) -> int:
    from replay.analysis.analyze import Options, analyze
    from replay.cli_progress import progress_bars
    from replay.errors import ReplayError

    options = Options(target=args.target, limit=args.limit, steps=args.steps, clip=args.clip,
                      verify_spans=args.verify_spans, tolerance=args.tolerance, device=args.device,
                      lenient=args.lenient, token_table=args.parquet is not None)
    try:
        with progress_bars() as progress:
            report, table = analyze(args.run_dir, options, progress)
        outputs: dict[str, Any] = {}
        if args.parquet is not None and table is not None:
            from replay.analysis.report import write_parquet

            outputs["parquet"] = args.parquet
            outputs["parquet_rows"] = write_parquet(table, args.parquet)
        if args.plots is not None:
            from replay.analysis.report import write_report

            outputs.update(write_report(report, args.plots))
    except (ReplayError, FileNotFoundError, ValueError, OSError) as exc:
        print(f"inflight: error: {exc}", file=sys.stderr)
        return ERROR_EXIT
    report["outputs"] = outputs
    if args.parquet is not None and table is None:
        print("inflight: warning: no per-token table (the target's weights were not found)", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _render(report)
    verify = report.get("verify_spans")
    if verify and not verify["passed"]:
        failure = verify["first_failure"]
        print(f"inflight: verify-spans failed: rollout {failure['rollout_id']} token "
              f"{failure['position']} (version {failure['version']}): recomputed "
              f"{failure['recomputed_logprob']:.6f}, sampled {failure['sampled_logprob']:.6f}, "
              f"|diff| {failure['abs_diff']:.3g} > {verify['tolerance']:g}", file=sys.stderr)
        return VERIFY_FAILED_EXIT
    return 0


def _render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from replay.analysis.report import summary_lines

    console = Console()
    for line in summary_lines(report):
        console.print(line, highlight=False)
    if report.get("by_lag"):
        table = Table(title="By version lag (target - token version)")
        cols = ["lag", "tokens", "kl_k1", "kl_k2", "kl_k3", "ratio_mean", "ratio_p50", "ratio_p99",
                "ess_fraction", "clip_fraction"]
        for name in cols:
            table.add_column(name.replace("_", " "), justify="right")
        for row in report["by_lag"]:
            table.add_row(*(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in cols))
        console.print(table)
    for path in (report.get("outputs") or {}).values():
        if isinstance(path, str):
            console.print(f"wrote {path}", highlight=False)


def run_bench_analysis(args: argparse.Namespace) -> int:
    from replay.bench.analysis import GOAL, run_bench

    result = run_bench(rollouts=args.rollouts, device=args.device, directory=args.dir)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"recompute: {result['recompute_tokens_per_s']:,.0f} tokens/s; plain forward "
          f"{result['forward_tokens_per_s']:,.0f} tokens/s; ratio {result['recompute_ratio']:.2f} "
          f"(goal >= {GOAL}: {'met' if result['met'] else 'not met'}) over {result['tokens']} tokens "
          f"on {result['device']}")
    return 0
