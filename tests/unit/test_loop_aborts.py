"""Aborts reach every rollout the scheduler drops: queued ones (no engine ever sees them), ones
waiting at a drain gate, and streaming ones, in one call per engine."""

from __future__ import annotations

import anyio
import pytest

from orchestrator.scheduling import scheduler as sch
from orchestrator.bench.orchestrator import BenchRun, fake_engine
from orchestrator.fleet.fleet import Fleet
from orchestrator.run.loop import RunLoop, request_id
from replay.log import read_records
from replay.records import RolloutRecord, SamplingSettings


class CountingEngine:
    """The fake engine, slowed down, counting what reaches it."""

    def __init__(self, engine_id: str = "fake-0", delay: float = 0.01) -> None:
        self.inner = fake_engine(engine_id)
        self.engine_id = engine_id
        self.started: list[str] = []
        self.abort_calls: list[list[str]] = []
        self.delay = delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None, final_only=False):
        self.started.append(request_id)
        async for chunk in self.inner.generate(request_id, prompt_token_ids, sampling, cache_salt, final_only):
            await anyio.sleep(self.delay)
            yield chunk

    async def abort(self, request_id):
        self.abort_calls.append([request_id])

    async def abort_many(self, request_ids):
        self.abort_calls.append(list(request_ids))


async def test_a_rollout_aborted_while_queued_ends_aborted_and_no_engine_sees_it(tmp_path):
    run = BenchRun(tmp_path, concurrency=16, rollouts=32)
    engine = CountingEngine()
    run.fleet = Fleet([engine])
    loop = run.loop = RunLoop(run)
    async with anyio.create_task_group() as tg:
        loop._tg = tg
        dispatches = [a for a in run.scheduler.start() if isinstance(a, sch.Dispatch)]
        loop.perform(dispatches)  # dispatched, journalled by nobody yet: queued
        victim = dispatches[0]
        loop.perform([sch.Abort(engine=victim.engine, rollout_ids=(victim.rollout_id,), reason="stale")])
        await loop._context(victim.rollout_id)
        await loop._rollout(victim)
        tg.cancel_scope.cancel()
    await run.recorder.flush()
    run.recorder.close()
    run.journal.close()
    assert request_id(victim.rollout_id) not in engine.started
    assert victim.rollout_id not in run.scheduler.rollouts  # it ended
    records = [r for r in read_records(tmp_path) if isinstance(r, RolloutRecord)]
    assert [(r.rollout_id, r.status_name) for r in records] == [(victim.rollout_id, "dropped")]
    assert victim.rollout_id not in loop.inflight and victim.rollout_id not in loop.aborting


async def test_streaming_rollouts_are_aborted_in_one_call_per_engine():
    engines = [CountingEngine("a", delay=0.05), CountingEngine("b", delay=0.05)]
    fleet = Fleet(engines)
    sampling = SamplingSettings(max_tokens=500)
    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(lambda i=i: fleet.generate([1], sampling, engine_id="ab"[i % 2], request_id=f"r{i}",
                                                     redispatch=False))
        with anyio.fail_after(10):
            while len(fleet.tracks) < 6:
                await anyio.sleep(0.01)
        await fleet.abort_many([f"r{i}" for i in range(6)])
        calls = [list(e.abort_calls) for e in engines]
        tg.cancel_scope.cancel()  # (each cancelled request then aborts itself: not what is checked)
    assert [sorted(c) for c in calls[0]] == [["r0", "r2", "r4"]]
    assert [sorted(c) for c in calls[1]] == [["r1", "r3", "r5"]]


async def test_a_request_waiting_at_a_drain_gate_is_aborted_before_any_engine_sees_it():
    engine = CountingEngine("a")
    fleet = Fleet([engine])
    fleet._gates["a"] = anyio.Event()  # "a" drains for an activation: new requests wait
    results = []
    async with anyio.create_task_group() as tg:
        async def one():
            results.append(await fleet.generate([1], SamplingSettings(max_tokens=8), request_id="held",
                                                redispatch=False))
        tg.start_soon(one)
        with anyio.fail_after(10):
            while "held" not in fleet._gate_waiters:
                await anyio.sleep(0.01)
        await fleet.abort_many(["held"])
    (completion,) = results
    assert completion.status == "dropped" and completion.reason == "aborted" and not completion.token_ids
    assert engine.started == [] and engine.abort_calls == []
    assert "held" not in fleet._gate_waiters


@pytest.mark.parametrize("n", [1, 3])
async def test_abort_many_ignores_requests_that_already_ended(n):
    engine = CountingEngine("a", delay=0.0)
    fleet = Fleet([engine])
    for i in range(n):
        await fleet.generate([1], SamplingSettings(max_tokens=8), request_id=f"done{i}", redispatch=False)
    await fleet.abort_many([f"done{i}" for i in range(n)])
    assert engine.abort_calls == []


def gauge(run, name: str) -> float:
    line = next(x for x in run.metrics.render().decode().splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


async def test_the_in_flight_gauge_reads_the_schedulers_count_when_scraped(tmp_path):
    run = BenchRun(tmp_path, concurrency=16, rollouts=64)
    run.fleet = Fleet([CountingEngine(delay=0.02)])  # ~0.6 s a rollout: 16 stay in flight a while
    loop = run.loop = RunLoop(run)
    seen: list[tuple[float, int]] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.main, run.scheduler.start())
        with anyio.fail_after(30):
            while len(seen) < 3:
                await anyio.sleep(0.05)
                seen.append((gauge(run, "inflight_rollouts_in_flight"), run.scheduler.inflight))
        loop.request_stop("test")
    assert all(scraped == count for scraped, count in seen) and seen[0][1] == 16
    assert gauge(run, "inflight_rollouts_in_flight") == run.scheduler.inflight == 0  # every rollout ended
    assert run.progress.state.inflight == 0
    await run.recorder.flush()
    run.recorder.close()
    run.journal.close()
