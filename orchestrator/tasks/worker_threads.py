"""The worker threads that run plain-`def` user code (`user_code.UserCode`), kept between calls.

A call that runs past its time is abandoned, never joined, so these cannot be a fixed pool: a
call that never returns would hold a thread of it for good. Each call takes an idle thread or
starts one; a thread goes back to the idle list when its call returns (an abandoned one too, if
it ever does) and ends after `IDLE_S` without a call. Why keep them at all: `Thread.start` blocks
its caller until the new thread runs, and on a busy run's loop that is a hand-over of the GIL:
0.3-0.9 ms of the loop a call in `inflight bench orchestrator`'s multi-turn rows, where a task's
row is fetched so for every group.

Each call runs in a fresh, empty `contextvars.Context`, as it would on a new thread: nothing one
call sets in a context variable is seen by the next on the same thread; the runner's `after_call`
(run on the thread, before it goes back to the idle list) ends what else a call leaves on its
thread (user_code: its event loop and the thread's current-loop setting). `threading.local` state
the user's code keeps (a client per thread) does stay with the thread, as in any pool."""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_S = 30.0  # an idle thread ends after this long without a call


class _Worker:
    def __init__(self, pool: WorkerThreads, name: str) -> None:
        self.pool = pool
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def _serve(self) -> None:
        while True:
            try:
                job = self.inbox.get(timeout=IDLE_S)
            except queue.Empty:
                if self.pool._retire(self):
                    return
                continue  # taken just now: its call is in the inbox
            if job is None:
                return
            hand_back = contextvars.Context().run(job)
            del job  # its arguments are not kept alive while the thread idles
            self.pool._after(self)
            # Idle before the caller hears the outcome: a caller that calls again at once finds
            # this thread, not a new one.
            self.pool._idle_again(self)
            try:
                hand_back()
            except Exception:  # the thread is sound, and may already hold the next call: it serves on
                log.exception("handing a call's outcome back failed")
            del hand_back


class WorkerThreads:
    """Threads for one runner's calls: `submit(job, name)` runs `job()` on an idle one or a new
    one and returns that thread (what a timed-out call's message reads its frames from). `job`
    returns what tells its caller the outcome, run once the thread is idle again."""

    def __init__(self, after_call: Callable[[], None] | None = None) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._after_call = after_call

    def submit(self, job: Callable[[], Callable[[], None]], name: str) -> threading.Thread:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self, name)
            worker.thread.start()
        else:
            worker.thread.name = name  # what the call is, for a stack dump or a debugger
        worker.inbox.put(job)
        return worker.thread

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        """End the idle threads; those running a call end when it returns (or stay abandoned)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.inbox.put(None)

    def _after(self, worker: _Worker) -> None:
        if self._after_call is not None:
            try:
                self._after_call()
            except Exception:  # a cleanup that failed must not end the thread with a call queued
                log.exception("cleaning up after a call on %s failed", worker.thread.name)

    def _idle_again(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def _retire(self, worker: _Worker) -> bool:
        with self._lock:
            if worker in self._idle:
                self._idle.remove(worker)
                return True
            return False
