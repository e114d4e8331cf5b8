"""What a person sees during and after `inflight run`: a live display on a terminal (rich), one
plain line per step otherwise, and a one-screen summary at the end."""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class StepLine:
    step: int
    reward: float | None
    staleness_mean: float | None
    staleness_max: int | None
    tokens_per_s: float
    live_version: int
    loss: float | None
    seconds: float


@dataclass
class ProgressState:
    max_steps: int
    # The newest steps only (the display and the summary's curve show the last 72): a long run's
    # memory stays flat. What the summary needs of older steps is kept as it goes.
    steps: deque[StepLine] = field(default_factory=lambda: deque(maxlen=256))
    steps_done: int = 0
    first_reward: float | None = None
    best_reward: float | None = None
    last_activation: str = "none yet"
    last_eval: str = ""
    live_version: int = 0
    inflight: int = 0
    status: str = "starting"
    engines: int | None = None  # serving engines (None: not known yet)
    started: float = field(default_factory=time.monotonic)


def sparkline(values: list[float]) -> str:
    """The reward curve in one line of block characters (scaled to 0..1), one a step: the lowest
    bar is the floor (a blank for 0 made a run that had not learned yet show no curve at all)."""
    bars = "▁▂▃▄▅▆▇█"
    out = []
    for v in values:
        v = min(1.0, max(0.0, v))
        out.append(bars[round(v * (len(bars) - 1))])
    return "".join(out)


def _fmt(value, spec: str = ".3f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


class Progress:
    """mode: rich (live panel), plain (a line per step), none."""

    def __init__(self, state: ProgressState, mode: str = "auto", stream=None) -> None:
        self.state = state
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "rich" if self.stream.isatty() else "plain"
        self.mode = mode
        self._live = None

    def __enter__(self) -> Progress:
        if self.mode == "rich":
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._render(), console=Console(file=self.stream), refresh_per_second=4,
                              transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc)
            self._live = None

    def step(self, line: StepLine) -> None:
        s = self.state
        s.steps.append(line)
        s.steps_done += 1
        if line.reward is not None:
            if s.first_reward is None:
                s.first_reward = line.reward
            s.best_reward = line.reward if s.best_reward is None else max(s.best_reward, line.reward)
        if self.mode == "plain":
            print(f"step {line.step}/{self.state.max_steps}  reward {_fmt(line.reward)}  "
                  f"staleness mean {_fmt(line.staleness_mean, '.2f')} max {_fmt(line.staleness_max, 'd')}  "
                  f"tokens/s {line.tokens_per_s:.0f}  live v{line.live_version}  loss {_fmt(line.loss, '.4f')}  "
                  f"({line.seconds:.2f}s)", file=self.stream, flush=True)
        self.refresh()

    def note(self, text: str) -> None:
        if self.mode == "plain":
            print(text, file=self.stream, flush=True)
        self.refresh()

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def _render(self):
        from rich.panel import Panel
        from rich.table import Table

        s = self.state
        last = s.steps[-1] if s.steps else None
        table = Table.grid(padding=(0, 2))
        table.add_row("step", f"{last.step if last else 0} / {s.max_steps}", "status", s.status)
        table.add_row("reward", _fmt(last.reward if last else None), "live version", f"v{s.live_version}")
        table.add_row("staleness", f"mean {_fmt(last.staleness_mean if last else None, '.2f')} "
                                   f"max {_fmt(last.staleness_max if last else None, 'd')}",
                      "in flight", str(s.inflight) + (f"  ({s.engines} engines serving)" if s.engines is not None else ""))
        table.add_row("tokens/s", f"{last.tokens_per_s:.0f}" if last else "-", "last activation", s.last_activation)
        table.add_row("reward curve", sparkline([x.reward or 0.0 for x in list(s.steps)[-60:]]),
                      "last eval" if s.last_eval else "", s.last_eval)
        return Panel(table, title="inflight run", expand=False)


def eval_versions(version: int, versions: list[int], mixed: int) -> str:
    """"v7", or "v7 (v6-v8, 3 mixed)" for an evaluation whose tokens came from several versions
    (`version` sampled the most of them; `mixed` samples span two or more)."""
    if len(versions) <= 1:
        return f"v{version}"
    return f"v{version} (v{versions[0]}-v{versions[-1]}, {mixed} mixed)"


def summary(state: ProgressState, stats: dict, run_dir: str, http_url: str | None, stopped: str | None = None,
            startup: str | None = None) -> str:
    """The one-screen summary printed when the run ends."""
    rewards = [x.reward for x in state.steps if x.reward is not None]  # the newest ones
    staleness = stats.get("staleness", {})
    acts = stats.get("activations", {})
    pause = (acts.get("pause_s") or {})
    counts = stats.get("rollouts", {})
    lines = [
        f"inflight run: {state.steps_done} steps in {time.monotonic() - state.started:.0f}s  ({run_dir})"
        + (f"  stopped: {stopped}" if stopped else ""),
        f"  reward      first {_fmt(state.first_reward)}  last {_fmt(rewards[-1] if rewards else None)}"
        f"  best {_fmt(state.best_reward)}",
        f"  curve       {sparkline(rewards[-72:])}",
        f"  staleness   mean {_fmt(staleness.get('mean'), '.2f')}  max {staleness.get('max', '-')}"
        f"  histogram {staleness.get('histogram', {})}",
        f"  rollouts    {counts.get('completed', 0)} completed, {counts.get('dropped', 0)} dropped, "
        f"{counts.get('errored', 0)} errored; dropped for staleness {stats.get('dropped_for_staleness', 0)}",
        f"  activations {acts.get('count', 0)} {acts.get('by_outcome', {})}  pause p50 "
        f"{_fmt(pause.get('p50'), '.3f')}s",
        *[f"  eval        step {e['step']} {eval_versions(e['version'], e.get('versions') or [], e.get('mixed', 0))} {e['task']}: pass@{e['k']} {_fmt(e['pass_at_k'])}  "
          f"mean@{e['k']} {_fmt(e['mean_at_k'])}" for e in (stats.get("eval") or [])[-3:]],
        *([f"  startup     {startup}"] if startup else []),
        "",
        "next:",
        f"  inflight stats {run_dir}                  staleness, spans, activations",
        f"  inflight replay {run_dir} --verify-spans   off-policy analysis by version lag, provenance check",
        f"  inflight export {run_dir} --parquet rollouts.parquet   one row per rollout (DuckDB, polars)",
        f"  inflight export-model {run_dir} --version latest OUT_DIR   the trained model, a Hugging Face directory",
        f"  inflight eval {run_dir} [CONFIG]   held-out mean@k / pass@k of the newest version",
        f"  inflight run --run-dir {run_dir} --resume --max-steps N   continue training",
    ]
    return "\n".join(lines)
