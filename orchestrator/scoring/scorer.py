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
import collections
import queue
import threading
import weakref
from collections.abc import Callable, Sequence

from orchestrator.scoring.outcome import REWARD_ERROR, REWARD_TIMEOUT, ScoreFailed, checked, one_line

IDLE_S = 10.0  # a thread with no call for this long ends (the next call starts one), as anyio's do


class _DaemonThreads:
    """Daemon threads that take calls from one queue, one call each at a time, reused while idle.
    A call whose caller gave up (its timeout) keeps its thread until it returns, if ever; the
    thread is never joined.

    A hop costs the event loop little (`inflight bench orchestrator`: a free score through a
    thread and back cost about 150 us of the loop's CPU a call when each call had a thread's
    inbox and each result a wake-up of the loop of its own): a call goes on the shared queue
    (a thread that just finished one takes it without sleeping), and the results that come back
    before the loop runs again are handed over together, with one wake-up (`_Results`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (results, future, fn, args)
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a call that no call queued has counted on yet
        self._results: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> _Results

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable, args: tuple) -> asyncio.Future:
        """`fn(*args)` in a thread; its outcome settles the future returned (on `loop`). A future
        cancelled meanwhile: the thread finishes the call, and its result is dropped."""
        future = loop.create_future()
        results = self._results.get(loop)
        if results is None:
            results = self._results[loop] = _Results()
        with self._lock:
            claimed = self._idle > 0
            if claimed:
                self._idle -= 1
        if not claimed:  # every thread is busy (or abandoned): one more
            threading.Thread(target=self._serve, name=self.name, daemon=True).start()
        self._calls.put((results, future, fn, args))
        return future

    def _serve(self) -> None:
        # The threads waiting here, not holding a call, are `_idle` + the calls queued: a thread
        # ends only while an idle one is left uncounted on, so every queued call finds a thread.
        while True:
            try:
                results, future, fn, args = self._calls.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:
                        self._idle -= 1
                        return
                continue  # a call counted on this thread is on its way
            try:
                outcome = (fn(*args), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome = (None, exc)
            with self._lock:  # idle before the caller hears: its next call finds this thread
                self._idle += 1
            results.add(future, outcome)
            del results, future, fn, args, outcome  # hold nothing of the call while idle


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
    by `timeout_s` from when it starts (the wait for a thread is not its time, as ScorePool's).

    Plain asyncio futures and one timer a call, not anyio's CapacityLimiter and fail_after: with
    64 rollouts scoring through 4 threads these cost the event loop about 55 us a call (a waiter's
    event, its checkpoints, a cancel scope), more than the thread hop itself."""

    def __init__(self, task, *, workers: int, timeout_s: float) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self.workers = workers
        self._running = 0  # calls holding one of the `workers` slots
        self._waiting: collections.deque[asyncio.Future] = collections.deque()  # for a slot, in order
        self._threads = _DaemonThreads("inflight-score")

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
        await self._slot(loop)
        try:
            future = self._threads.submit(loop, fn, args)
            timer = loop.call_later(self.timeout_s, _expire, future)
            try:
                return await future  # cancelled: the thread finishes the call, its result dropped
            finally:
                timer.cancel()
        finally:
            self._release()

    async def _slot(self, loop: asyncio.AbstractEventLoop) -> None:
        """One of the `workers` slots; waits (first come, first served) while all are held."""
        if self._running < self.workers and not self._waiting:
            self._running += 1
            return
        gate = loop.create_future()
        self._waiting.append(gate)
        try:
            await gate  # the call ending hands its slot over (`_release`)
        except BaseException:
            if gate.done() and not gate.cancelled():  # handed a slot, then cancelled: pass it on
                self._release()
            elif gate in self._waiting:  # (a cancelled gate may already be passed over)
                self._waiting.remove(gate)
            raise

    def _release(self) -> None:
        while self._waiting:
            gate = self._waiting.popleft()
            if not gate.done():
                gate.set_result(None)  # the slot goes to the next waiter (still counted running)
                return
        self._running -= 1


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def make_scorer(task, *, pool: str, workers: int, timeout_s: float, builder: Callable[[], object] | None = None,
                where: str = "task"):
    """The scorer `task.score_pool` names: "thread" scores `task` in this process's threads;
    "process" builds the task again in each of `workers` processes with `builder` (a picklable
    zero-argument callable, e.g. `functools.partial(make_task, config, model_dir, ...)`).
    Either has `start()`, `score()` and `aclose()`."""
    if pool == "thread":
        return Scorer(task, workers=workers, timeout_s=timeout_s)
    if pool == "process":
        if builder is None:
            raise ValueError("a process pool builds its task in each worker: give builder=")
        from orchestrator.scoring.pool import ScorePool

        return ScorePool(builder, workers=workers, timeout_s=timeout_s, where=where, name=f"{where}-score")
    from orchestrator.errors import ConfigError

    raise ConfigError(f"{where}.score_pool", f"must be \"process\" or \"thread\", got {pool!r}")
