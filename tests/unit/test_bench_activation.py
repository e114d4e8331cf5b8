"""`inflight bench activation`: the measuring code alone (synthetic timestamps), the worker's
step clock, the off-loop publisher and the summary's keys. The real benchmark is not run here."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from orchestrator.bench.activation_measure import (
    RATIO_FLOOR_MS,
    Sample,
    added_stall,
    longest_gap,
    measure,
    quantile,
    rate,
    summarize,
)


def ticks(start: float, end: float, step: float) -> list[float]:
    n = round((end - start) / step)
    return [round(start + i * step, 9) for i in range(n + 1)]


# -- the must-show: a blocked interval before the window is not the window's stall -----------

def test_blocked_interval_before_the_window_is_not_reported_only_the_stall_inside():
    # Tokens every 20 ms until 1.0; the loop is then blocked for 2 s (a checkpoint written on it)
    # and the window opens at 3.0, right as the backlog arrives. Inside the window the engine
    # stalls 300 ms (3.2 -> 3.5, past the window's end at 3.4). An idle window of the same
    # length later in the run has the normal 20 ms rhythm.
    arrivals = ticks(0.0, 1.0, 0.02) + [3.001, 3.002] + ticks(3.02, 3.2, 0.02) + ticks(3.5, 6.0, 0.02)
    window = Sample("baseline", 0, t0=3.0, t1=3.4, idle_t0=5.0)
    m = measure(window, arrivals, arrivals)
    assert longest_gap(arrivals, 3.0, 3.4) == pytest.approx(0.3)
    assert m["client_gap_ms"] == pytest.approx(300.0)
    assert m["client_jitter_ms"] == pytest.approx(20.0)
    assert m["client_stall_ms"] == pytest.approx(280.0)  # the inside stall minus jitter; not the 2 s block
    assert m["engine_stall_ms"] == pytest.approx(280.0)


def test_the_measure_starts_at_the_window_even_when_the_window_opens_inside_a_gap():
    arrivals = [0.0, 1.0, 1.01, 1.02]
    assert longest_gap(arrivals, 0.9, 1.02) == pytest.approx(0.1)  # t0 -> 1.0, not 0.0 -> 1.0


def test_a_stall_left_open_at_the_window_end_counts_until_the_first_token_after_it():
    arrivals = [0.0, 0.1, 0.9]
    assert longest_gap(arrivals, 0.0, 0.3) == pytest.approx(0.8)
    assert longest_gap([0.0, 0.1], 0.0, 0.3) == pytest.approx(0.2)  # nothing after: up to t1
    with pytest.raises(ValueError):
        longest_gap(arrivals, 1.0, 0.5)


def test_added_stall_is_floored_at_zero():
    assert added_stall(0.05, 0.08) == 0.0
    assert added_stall(0.30, 0.05) == pytest.approx(0.25)


def test_stream_lag_on_the_client_clock_does_not_masquerade_as_an_engine_stall():
    # The engine steps every 50 ms without a hiccup; the client's stream lags and delivers a
    # burst after a 600 ms silence inside the window.
    engine = ticks(0.0, 4.0, 0.05)
    client = ticks(0.0, 1.0, 0.05) + ticks(1.6, 4.0, 0.05)
    m = measure(Sample("pause_free", 0, t0=0.9, t1=1.2, idle_t0=3.0), engine, client)
    assert m["engine_stall_ms"] == pytest.approx(0.0, abs=1e-6)
    assert m["client_stall_ms"] == pytest.approx(550.0)


def test_rate_and_quantile():
    events = [(0.1, 2), (0.2, 3), (0.9, 5), (1.0, 7)]
    assert rate(events, 0.0, 0.9) == pytest.approx(10.0 / 0.9)  # (t0, t1]
    assert rate(events, 0.1, 1.0) == pytest.approx(15.0 / 0.9)  # the event at t0 was before the window
    assert rate(events, 1.0, 1.0) == 0.0
    assert quantile([], 0.9) == 0.0
    assert quantile([5.0], 0.9) == 5.0
    assert quantile(list(range(11)), 0.9) == pytest.approx(9.0)
    assert quantile([1, 2, 3, 4], 0.5) == pytest.approx(2.5)


# -- the summary: medians, p90s, ratio from the medians, the issue's keys ---------------------

def synthetic_samples(reps: int = 10) -> tuple[list[Sample], list[float], list[tuple[float, int]]]:
    """Engine steps every 50 ms (4 requests each); per repetition, each strategy's window holds
    a known stall; staging windows run at 3/4 of the idle rate (every other step has 2 requests
    ... kept simple: the step count per staging window is known)."""
    step, steps, samples = 0.05, [], []
    stalls = {"baseline": 0.40, "pause_swap": 0.30, "double_buffer": 0.10, "pause_free": 0.0}
    t = 0.0
    events: list[tuple[float, int]] = []

    def run(until: float, every: float = step, n: int = 4) -> None:
        nonlocal t
        while t + every <= until + 1e-9:
            t = round(t + every, 9)
            steps.append(t)
            events.append((t, n))

    for rep in range(reps):
        idle = (t, t + 1.0)
        run(t + 1.0)
        for name, stall in stalls.items():
            staging = None
            if name != "baseline":
                s0 = t
                run(t + 0.5, n=3)  # 3 of 4 requests' worth of tokens while staging
                staging = (s0, t)
            t0 = t
            if stall:
                t = round(t + step + stall, 9)  # a stall of `stall` on top of one normal step
                steps.append(t)
                events.append((t, 4))
            t1 = t
            run(t + 0.5)
            idle_t0 = t
            run(t + max(t1 - t0, 0.05) + 0.5)
            samples.append(Sample(name, rep, t0, t1, idle_t0, paused_ms=stall * 1e3 + 10.0,
                                  staging=staging, idle_rate_window=idle))
    return samples, steps, events


def test_summary_reports_medians_p90_ratio_and_the_issue_keys():
    samples, steps, events = synthetic_samples()
    for s in samples:
        measure(s, steps, steps, events, events)
    out = summarize(samples, ("baseline", "pause_swap", "double_buffer", "pause_free"),
                    throughput_from=("double_buffer", "pause_free"))
    for name in ("baseline", "pause_swap", "double_buffer", "pause_free"):
        for key in ("stall_ms", "paused_ms", "stall_ms_p90", "paused_ms_p90", "jitter_ms", "client_stall_ms"):
            assert key in out[name], (name, key)
        assert out[name]["repetitions"] == 10
    assert out["repetitions"] == 10
    assert out["baseline"]["stall_ms"] == pytest.approx(400.0, abs=1.0)
    assert out["pause_swap"]["stall_ms"] == pytest.approx(300.0, abs=1.0)
    assert out["pause_free"]["stall_ms"] == pytest.approx(0.0, abs=1e-6)
    assert out["baseline"]["jitter_ms"] == pytest.approx(50.0, abs=1.0)
    assert out["jitter_ms"] == pytest.approx(50.0, abs=1.0)
    assert out["baseline"]["paused_ms"] == pytest.approx(410.0)
    # pause-free's stall is 0: the ratio uses the floor
    assert out["stall_ratio"] == pytest.approx(400.0 / RATIO_FLOOR_MS, rel=1e-2)
    assert out["throughput_during_transfer_ratio"] == pytest.approx(0.75, abs=1e-6)
    assert out["throughput"]["stagings"] == 20
    json.dumps(out)  # no inf / nan objects


def test_stall_ratio_comes_from_the_medians_and_p90_from_the_spread():
    samples = []
    for rep, (b, f) in enumerate([(300, 20), (320, 15), (310, 25), (900, 16), (305, 14)]):
        for name, v in (("baseline", b), ("pause_free", f)):
            s = Sample(name, rep, 0.0, 0.1, 1.0, paused_ms=float(v))
            s.measured = {"engine_stall_ms": float(v), "client_stall_ms": float(v), "paused_ms": float(v),
                          "engine_jitter_ms": 5.0, "client_jitter_ms": 6.0, "engine_gap_ms": v + 5.0,
                          "client_gap_ms": v + 6.0, "window_ms": 100.0}
            samples.append(s)
    out = summarize(samples, ("baseline", "pause_free"), throughput_from=())
    assert out["baseline"]["stall_ms"] == 310.0 and out["pause_free"]["stall_ms"] == 16.0
    assert out["stall_ratio"] == pytest.approx(310.0 / 16.0)
    assert out["baseline"]["stall_ms_p90"] == pytest.approx(quantile([300, 320, 310, 900, 305], 0.9))
    assert out["baseline"]["stall_ms_p90"] > 320.0  # the outlier shows in the p90, not the median
    assert "throughput_during_transfer_ratio" not in out


def test_bench_results_glue_uses_the_engine_clock_for_stall_and_reports_both(tmp_path):
    from orchestrator.bench.activation_run import Bench, Load

    samples, _, events = synthetic_samples(reps=2)
    bench = Bench(argparse.Namespace(streams=8, idle_seconds=1.0))
    bench.samples = samples
    bench.steps = [[t - 0.04, t, 0.0, n, n] for t, n in reversed(events)]  # any order
    load = Load([1, 2, 3], 8)
    # the client sees every token 2 s late and in one burst after each update: lag, not stall
    load.arrivals = [(t + 2.0, n) for t, n in events]
    out = bench.results(123, load, [s.idle_rate_window for s in samples if s.strategy == "baseline"])
    assert out["model_parameters"] == 123 and out["repetitions"] == 2
    assert out["baseline"]["stall_ms"] == pytest.approx(400.0, abs=1.0)
    assert out["median_step_ms"] == pytest.approx(50.0, abs=1.0)
    assert {"baseline", "pause_swap", "double_buffer", "pause_free", "stall_ratio",
            "throughput_during_transfer_ratio", "jitter_ms", "repetitions"} <= set(out)
    assert len(out["samples"]) == 8
    json.dumps(out)


# -- the CLI ---------------------------------------------------------------------------------

def test_register_keeps_the_command_and_defaults_to_at_least_ten_repetitions():
    from orchestrator.bench.activation import bench_command, format_text, register

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what")
    register(sub)
    args = parser.parse_args(["activation", "--json"])
    assert args.func is bench_command and args.json
    assert args.repetitions >= 10
    assert parser.parse_args(["activation", "--repetitions", "3"]).repetitions == 3
    assert bench_command(argparse.Namespace(repetitions=0)) == 2
    samples, steps, events = synthetic_samples(reps=2)
    for s in samples:
        measure(s, steps, steps, events, events)
    out = summarize(samples, ("baseline", "pause_swap", "double_buffer", "pause_free"),
                    throughput_from=("double_buffer", "pause_free"))
    text = format_text({**out, "streams": 8, "median_step_ms": 50.0})
    assert "stall_ratio" in text and "pause_free" in text
    row = {"rank": 16, "stall_ms": 1.5, "stall_ms_p90": 4.5, "pause_free_stall_ms": 2.0, "pause_free_stall_ms_p90": 7.0,
           "pause_swap_stall_ms": 90.0, "adapter_bytes": 10, "model_bytes": 1000, "bytes_ratio": 0.01}
    line = format_text({**out, "lora_row": row}).splitlines()[-2]
    assert "stall_ms 1.5 (p90 4.5) vs pause_free 2.0 (p90 7.0)" in line, line


# -- the worker's step clock (transports.swap.SwapWorkerExtension.swap_step_times) ------------

class FakeWorker:
    """Just enough of a vLLM worker: execute_model (None when sampling follows) and sample_tokens."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.model_runner = SimpleNamespace(execute_model=lambda *a: None)

    def execute_model(self, scheduler_output):
        self.calls.append("execute")
        return None if scheduler_output.total_num_scheduled_tokens else {"empty": True}

    def sample_tokens(self, grammar_output):
        self.calls.append("sample")
        return {"sampled": True}


