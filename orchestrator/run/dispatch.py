"""The hand-over of journalled dispatches to the rollout workers of the run loop.

`ReadyQueue` is a deque of dispatches and a future per idle worker, not an anyio memory stream:
on the zero-latency engine of `inflight bench orchestrator` the stream's receive (its checkpoints,
a waiter's event and cancel-scope bookkeeping) cost about 20 us of the loop's CPU a rollout. A
dispatch handed to a worker that is cancelled before it resumes is put back, never lost (the
run's stop then records it with those that never started).
"""

from __future__ import annotations

import asyncio
import collections


class ReadyQueue:
    """Dispatches waiting for a worker, in order; workers waiting for a dispatch, in order."""

    def __init__(self) -> None:
        self._ready: collections.deque = collections.deque()
        self._idle: collections.deque[asyncio.Future] = collections.deque()

    def __len__(self) -> int:
        return len(self._ready)

    def put(self, item) -> None:
        """To the longest idle worker, else queued (never waits)."""
        while self._idle:
            waiter = self._idle.popleft()
            if not waiter.done():
                waiter.set_result(item)
                return
        self._ready.append(item)

    async def take(self):
        """The next dispatch; waits while there is none."""
        if self._ready:
            return self._ready.popleft()
        waiter = asyncio.get_running_loop().create_future()
        self._idle.append(waiter)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # handed one, then cancelled: put it back
                self._ready.appendleft(waiter.result())
            elif waiter in self._idle:
                self._idle.remove(waiter)
            raise
