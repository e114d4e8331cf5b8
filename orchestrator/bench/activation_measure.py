"""The measuring half of `inflight bench activation`: pure functions over timestamps.

Two clocks are measured, both `time.monotonic()` (system-wide on Linux, so the worker's and the
client's compare directly):

* **engine**: the end of every engine step that computed tokens, recorded inside the worker
  (`transports.swap.SwapWorkerExtension.swap_step_times`): where a stall happens;
* **client**: the arrival of every streamed chunk at the benchmark's event loop: what a
  client sees, lag and all (on two cores the stream can lag the engine by seconds).

A window is [t0, t1]. Its longest token-free interval is measured from t0, never from an event
before it (whatever happened before the window, a blocked loop included, is not the window's),
up to the first event at or after t1 (a stall the window's end leaves open counts until it
ends). The **added stall** of an update window is that interval minus the same measure over an
idle window of the same length from the same run (the engine's own jitter), floored at zero.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def longest_gap(times: Sequence[float], t0: float, t1: float) -> float:
    """Longest interval without an event in [t0, t1]; `times` sorted ascending. See the module
    docstring for where the measure starts and ends."""
    if t1 < t0:
        raise ValueError(f"window ends before it starts: [{t0}, {t1}]")
    i = bisect.bisect_left(times, t0)
    j = bisect.bisect_left(times, t1)
    end = times[j] if j < len(times) else t1
    points = [t0, *times[i:j], end]
    return max(b - a for a, b in itertools.pairwise(points))


def added_stall(update_gap: float, idle_gap: float) -> float:
    return max(0.0, update_gap - idle_gap)


def rate(events: Sequence[tuple[float, int]], t0: float, t1: float) -> float:
    """Sum of counts of the events in (t0, t1] per second (an event is the end of a step or the
    arrival of a chunk: one at t0 was produced before the window); `events` sorted by time."""
    if t1 <= t0:
        return 0.0
    times = [t for t, _ in events]
    i, j = bisect.bisect_right(times, t0), bisect.bisect_right(times, t1)
    return sum(n for _, n in events[i:j]) / (t1 - t0)


def median_interval(times: Sequence[float], t0: float, t1: float) -> float:
    inside = [t for t in times if t0 <= t <= t1]
    gaps = [b - a for a, b in itertools.pairwise(inside)]
    return statistics.median(gaps) if gaps else 0.0


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default); 0.0 for no values."""
    xs = sorted(values)
    if not xs:
        return 0.0
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Sample:
    """One activation (one repetition of one strategy) and its idle twin."""

    strategy: str
    repetition: int
    t0: float  # update window: pause request (or end of staging, pause-free) ...
    t1: float  # ... to resume returned (or the activation returned)
    idle_t0: float  # the idle window [idle_t0, idle_t0 + (t1 - t0)]
    paused_ms: float = 0.0
    staging: tuple[float, float] | None = None  # [start, staged] when staged off-pause
    idle_rate_window: tuple[float, float] | None = None  # this round's idle throughput window
    in_rhythm: bool = True  # the idle twin began after the engine's steps were back to normal
    measured: dict = field(default_factory=dict)
    idle_s: float | None = None  # the idle twin's length when longer than the window (lora: its staging too)

    @property
    def length(self) -> float:
        return self.t1 - self.t0


def measure(sample: Sample, engine_times: Sequence[float], client_times: Sequence[float],
            engine_tokens: Sequence[tuple[float, int]] = (), client_tokens: Sequence[tuple[float, int]] = ()) -> dict:
    """Fills and returns `sample.measured` (milliseconds; rates in tokens/s)."""
    m: dict = {"paused_ms": sample.paused_ms, "window_ms": sample.length * 1e3}
    i0, i1 = sample.idle_t0, sample.idle_t0 + sample.length
    for clock, times in (("engine", engine_times), ("client", client_times)):
        gap = longest_gap(times, sample.t0, sample.t1)
        idle = longest_gap(times, i0, i1)
        m[f"{clock}_gap_ms"] = gap * 1e3
        m[f"{clock}_jitter_ms"] = idle * 1e3
        m[f"{clock}_stall_ms"] = added_stall(gap, idle) * 1e3
    if sample.staging is not None:
        s0, s1 = sample.staging
        m["staging_ms"] = (s1 - s0) * 1e3
        if sample.idle_s is not None and s1 > s0 and sample.idle_s >= (s1 - s0) - 1e-9:
            # The staging's own added stall (the engine generating beside it), against the idle
            # twin's first (s1 - s0) seconds: what the off-step work still costs the steps.
            for clock, times in (("engine", engine_times), ("client", client_times)):
                gap, idle = longest_gap(times, s0, s1), longest_gap(times, i0, i0 + (s1 - s0))
                m[f"{clock}_staging_stall_ms"] = added_stall(gap, idle) * 1e3
        if sample.idle_rate_window is not None:
            w0, w1 = sample.idle_rate_window
            for clock, events in (("engine", engine_tokens), ("client", client_tokens)):
                staged, idle = rate(events, s0, s1), rate(events, w0, w1)
                m[f"{clock}_staging_tokens_per_s"] = staged
                m[f"{clock}_idle_tokens_per_s"] = idle
                m[f"{clock}_throughput_ratio"] = staged / idle if idle else 0.0
    sample.measured = m
    return m