def test_swap_step_times_records_token_steps_on_the_workers_clock():
    from transports.swap import SwapWorkerExtension

    worker = FakeWorker()
    runner_execute = worker.model_runner.execute_model
    first = SwapWorkerExtension.swap_step_times(worker)
    assert first["installed"] and first["steps"] == []
    step = SimpleNamespace(total_num_scheduled_tokens=3, num_scheduled_tokens={"a": 1, "b": 1, "c": 1})
    empty = SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})
    assert worker.execute_model(step) is None
    assert worker.sample_tokens(None) == {"sampled": True}
    assert worker.execute_model(empty) == {"empty": True}  # no tokens: not a step
    assert worker.execute_model(step) is None
    worker.sample_tokens(None)
    answer = SwapWorkerExtension.swap_step_times(worker, "")
    assert not answer["installed"]  # wrapped once
    assert worker.calls == ["execute", "sample", "execute", "execute", "sample"]
    assert len(answer["steps"]) == 2
    # what each step computed (its timestamps are the engine's own clock: not asserted here)
    assert [(requests, tokens) for _s, _e, _w, requests, tokens in answer["steps"]] == [(3, 3), (3, 3)]
    since = answer["steps"][0][1]
    later = SwapWorkerExtension.swap_step_times(worker, json.dumps({"since": since}))
    assert [s[1] for s in later["steps"]] == [answer["steps"][1][1]]
    assert worker.model_runner.execute_model is runner_execute  # swap_confirm's watch is left alone


