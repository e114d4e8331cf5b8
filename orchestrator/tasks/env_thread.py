"""Where environments' code runs: one thread with its own asyncio event loop, off the run's.

An environment's async `reset`/`step` runs as a task on that loop (so a step that awaits, a
tool's HTTP call say, never holds the run's loop, and many episodes' steps interleave there); a
plain `def` runs in that loop's thread pool (a blocking one holds a pool thread, not the loop).
Each call is bounded by the caller's timeout, and a call past it is cancelled on the
environment's loop (an async step stops at its next await; a thread cannot be stopped and is
left to finish). One hop per call: `asyncio.run_coroutine_threadsafe` there, a future back
here: about a quarter of what a fresh `anyio.to_thread` hop costs per turn, measured by
`inflight bench orchestrator`'s multi_turn_overhead_ratio.
"""

from __future__ import annotations

import asyncio
import inspect
import threading

import anyio


class EnvironmentThread:
    def __init__(self, name: str = "environments") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def call(self, timeout_s: float, fn, *args):
        """`fn(*args)` (awaited when it returns an awaitable) on the environment loop."""
        future = asyncio.run_coroutine_threadsafe(self._invoke(fn, args), self._loop)
        waiting = asyncio.wrap_future(future)
        try:
            with anyio.fail_after(timeout_s):
                return await waiting
        except BaseException:
            future.cancel()
            raise

    async def _invoke(self, fn, args):
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        result = await self._loop.run_in_executor(None, fn, *args)
        if inspect.isawaitable(result):
            result = await result
        return result

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
