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
from collections.abc import Callable, Sequence

import anyio

from orchestrator.scoring.outcome import REWARD_ERROR, REWARD_TIMEOUT, ScoreFailed, checked, one_line

IDLE_S = 10.0  # a thread with no call for this long ends (the next call starts one), as anyio's do


class _DaemonThreads:
    """Daemon threads that run one call each at a time, reused while idle. A call whose caller
    gave up (its timeout) keeps its thread until it returns, if ever; the thread is never joined."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._idle: list[queue.SimpleQueue] = []  # the inboxes of threads waiting for a call
        self._lock = threading.Lock()

    async def run(self, fn: Callable, *args):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=self.name, daemon=True).start()
        inbox.put((loop, future, fn, args))
        return await future  # cancelled: the thread finishes the call, and its result is dropped

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            try:
                loop, future, fn, args = inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody handed it a call meanwhile: end
                        self._idle.remove(inbox)
                        return
                continue
            try:
                outcome = (fn(*args), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome = (None, exc)
            with self._lock:  # idle before the caller hears: its next call finds this thread
                self._idle.append(inbox)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the loop is closed: nobody waits for this result any more
                pass
            del loop, future, fn, args, outcome  # hold nothing of the call while idle


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the caller timed out or was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Scorer:
    def __init__(self, task, *, workers: int, timeout_s: float) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self.limiter = anyio.CapacityLimiter(workers)
        self._threads = _DaemonThreads("inflight-score")

    async def start(self) -> None:
        """Nothing to start: threads come on demand (the same life as `ScorePool`)."""

    async def aclose(self) -> None:
        """Nothing to stop: an abandoned thread cannot be stopped."""

    async def score(self, prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        try:
            async with self.limiter:  # the wait for a free thread is not the call's time (as ScorePool's)
                with anyio.fail_after(self.timeout_s):
                    rewards = await self._threads.run(self.task.score_sync, prompt, completion_token_ids)
        except TimeoutError:
            raise ScoreFailed(REWARD_TIMEOUT, f"scoring took longer than task.score_timeout_s "
                                              f"({self.timeout_s:g} s)") from None
        except Exception as exc:  # noqa: BLE001 - a task's bug errors one rollout, not the run
            raise ScoreFailed(REWARD_ERROR, one_line(exc)) from None
        return checked(rewards)


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