# -- publishing in another process -----------------------------------------------------------

def test_publish_version_commits_a_readable_version(tmp_path):
    import torch
    from safetensors.torch import save_file

    from orchestrator.bench.activation_publish import _CACHE, describe, publish_version
    from transports.filesystem import COMPLETE, version_dir

    model = tmp_path / "model"
    model.mkdir()
    save_file({"a.weight": torch.ones(4, 8), "b.bias": torch.zeros(8)}, str(model / "model.safetensors"))
    root = tmp_path / "root"
    try:
        info = describe(str(model))
        assert info["parameters"] == 40 and json.loads(info["plan"])
        r1 = publish_version(str(model), str(root), 1)
        r2 = publish_version(str(model), str(root), 2)
    finally:
        _CACHE.pop(str(model), None)
    assert r1["version"] == 1 and r2["seconds"] >= 0
    for v in (1, 2):
        assert (version_dir(root, v) / COMPLETE).exists()


async def test_publishing_runs_in_another_process_without_blocking_the_loop(tmp_path):
    """The benchmark's loop keeps ticking while a version is written by the worker process."""
    import anyio
    import anyio.to_process
    import torch
    from safetensors.torch import save_file

    from orchestrator.bench.activation_publish import publish_version
    from transports.filesystem import COMPLETE, version_dir

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.ones(256, 256)}, str(model / "model.safetensors"))
    ticks_seen = 0

    async def tick():
        nonlocal ticks_seen
        while True:
            ticks_seen += 1
            await anyio.sleep(0.01)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            result = await anyio.to_process.run_sync(publish_version, str(model), str(tmp_path / "root"), 7,
                                                     cancellable=True)
            tg.cancel_scope.cancel()
    assert result["version"] == 7 and (version_dir(tmp_path / "root", 7) / COMPLETE).exists()
    assert ticks_seen >= 2


