"""A push transport's receiver inside an engine worker (`transports.swap`): built on a thread
off the worker's core (a collective one waits there for the trainer's rendezvous) and kept across
versions while its options stay the same. After a failed version only a collective group can be
left unusable (`failed` marks it broken: it needs a fresh rendezvous); http and ipc receivers
clean up after themselves and stay.

Light imports only (this package; the receiver modules inside the build thread)."""

from __future__ import annotations

import json
import threading
from typing import Any

from transports.shadow import offload_current_thread


class ReceiverLink:
    """The receiver of a push transport, built on a thread off the worker's core and kept
    across versions. See the module docstring for what happens after a failed version."""

    def __init__(self, transport: str, options: dict, plan, worker_rank: int, worker_cpus: set[int]) -> None:
        self.transport = transport
        self.options = options
        self.plan = plan
        self.worker_rank = worker_rank
        self.worker_cpus = worker_cpus
        self.key = link_key(transport, options, plan)
        self.receiver: Any = None
        self.error: str | None = None
        self.broken: str | None = None
        self.closed = False
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._build, name=f"inflight-{transport}-receiver", daemon=True)
        self.thread.start()

    def _build(self) -> None:
        from transports.endpoint import make_receiver

        offload_current_thread(self.worker_cpus)
        try:
            receiver = make_receiver(self.transport, self.plan, self.options, self.worker_rank)
        except BaseException as exc:  # noqa: BLE001 - reported by get()
            self.error = f"{type(exc).__name__}: {exc}"
            receiver = None
        with self.lock:
            if self.closed and receiver is not None:
                receiver.close()  # closed while it was being built (new options arrived)
                receiver = None
            self.receiver = receiver
        self.ready.set()

    def get(self, timeout_s: float):
        from transports.errors import TransportError, TransportTimeoutError

        if not self.ready.wait(timeout_s):
            raise TransportTimeoutError(f"the {self.transport} receiver to connect", timeout_s)
        if self.error is not None:
            raise TransportError(f"the {self.transport} receiver could not be built: {self.error}")
        if self.broken is not None:
            raise TransportError(f"the {self.transport} link is broken since a failed version ({self.broken}); "
                                 "it needs a fresh rendezvous: swap_init with the trainer's new options")
        if self.receiver is None:
            raise TransportError(f"the {self.transport} receiver is closed")
        return self.receiver

    def failed(self, exc: BaseException) -> None:
        """After a failed version (see the module docstring). Only a collective group can be
        left unusable; http and ipc receivers clean up after themselves (queued buckets freed,
        stale ones skipped by version and attempt). Rebuilding the http listener would lose the
        next version: the trainer's kept-alive connection still ends in the old server's
        handler thread, which queues into the old receiver."""
        from transports.errors import RefitMismatchError

        if self.transport == "collective" and not isinstance(exc, RefitMismatchError):
            # A refused bucket leaves the group in step (the receiver takes in the rest of the
            # version); a timeout or a broken peer does not.
            self.broken = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        with self.lock:
            self.closed = True
            receiver, self.receiver = self.receiver, None
        if receiver is not None:
            try:
                receiver.close()
            except Exception as exc:  # noqa: BLE001 - closing a receiver that already failed
                self.error = self.error or f"closing: {type(exc).__name__}: {exc}"


def link_key(transport: str, options: dict, plan) -> str:
    return json.dumps([transport, options, getattr(plan, "arena_bytes", None)], sort_keys=True, default=str)