def _stats(values: Iterable[float]) -> tuple[float, float]:
    xs = list(values)
    return (statistics.median(xs) if xs else 0.0), quantile(xs, 0.9)


#: The pause-free stall is floored at this in `stall_ratio` (it can be 0: a flip below the jitter).
RATIO_FLOOR_MS = 1.0


def summarize(samples: Sequence[Sample], strategies: Sequence[str], *, throughput_from: Sequence[str],
              baseline: str = "baseline", reference: str = "pause_free") -> dict:
    """Per strategy: `stall_ms` / `stall_ms_p90` (engine clock, added stall), `paused_ms` /
    `paused_ms_p90`, `jitter_ms`, the same on the client clock (`client_*`), medians of the rest;
    then `stall_ratio` from the medians and `throughput_during_transfer_ratio` (median over the
    stagings of `throughput_from`, engine clock)."""
    out: dict = {}
    for name in strategies:
        ms = [s.measured for s in samples if s.strategy == name]
        if not ms:
            continue
        stall, stall90 = _stats(m["engine_stall_ms"] for m in ms)
        paused, paused90 = _stats(m["paused_ms"] for m in ms)
        cstall, cstall90 = _stats(m["client_stall_ms"] for m in ms)
        entry = {"stall_ms": stall, "stall_ms_p90": stall90, "paused_ms": paused, "paused_ms_p90": paused90,
                 "jitter_ms": _stats(m["engine_jitter_ms"] for m in ms)[0],
                 "max_gap_ms": _stats(m["engine_gap_ms"] for m in ms)[0],
                 "client_stall_ms": cstall, "client_stall_ms_p90": cstall90,
                 "client_jitter_ms": _stats(m["client_jitter_ms"] for m in ms)[0],
                 "client_max_gap_ms": _stats(m["client_gap_ms"] for m in ms)[0],
                 "window_ms": _stats(m["window_ms"] for m in ms)[0],
                 "repetitions": len(ms)}
        if any("staging_ms" in m for m in ms):
            entry["staging_ms"] = _stats(m["staging_ms"] for m in ms if "staging_ms" in m)[0]
        if ms and all("engine_staging_stall_ms" in m for m in ms):
            entry["staging_stall_ms"], entry["staging_stall_ms_p90"] = _stats(m["engine_staging_stall_ms"] for m in ms)
        out[name] = entry
    out["repetitions"] = min((out[n]["repetitions"] for n in strategies if n in out), default=0)
    out["jitter_ms"] = _stats(s.measured["engine_jitter_ms"] for s in samples)[0]
    out["client_jitter_ms"] = _stats(s.measured["client_jitter_ms"] for s in samples)[0]
    if baseline in out and reference in out:
        out["stall_ratio"] = out[baseline]["stall_ms"] / max(out[reference]["stall_ms"], RATIO_FLOOR_MS)
        out["client_stall_ratio"] = (out[baseline]["client_stall_ms"]
                                     / max(out[reference]["client_stall_ms"], RATIO_FLOOR_MS))
        out["stall_ratio_floor_ms"] = RATIO_FLOOR_MS
    staged = [s.measured for s in samples if s.strategy in throughput_from and "engine_throughput_ratio" in s.measured]
    if staged:
        ratio, _ = _stats(m["engine_throughput_ratio"] for m in staged)
        out["throughput_during_transfer_ratio"] = ratio
        out["throughput"] = {
            "ratio": ratio,
            "ratio_p10": quantile([m["engine_throughput_ratio"] for m in staged], 0.1),
            "client_ratio": _stats(m["client_throughput_ratio"] for m in staged)[0],
            "staging_tokens_per_s": _stats(m["engine_staging_tokens_per_s"] for m in staged)[0],
            "idle_tokens_per_s": _stats(m["engine_idle_tokens_per_s"] for m in staged)[0],
            "stagings": len(staged),
        }
    return out