async def test_the_idle_twin_waits_for_the_engines_normal_rhythm_bounded(monkeypatch):
    """After an update whose recompute makes steps last seconds, the idle twin starts only once
    the engine's steps are back to their normal length; the wait is bounded."""
    import orchestrator.bench.activation_run as run
    from orchestrator.bench.activation_run import Bench

    class Raw:
        def __init__(self, steps):
            self.steps = steps

        async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
            assert method == "swap_step_times" and timeout
            since = json.loads(args[0])["since"]
            return [{"steps": [s for s in self.steps if s[1] > since], "now": 0.0}]

    bench = Bench(argparse.Namespace())
    bench.typical_step = 0.05
    # one 3 s recompute step, then normal ones
    bench.raw = Raw([[10.0, 13.0, 0, 8, 900], [13.0, 13.05, 0, 8, 8], [13.05, 13.1, 0, 8, 8], [13.1, 13.15, 0, 8, 8]])
    assert await bench.back_in_rhythm(10.0)
    bench2 = Bench(argparse.Namespace())
    bench2.typical_step = 0.05
    bench2.raw = Raw([[10.0, 13.0, 0, 8, 900], [13.0, 13.05, 0, 8, 8]])
    monkeypatch.setattr(run, "RHYTHM_TIMEOUT_S", 0.3)
    assert not await bench2.back_in_rhythm(10.0)


# -- the lora row ------------------------------------------------------------------------------

def test_the_lora_row_publishes_a_rank_16_adapter_on_every_linear_layer_that_vllm_reads(tiny_model_dir, tmp_path):
    from vllm.lora.peft_helper import PEFTHelper

    from orchestrator.bench.activation_lora import ADAPTERS_SUBDIR, RANK, TARGETS, publish_adapter
    from transports.adapters import adapter_dir, check_adapter

    out = publish_adapter(str(tiny_model_dir), str(tmp_path), 3)
    path = adapter_dir(tmp_path / ADAPTERS_SUBDIR, 3)
    summary = check_adapter(path)
    assert summary["rank"] == RANK and set(summary["target_modules"]) == set(TARGETS)
    assert summary["tensors"] == 2 * len(TARGETS) * 2  # A and B per target, two decoder layers
    assert out["adapter_bytes"] == (path / "adapter_model.safetensors").stat().st_size
    assert 0 < out["adapter_bytes"] and out["model_bytes"] > 0
    helper = PEFTHelper.from_local_dir(str(path), max_position_embeddings=None)
    assert helper.r == RANK and helper.vllm_lora_scaling_factor == 2.0


