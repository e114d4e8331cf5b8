"""Scoring completions off the event loop, bounded in time.

A task's `score_sync` (the user's reward functions included) runs in one of `task.score_workers`
worker threads (`Scorer`, `task.score_pool = "thread"`) or worker processes
(`orchestrator.scoring.pool.ScorePool`, "process"), each call bounded by `task.score_timeout_s`;
`make_scorer` builds the one configured. A call that raises or returns no finite "reward" is a
`ScoreFailed` of kind `reward_error`; one past its time is `reward_timeout` (a process is killed
and replaced; a thread is abandoned, not killed: Python cannot stop a thread, so a reward
function that never returns keeps that thread; the run goes on with fresh ones). The rollout is
then recorded `errored(<kind>)` with the message, and the run goes on.

The threads are the scorer's own daemon threads (`_DaemonThreads`), not anyio's: an anyio worker
thread is not a daemon, so a reward function that never returns held the process at its exit
(Python joins every non-daemon thread), and a run whose scoring hung never ended.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from orchestrator.scoring.outcome import REWARD_ERROR, REWARD_TIMEOUT, ScoreFailed, checked, one_line

IDLE_S = 10.0  # a thread with no call for this long ends (the next call starts one), as anyio's do


class _Call:
    """One call to score: its future on the caller's loop, and when a thread started it."""

    __slots__ = ("future", "fn", "args", "results", "started_at", "finished", "abandoned")

    def __init__(self, future: asyncio.Future, fn: Callable, args: tuple, results: _Results) -> None:
        self.future, self.fn, self.args, self.results = future, fn, args, results
        self.started_at: float | None = None  # monotonic, set by the thread that runs it
        self.finished = False  # its thread is done with it
        self.abandoned = False  # given up while it ran: its thread leaves the pool once it returns


