"""The state of one version being staged inside an engine worker (`transports.swap`): which
version, how far, and the generation that lets a dropped stage's thread notice it was dropped
and leave the shadow alone. Read by `swap_status`; every field under `lock`."""

from __future__ import annotations

import threading


class StagingDropped(Exception):
    """A staging thread noticed that its stage was dropped; it stops before writing anything."""


class Stager:
    """One version being staged on a thread; its state is read by `swap_status`."""

    def __init__(self) -> None:
        # Re-entrant: swap_drop answers with snapshot() while it holds the lock (a plain Lock
        # deadlocked the worker there: every later RPC and forward pass waited forever).
        self.lock = threading.RLock()
        self.state = "idle"
        self.version: int | None = None
        self.attempt: int | None = 0
        self.error: str | None = None
        self.seconds = 0.0
        self.thread: threading.Thread | None = None
        self.generation = 0  # bumped by drop(): a thread of an older generation discards its result
        self.cancel = threading.Event()  # set by drop(): the current thread stops at its next check

    def snapshot(self) -> dict:
        with self.lock:
            return {"state": self.state, "version": self.version, "attempt": self.attempt,
                    "error": self.error, "seconds": round(self.seconds, 4)}

    def check(self, generation: int) -> None:
        """Raises `StagingDropped` when the stage of `generation` was dropped meanwhile."""
        with self.lock:
            if self.generation != generation:
                raise StagingDropped()

    def wait_previous(self, join_s: float) -> None:
        """Waits (at most `join_s`) for the previous staging thread to end; refuses while it
        lives: two threads must never write one shadow."""
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(max(0.0, join_s))
        if thread.is_alive():
            raise RuntimeError(f"previous staging still running (version {self.version}, thread {thread.name}); "
                               f"waited {join_s:g} s")
