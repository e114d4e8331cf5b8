"""What `inflight replay` writes: PNG plots (matplotlib, headless), a short Markdown report and
a self-contained HTML page (plots embedded), and the per-token Parquet table."""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any

import numpy as np

PLOT_FILES = {"kl": "kl_by_lag.png", "ratio": "ratio_by_lag.png", "lag": "lag_per_step.png"}
TOKEN_COLUMNS = ("rollout_id", "position", "token_id", "version", "lag", "sampled_logprob",
                 "target_logprob", "log_ratio")


def write_parquet(table: dict[str, np.ndarray], path: str | os.PathLike[str]) -> int:
    """The per-token table (TOKEN_COLUMNS) as one Parquet file; returns its row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrow = pa.table({name: pa.array(table[name]) for name in TOKEN_COLUMNS})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(arrow, os.fspath(path))
    return arrow.num_rows


def write_plots(report: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The PNGs that have data, written to `out_dir`; returns {kind: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    by_lag = report.get("by_lag") or []
    target = report["target"]
    if by_lag:
        lags = [row["lag"] for row in by_lag]
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("kl_k1", "k1"), ("kl_k2", "k2"), ("kl_k3", "k3")):
            ax.plot(lags, [row[key] for row in by_lag], marker="o", label=label)
        ax.set_xlabel(f"lag (target {_target_name(target)} - token version)")
        ax.set_ylabel("KL(behaviour || target) estimate per token")
        ax.set_title("KL against version lag")
        ax.legend()
        ax.grid(alpha=0.3)
        _save(fig, out / PLOT_FILES["kl"], plt)
        written["kl"] = PLOT_FILES["kl"]

        fig, ax = plt.subplots(figsize=(6, 4))
        for key in ("ratio_p1", "ratio_p10", "ratio_p50", "ratio_p90", "ratio_p99"):
            ax.plot(lags, [row[key] for row in by_lag], marker="o", label=key.replace("ratio_", ""))
        ax.axhline(report.get("clip", 2.0), color="grey", linestyle="--", label=f"clip {report.get('clip')}")
        ax.set_yscale("log")
        ax.set_xlabel("lag")
        ax.set_ylabel("importance ratio target / behaviour")
        ax.set_title("Importance-ratio percentiles against lag")
        ax.legend()
        ax.grid(alpha=0.3)
        _save(fig, out / PLOT_FILES["ratio"], plt)
        written["ratio"] = PLOT_FILES["ratio"]

    per_step = report.get("per_step_lag") or []
    if per_step:
        lags = sorted({int(lag) for row in per_step for lag in row["histogram"]})
        steps = [row["step"] for row in per_step]
        fig, ax = plt.subplots(figsize=(6, 4))
        bottom = np.zeros(len(steps))
        for lag in lags:
            share = np.array([row["histogram"].get(str(lag), 0) / row["tokens"] for row in per_step])
            ax.bar(steps, share, bottom=bottom, label=f"lag {lag}")
            bottom += share
        ax.set_xlabel("consuming trainer step s")
        ax.set_ylabel("share of tokens")
        ax.set_title("Token lag (s - 1) - token version, per step")
        ax.legend(fontsize="small")
        _save(fig, out / PLOT_FILES["lag"], plt)
        written["lag"] = PLOT_FILES["lag"]
    return written


def _save(fig, path: Path, plt) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _target_name(target: dict[str, Any]) -> str:
    if target.get("version") is not None:
        return f"v{target['version']}"
    return f"{target.get('model_dir')} (lags from v{target.get('lag_reference_version')})"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _tables(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    cols = ["tokens", "kl_k1", "kl_k2", "kl_k3", "ratio_mean", "ratio_p50", "ratio_p99",
            "ess_fraction", "clip_fraction"]
    tables = []
    for key, first in (("by_lag", "lag"), ("by_span", "span"), ("by_position", "position"),
                       ("by_kv_carried", "kv_carried")):
        rows = report.get(key) or []
        if rows:
            tables.append((key.replace("_", " "), [first, *cols],
                           [[_fmt(row[first]), *(_fmt(row[c]) for c in cols)] for row in rows]))
    verify = report.get("verify_spans")
    if verify and verify.get("by_lag"):
        tables.append(("verify spans: |recomputed - sampled| by versions since the rollout's first",
                       ["lag", "tokens", "max_abs_diff", "mean_abs_diff"],
                       [[_fmt(row[c]) for c in ("lag", "tokens", "max_abs_diff", "mean_abs_diff")]
                        for row in verify["by_lag"]]))
    mismatch = report.get("trainer_mismatch", {}).get("per_step") or []
    if mismatch:
        cols = ["step", "rollouts", "lag0_rollouts", "lag0_log_ratio_mean", "lag0_log_ratio_max_abs",
                "log_ratio_mean", "log_ratio_max_abs"]
        tables.append(("trainer - sampled logprob, per step (lag 0 isolates the mismatch)", cols,
                       [[_fmt(row.get(c)) for c in cols] for row in mismatch]))
    return tables


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"run: {report['run_dir']}",
             (f"target: {_target_name(report['target'])}; {report['rollouts']} rollouts, "
              f"{report['tokens']} tokens; device {report['device']}; clip c = {report['clip']}")]
    overall = report.get("overall")
    if overall:
        lines.append(f"overall: KL k3 {_fmt(overall['kl_k3'])}, ratio p50 {_fmt(overall['ratio_p50'])}, "
                     f"p99 {_fmt(overall['ratio_p99'])}, ESS {_fmt(overall['ess_fraction'])}, "
                     f"clipped {_fmt(overall['clip_fraction'])}")
    verify = report.get("verify_spans")
    if verify:
        state = "passed" if verify["passed"] else "FAILED"
        lines.append(f"verify spans: {state}; max |recomputed - sampled| {_fmt(verify['max_abs_diff'])} "
                     f"over {verify['tokens']} tokens (checked {verify['checked_tokens']} "
                     f"against {verify['tolerance']:g})")
        failure = verify.get("first_failure")
        if failure:
            lines.append(f"first offending token: rollout {failure['rollout_id']}, position "
                         f"{failure['position']}, version {failure['version']} (|diff| "
                         f"{failure['abs_diff']:.4g})")
    for skip in report.get("skipped") or []:
        lines.append(f"skipped version {skip['version']} ({', '.join(skip['needed_for'])}): "
                     f"{skip['tokens']} tokens of {skip['rollouts']} rollouts; {skip['reason']}")
    return lines


def write_markdown(report: dict[str, Any], path: Path, plots: dict[str, str]) -> None:
    parts = ["# Off-policy replay", "", *(f"- {line}" for line in summary_lines(report)), ""]
    for kind, name in plots.items():
        parts += [f"![{kind}]({name})", ""]
    for title, header, rows in _tables(report):
        parts += [f"## {title}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        parts += ["| " + " | ".join(row) + " |" for row in rows]
        parts.append("")
    path.write_text("\n".join(parts))


def write_html(report: dict[str, Any], path: Path, plots: dict[str, str]) -> None:
    """One page, plots embedded as data URIs (it still reads when moved on its own)."""
    body = ["<h1>Off-policy replay</h1>", "<ul>"]
    body += [f"<li>{html.escape(line)}</li>" for line in summary_lines(report)]
    body.append("</ul>")
    for kind, name in plots.items():
        data = base64.b64encode((path.parent / name).read_bytes()).decode()
        body.append(f'<figure><img alt="{kind}" src="data:image/png;base64,{data}">'
                    f"<figcaption>{html.escape(name)}</figcaption></figure>")
    for title, header, rows in _tables(report):
        body.append(f"<h2>{html.escape(title)}</h2><table><tr>"
                    + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        body += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        body.append("</table>")
    style = ("body{font-family:sans-serif;max-width:960px;margin:2em auto}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}")
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>Off-policy replay</title>"
                    f"<style>{style}</style></head><body>{''.join(body)}</body></html>")


def write_report(report: dict[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Plots, report.md and report.html in `out_dir`; returns {kind: path} of what was written."""
    out = Path(out_dir)
    plots = write_plots(report, out)
    write_markdown(report, out / "report.md", plots)
    write_html(report, out / "report.html", plots)
    written = {kind: str(out / name) for kind, name in plots.items()}
    written.update(markdown=str(out / "report.md"), html=str(out / "report.html"))
    return written