class _DaemonThreads:
    """At most `workers` daemon threads serving calls from one queue, in arrival order, one at a
    time each; idle ones end after IDLE_S. A thread whose call was given up while it ran (its
    timeout) is abandoned (it cannot be stopped, and is never joined): it leaves the pool when the
    call returns, if ever, and another takes its place at once.

    The pool's slots are held by threads, not by the event loop: a thread that finishes a call
    takes the next waiting one at once, and the results that come back before the loop runs again
    are handed over together, with one wake-up of the loop (`_Results`). `inflight bench
    orchestrator` (64 rollouts, 4 threads, a free score): the hop through anyio's limiter,
    fail_after and a thread's inbox cost the loop about 60-70 us of CPU a call, and a slot was
    held for a round trip through the busy loop."""

    def __init__(self, name: str, workers: int) -> None:
        self.name = name
        self.workers = workers
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the three counts
        self._serving = 0  # threads of the pool (abandoned ones are not)
        self._busy = 0  # of those, running a call
        self._queued = 0  # calls queued, not yet taken
        self._results: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> _Results

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable, args: tuple) -> _Call:
        """Queue `fn(*args)`; its outcome settles `call.future` (on `loop`). A call whose future
        is done (cancelled, timed out) before a thread takes it never runs."""
        results = self._results.get(loop)
        if results is None:
            results = self._results[loop] = _Results()
        call = _Call(loop.create_future(), fn, args, results)
        with self._lock:
            self._queued += 1
            start = self._more_needed()
        if start:
            threading.Thread(target=self._serve, name=self.name, daemon=True).start()
        self._calls.put(call)
        return call

    def _more_needed(self) -> bool:
        """(Under the lock.) Whether the calls queued outnumber the waiting threads and the pool
        has room: then one more thread is counted (the caller starts it)."""
        if self._queued > self._serving - self._busy and self._serving < self.workers:
            self._serving += 1
            return True
        return False

    def abandon(self, call: _Call) -> None:
        """Its caller gave up on a call that a thread runs: that thread leaves the pool."""
        with self._lock:
            if call.finished or call.abandoned:
                return
            call.abandoned = True
            self._serving -= 1
            self._busy -= 1
            start = self._more_needed()
        if start:
            threading.Thread(target=self._serve, name=self.name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._serving - self._busy > self._queued:  # a waiting thread to spare: end
                        self._serving -= 1
                        return
                continue
            with self._lock:
                self._queued -= 1
                self._busy += 1
            outcome = None
            if not call.future.done():  # else given up before it started: never runs
                call.started_at = time.monotonic()
                try:
                    outcome = (call.fn(*call.args), None)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    outcome = (None, exc)
            with self._lock:
                call.finished = True
                if call.abandoned:  # replaced meanwhile: this thread is no longer the pool's
                    return
                self._busy -= 1  # free before the caller hears: its next call finds this thread
            if outcome is not None:
                call.results.add(call.future, outcome)
            del call, outcome  # hold nothing of the call while idle


class _Results:
    """Outcomes on their way back to one event loop: those that arrive before it runs again are
    settled together, after one wake-up of the loop (a write to its self-pipe) for all of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: list = []

    def add(self, future: asyncio.Future, outcome: tuple) -> None:
        with self._lock:
            self._ready.append((future, outcome))
            first = len(self._ready) == 1
        if first:
            try:
                future.get_loop().call_soon_threadsafe(self._settle_ready)
            except RuntimeError:  # the loop is closed: nobody waits for these results any more
                with self._lock:
                    self._ready.clear()

    def _settle_ready(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for future, (result, error) in ready:
            _settle(future, result, error)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the caller timed out or was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Scorer:
    """At most `workers` calls run at once, the others wait in arrival order; each call is bounded
    by `timeout_s` from when a thread starts it (the wait for a thread is not its time, as
    ScorePool's). One timer a loop for all its calls (`_Watch`), set for the earliest time a
    call in flight can be due: a timer a call (made and cancelled for every rollout) cost the loop
    ~2-3 us a call in `inflight bench orchestrator`."""

    def __init__(self, task, *, workers: int, timeout_s: float) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self.workers = workers
        self._threads = _DaemonThreads("inflight-score", workers)
        self._watches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> _Watch

    async def start(self) -> None:
        """Nothing to start: threads come on demand (the same life as `ScorePool`)."""

    async def aclose(self) -> None:
        """Nothing to stop: an abandoned thread cannot be stopped."""

    async def score(self, prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        try:
            rewards = await self._call(self.task.score_sync, (prompt, completion_token_ids))
        except TimeoutError:
            raise ScoreFailed(REWARD_TIMEOUT, f"scoring took longer than task.score_timeout_s "
                                              f"({self.timeout_s:g} s)") from None
        except Exception as exc:  # noqa: BLE001 - a task's bug errors one rollout, not the run
            raise ScoreFailed(REWARD_ERROR, one_line(exc)) from None
        return checked(rewards)

    async def _call(self, fn: Callable, args: tuple):
        loop = asyncio.get_running_loop()
        call = self._threads.submit(loop, fn, args)
        watch = self._watches.get(loop)
        if watch is None:
            watch = self._watches[loop] = _Watch()
        watch.calls.add(call)
        if watch.timer is None:  # none in flight on this loop until now: nothing is due before this
            watch.timer = loop.call_later(self.timeout_s, self._sweep, watch)
        try:
            return await call.future
        except BaseException:
            if call.future.cancelled() and call.started_at is not None:
                self._threads.abandon(call)  # cancelled while it runs: the thread finishes it alone
            raise
        finally:
            watch.calls.discard(call)

    def _sweep(self, watch: _Watch) -> None:
        """The loop's timer: every call in flight past `timeout_s` since its thread started it
        fails with TimeoutError (its thread is abandoned); then the timer is set again for the
        earliest time one can be due (a call not started yet: `timeout_s` from now at the
        earliest), or left unset with nothing in flight."""
        watch.timer = None
        if not watch.calls:
            return
        now = time.monotonic()
        next_due = now + self.timeout_s
        for call in list(watch.calls):
            if call.future.done() or call.started_at is None:
                continue
            due = call.started_at + self.timeout_s
            if due <= now:
                call.future.set_exception(TimeoutError())
                self._threads.abandon(call)
            else:
                next_due = min(next_due, due)
        watch.timer = asyncio.get_running_loop().call_later(next_due - now, self._sweep, watch)


class _Watch:
    """One event loop's calls in flight, and its timer (None: not set, nothing in flight)."""

    __slots__ = ("calls", "timer")

    def __init__(self) -> None:
        self.calls: set[_Call] = set()
        self.timer: asyncio.TimerHandle | None = None


def make_scorer(task, *, pool: str, workers: int, timeout_s: float, builder: Callable[[], object] | None = None,
                where: str = "task", spare: bool = True):
    """The scorer `task.score_pool` names: "thread" scores `task` in this process's threads;
    "process" builds the task again in each of `workers` processes with `builder` (a picklable
    zero-argument callable, e.g. `functools.partial(make_task, config, model_dir, ...)`), and with
    `spare` one more, built ahead to replace a killed one at once. Either has `start()`, `score()`
    and `aclose()`."""
    if pool == "thread":
        return Scorer(task, workers=workers, timeout_s=timeout_s)
    if pool == "process":
        if builder is None:
            raise ValueError("a process pool builds its task in each worker: give builder=")
        from orchestrator.scoring.pool import ScorePool

        return ScorePool(builder, workers=workers, timeout_s=timeout_s, where=where, name=f"{where}-score",
                         spare=spare)
    from orchestrator.errors import ConfigError

    raise ConfigError(f"{where}.score_pool", f"must be \"process\" or \"thread\", got {pool!r}")