def test_the_lora_row_summary_compares_its_stall_with_pause_free_and_bytes_with_the_model():
    from orchestrator.bench.activation_lora import LoraRow

    row = LoraRow.__new__(LoraRow)
    row.sizes = [(1_000, 100_000)]
    result = {"lora": {"stall_ms": 3.0, "stall_ms_p90": 8.0}, "pause_free": {"stall_ms": 4.0, "stall_ms_p90": 9.0},
              "pause_swap": {"stall_ms": 90.0, "stall_ms_p90": 120.0}}
    s = row.summary(result)
    assert s["bytes_ratio"] == 0.01 and s["stall_within_pause_free"] is True
    assert s["stall_p90_within_pause_free"] is True
    assert (s["pause_free_stall_ms"], s["pause_swap_stall_ms"]) == (4.0, 90.0)
    assert (s["stall_ms_p90"], s["pause_free_stall_ms_p90"], s["pause_swap_stall_ms_p90"]) == (8.0, 9.0, 120.0)
    result["lora"]["stall_ms"] = 5.0
    assert row.summary(result)["stall_within_pause_free"] is False
    result["lora"]["stall_ms_p90"] = 9.5  # the goal holds for the p90 too
    assert row.summary(result)["stall_p90_within_pause_free"] is False
    assert row.summary({}) == {}, "no lora row measured: nothing claimed"


def test_the_lora_window_starts_where_its_staging_was_seen_done_and_the_staging_stall_is_reported_beside_it():
    """The lora row's window is the pause-free row's: from the end of the off-step staging to the
    activation's return; what the staging itself cost the steps is measured too (its longest gap
    against the idle twin's first seconds of the same length), so nothing is left out."""
    import asyncio

    from orchestrator.bench.activation_lora import LoraRow
    from orchestrator.fleet.adapters import adapter_name

    # The engine steps every 20 ms; during the staging [1.0, 1.3] one gap of 100 ms (1.1 -> 1.2);
    # the flip window [1.3, 1.4] holds no gap past the rhythm; the idle twin from 3.0 is regular.
    engine = ticks(0.0, 1.1, 0.02) + ticks(1.2, 5.0, 0.02)
    sample = Sample("lora", 0, t0=1.3, t1=1.4, idle_t0=3.0, staging=(1.0, 1.3), idle_s=0.3)
    m = measure(sample, engine, engine)
    assert m["engine_stall_ms"] == pytest.approx(0.0, abs=1e-6)
    assert m["engine_staging_stall_ms"] == pytest.approx(80.0)
    assert m["staging_ms"] == pytest.approx(300.0)
    # An idle twin shorter than the staging measures no staging stall (never a guess).
    short = measure(Sample("lora", 0, t0=1.3, t1=1.4, idle_t0=3.0, staging=(1.0, 1.3)), engine, engine)
    assert "engine_staging_stall_ms" not in short
    summary = summarize([sample], ["lora"], throughput_from=())
    assert summary["lora"]["staging_stall_ms"] == pytest.approx(80.0)

    # The window's start is the engines' `adapter_staged_at` for that version's adapter.
    class Coordinator:
        started_at, live_version = 1.0, 0

    class Engine:
        adapter_staged_at = {adapter_name(7): 1.3}

    class Fleet:
        coordinator, engines = Coordinator(), {"engine-0": Engine()}

        async def activate(self, version):
            return SimpleNamespace(outcome="activated", engines=[])

        def request_adapter(self, version):
            return None

    row = LoraRow.__new__(LoraRow)
    row.fleet, row.load = Fleet(), SimpleNamespace(adapter=None)
    t0, t1, staging = asyncio.run(row.activate(7, 0))
    assert (t0, staging) == (1.3, (1.0, 1.3)) and t1 >= t0
    Engine.adapter_staged_at = {}  # not seen (no swap extension): the window is the whole activation
    t0, _t1, staging = asyncio.run(row.activate(7, 0))
    assert (t0, staging) == (1.0, (1.0, 1.0))
