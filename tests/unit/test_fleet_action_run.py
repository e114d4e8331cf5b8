"""`ActionRun`: the real activation coordinator driven through the worker pool, with engines
played by a `perform` that answers each action (at once, or after a wait). What the pool
guarantees: engines that answer at once cost no task each, an engine that does not answer
holds back no other, a fleet of slow engines is waited on all at once, and one engine's
actions run in the order the coordinator gave them."""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel

from orchestrator.activation import coordinator as act
from orchestrator.fleet.action_run import ActionRun


def answer(a: act.EngineAction) -> act.Event | None:
    """What an engine that did the action says."""
    e, at = a.engine, time.monotonic()
    if isinstance(a, act.Stage):
        return act.Staged(engine=e, at=at, version=a.version)
    if isinstance(a, act.Pause):
        return act.Paused(engine=e, at=at)
    if isinstance(a, act.Swap):
        return act.Swapped(engine=e, at=at, version=a.version, requests={})
    if isinstance(a, act.FenceCache):
        return act.CacheFenced(engine=e, at=at)
    if isinstance(a, act.SetVersion):
        return act.VersionSet(engine=e, at=at, version=a.version, requests={})
    if isinstance(a, act.Resume):
        return act.Resumed(engine=e, at=at)
    return None


class Engines:
    """Plays every engine; counts the workers and the actions under way at once."""

    def __init__(self, delay_s: dict[str, float] | None = None, hold: dict[str, anyio.Event] | None = None):
        self.delay_s = delay_s or {}
        self.hold = hold or {}
        self.done: list[act.EngineAction] = []
        self.under_way = 0
        self.most_under_way = 0
        self.most_workers = 0
        self.run: ActionRun | None = None

    async def perform(self, a: act.EngineAction) -> act.Event | None:
        self.most_workers = max(self.most_workers, self.run._workers)
        self.under_way += 1
        self.most_under_way = max(self.most_under_way, self.under_way)
        try:
            if isinstance(a, act.Pause) and a.engine in self.hold:
                await self.hold[a.engine].wait()
            if self.delay_s.get(a.engine):
                await anyio.sleep(self.delay_s[a.engine])
        finally:
            self.under_way -= 1
        self.done.append(a)
        return answer(a)


async def activate(engines: Engines, n: int, *, until=None) -> act.Record:
    coord = act.ActivationCoordinator([f"e{i}" for i in range(n)])
    async with anyio.create_task_group() as tg:
        engines.run = run = ActionRun(tg, engines.perform, coord.handle)
        run.dispatch(coord.begin(1, time.monotonic()))
        if until is not None:
            await until(run)
        await run.wait()
        assert run.close() == []
        tg.cancel_scope.cancel()
    assert run.record is not None
    return run.record


async def test_engines_that_answer_at_once_need_one_worker_not_a_task_each():
    engines = Engines()
    record = await activate(engines, 64)
    assert record.outcome == act.ACTIVATED and len(record.engines) == 64
    assert engines.most_workers == 1
    assert len(engines.done) == 64 * 6  # stage, pause, swap, cache fence, label, resume


async def test_an_engine_that_does_not_answer_holds_back_no_other():
    release = anyio.Event()
    engines = Engines(hold={"e0": release})

    async def the_others_paused(run: ActionRun) -> None:
        with anyio.fail_after(10):
            while sum(isinstance(a, act.Pause) for a in engines.done) < 15:
                await anyio.sleep(0.01)
        assert not any(isinstance(a, act.Pause) and a.engine == "e0" for a in engines.done)
        release.set()

    record = await activate(engines, 16, until=the_others_paused)
    assert record.outcome == act.ACTIVATED


async def test_a_fleet_of_slow_engines_is_waited_on_all_at_once():
    engines = Engines(delay_s={f"e{i}": 0.05 for i in range(32)})
    record = await activate(engines, 32)
    assert record.outcome == act.ACTIVATED
    assert engines.most_under_way == 32, "some engine's action waited for another engine's"


async def test_one_engines_actions_run_in_the_order_given_and_never_two_at_once():
    order: list[str] = []

    async def perform(a: act.EngineAction) -> None:
        order.append(f"start {type(a).__name__}")
        await anyio.sleep(0.02)  # the engine is slow: a second worker takes the next job
        order.append(f"end {type(a).__name__}")

    async with anyio.create_task_group() as tg:
        run = ActionRun(tg, perform, lambda event: [])
        run.dispatch([act.Pause(engine="a", mode="keep", clear_cache=True), act.Resume(engine="a")])
        with anyio.fail_after(10):
            while len(order) < 4:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert order == ["start Pause", "end Pause", "start Resume", "end Resume"]


async def test_jobs_queued_after_the_end_are_handed_back_not_run():
    started: list[act.EngineAction] = []

    async def perform(a: act.EngineAction) -> None:
        started.append(a)

    async with anyio.create_task_group() as tg:
        run = ActionRun(tg, perform, lambda event: [])
        drop = act.DropStaged(engine="a", version=2)
        left = run.close()
        run.dispatch([drop])  # after close: ignored
        await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    assert left == [] and started == []
    async with anyio.create_task_group() as tg:
        run = ActionRun(tg, perform, lambda event: [])
        run.dispatch([drop])
        left = run.close()  # before any worker ran
        tg.cancel_scope.cancel()
    assert left == [drop] and started == []
