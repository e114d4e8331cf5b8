"""Performing the activation coordinator's actions at the engines' own speed, hundreds at a time.

    run = ActionRun(tg, perform, coordinator.handle, finished=lambda actions: ...)
    run.dispatch(coordinator.begin(version, now))     # the first actions
    await run.wait()                                  # until `finished` says so
    leftovers = run.close()                           # jobs queued that no worker took

Each batch of one engine's actions (what one answer of the coordinator holds for it) is a job:
its actions run in order, each engine's answer goes straight back to the coordinator (`feed`,
no stream, no await) and the actions it returns are queued in their turn. Jobs run
concurrently on a pool of worker tasks that grows only when it has to: whenever every worker
waits inside a job (an engine that does not answer at once) while jobs are queued, more
workers start. So an engine that answers at once costs no task of its own (a task and its
cancel scope are most of what an activation of N instant engines costed per engine:
`inflight bench orchestrator --fleet-scale`), and a slow engine costs only its own time: the
others' jobs go on beside it, on as many workers as there are engines waiting.

The workers run in the caller's task group: cancelling it cancels them. Timers (`StartTimer`)
each get a task that feeds the coordinator its `Timeout`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup

from orchestrator.activation import coordinator as act

# A worker that runs instant jobs back to back lets the loop run the others (rollouts
# streaming) after this many: a fleet of 1000 engines does not hold the loop for a whole phase.
JOBS_PER_TURN = 32


class ActionRun:
    def __init__(self, tg: TaskGroup, perform: Callable[[act.Action], Awaitable[act.Event | None]],
                 handle: Callable[[act.Event], list[act.Action]],
                 finished: Callable[[list[act.Action]], bool] | None = None,
                 on_queued: Callable[[act.EngineAction], None] | None = None) -> None:
        """`perform` does one action and returns the engine's answer (or None); `handle` is the
        coordinator's; `finished` says from a batch of actions that the run is done (by default:
        the batch holds the Record); `on_queued` sees every engine action as it is queued
        (before any worker takes it)."""
        self._tg = tg
        self._perform = perform
        self._handle = handle
        self._finished_by = finished
        self._on_queued = on_queued
        self._jobs: deque[list[act.EngineAction]] = deque()
        self._workers = 0
        self._inside = 0  # workers inside a job (waiting on an engine, when the spawner looks)
        self._wanted = anyio.Event()  # set: jobs are queued, and the workers may all be waiting
        self._wanted_set = False  # the same, cheaper to ask
        self._finished = anyio.Event()
        self._closed = False
        self.record: act.Record | None = None
        tg.start_soon(self._spawner)

    # -- in --------------------------------------------------------------------------------
    def dispatch(self, actions: list[act.Action]) -> None:
        """Queue the actions (one job per engine, its actions in order) and start the timers."""
        if self._closed:
            return
        by_engine: dict[str, list[act.EngineAction]] = {}
        for a in actions:
            kind = type(a)  # cheaper than isinstance, on every action of hundreds of engines
            if kind is act.Record:
                self.record = a
            elif kind is act.StartTimer:
                self._tg.start_soon(self._timer, a)
            else:
                if self._on_queued is not None:
                    self._on_queued(a)
                job = by_engine.get(a.engine)
                if job is None:
                    by_engine[a.engine] = job = []
                job.append(a)
        if by_engine:
            self._jobs.extend(by_engine.values())
            if self._workers == 0:
                self._spawn(1)
            else:
                self._want_workers()
        if self._finished_by is None:
            done = self.record is not None
        else:
            done = self._finished_by(actions)
        if done:
            self._finished.set()

    def feed(self, event: act.Event) -> None:
        """An event for the coordinator (an engine's answer, a timer, a death, a departure)."""
        if not self._closed:
            self.dispatch(self._handle(event))

    async def send(self, event: act.Event) -> None:
        """`feed`, for callers outside the run that held the old event stream's `send`."""
        self.feed(event)
        await anyio.lowlevel.checkpoint()

    # -- out -------------------------------------------------------------------------------
    async def wait(self) -> None:
        await self._finished.wait()

    def close(self) -> list[act.EngineAction]:
        """No more jobs start; the actions of those queued and never taken, in order."""
        self._closed = True
        left = [a for job in self._jobs for a in job]
        self._jobs.clear()
        return left

    # -- the pool --------------------------------------------------------------------------
    def _want_workers(self) -> None:
        if not self._wanted_set:
            self._wanted_set = True
            self._wanted.set()

    def _spawn(self, n: int) -> None:
        for _ in range(n):
            self._workers += 1
            self._tg.start_soon(self._worker)

    async def _spawner(self) -> None:
        """Woken when jobs are queued: if it runs while every worker is inside a job, they all
        wait on engines (it only runs when they yield), so the queued jobs need workers of their
        own. It doubles the pool each time: a fleet of slow engines fans out in log2(N) turns."""
        while True:
            await self._wanted.wait()
            self._wanted, self._wanted_set = anyio.Event(), False
            if self._jobs and self._inside == self._workers and not self._closed:
                self._spawn(min(len(self._jobs), max(1, self._workers)))

    async def _worker(self) -> None:
        try:
            done = 0
            while self._jobs and not self._closed:
                job = self._jobs.popleft()
                if self._jobs:
                    self._want_workers()  # if this job waits, the next ones need another worker
                self._inside += 1
                try:
                    for a in job:
                        event = await self._perform(a)
                        if event is not None:
                            self.feed(event)
                finally:
                    self._inside -= 1
                done += 1
                if done % JOBS_PER_TURN == 0:
                    await anyio.lowlevel.checkpoint()
        finally:
            self._workers -= 1

    async def _timer(self, timer: act.StartTimer) -> None:
        await anyio.sleep(timer.seconds)
        self.feed(act.Timeout(engine=timer.engine, at=time.monotonic(), phase=timer.phase, token=timer.token))
