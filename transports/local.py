"""A receiving endpoint in a separate plain process, driven over a pipe with a timeout on every
call: the "engine" of process-to-process tests and of `inflight bench transports`.

The child keeps the last applied state dict (`live()`), so a test can compare it with what the
trainer sent; `rss_baseline()` / `rss_start()` / `rss_stop()` measure its peak resident memory
for the benchmark (`transports.rss.PeakRss`).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

from transports.errors import TransportError, TransportTimeoutError


def _child(conn, transport: str, preallocate: dict[str, tuple[tuple[int, ...], str]] | None) -> None:
    import sys

    import structlog
    import torch

    # A spawned child starts with structlog's default (print to stdout); keep stdout for the
    # parent's output (`inflight bench transports --json` prints JSON there).
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))

    torch.set_num_threads(1)
    from transports.endpoint import ReceivingEndpoint

    live: dict[str, Any] = {}
    destination = None
    if preallocate is not None:
        destination = {k: torch.empty(shape, dtype=getattr(torch, dtype)) for k, (shape, dtype) in preallocate.items()}
        for t in destination.values():
            t.zero_()  # touch the pages so they count before the baseline

    def apply(staged):
        live.clear()
        live.update(staged)

    endpoint = ReceivingEndpoint(transport, apply, destination=destination)
    rss = None
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the parent went away
            endpoint.shutdown()
            return
        try:
            if method == "stop":
                endpoint.shutdown()
                conn.send(("ok", None))
                return
            if method == "live":
                result: Any = {k: v.clone() for k, v in live.items()} if args else sorted(live)
            elif method.startswith("rss_"):
                from transports.rss import PeakRss

                if method == "rss_baseline":
                    rss = PeakRss()
                    result = rss.base
                elif method == "rss_start":
                    rss.start()
                    result = None
                else:  # rss_stop: peak extra bytes so far
                    result = rss.stop()
            elif method == "live_version":
                result = endpoint.live_version
            elif method == "kv_scales":
                result = endpoint.kv_scales
            elif method == "bench_reference":  # the raw reference receivers of the benchmark
                from transports import references

                name, kwargs = args
                if not name.startswith("ref_"):
                    raise TransportError(f"unknown reference receiver {name!r}")
                result = getattr(references, name)(destination, **kwargs)
            else:
                result = getattr(endpoint, method)(*args)
            conn.send(("ok", result))
        except BaseException as exc:  # sent back and re-raised in the parent
            try:
                conn.send(("error", exc))
            except Exception:
                conn.send(("error", TransportError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))


class ProcessEngine:
    """`EngineWeightControl` for an endpoint living in a spawned process."""

    def __init__(self, transport: str, *, timeout_s: float = 120.0,
                 preallocate: dict[str, tuple[tuple[int, ...], str]] | None = None):
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(child, transport, preallocate), daemon=True)
        self.process.start()
        child.close()

    def _call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        if not self._conn.poll(self.timeout_s):
            raise TransportTimeoutError(f"engine process call {method}", self.timeout_s)
        kind, value = self._conn.recv()
        if kind == "error":
            raise value
        return value

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def live(self, tensors: bool = True):
        return self._call("live", tensors)

    def live_version(self) -> int | None:
        return self._call("live_version")

    def kv_scales(self):
        return self._call("kv_scales")

    def bench_reference(self, name: str, **kwargs: Any) -> Any:
        return self._call("bench_reference", name, kwargs)

    def rss_baseline(self) -> int:
        """Takes the receiver's RSS baseline (call before the transport is initialised)."""
        return self._call("rss_baseline")

    def rss_start(self) -> None:
        self._call("rss_start")

    def rss_stop(self) -> int:
        """Peak extra resident bytes over the baseline, across every start/stop so far."""
        return self._call("rss_stop")

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self._call("stop")
            except Exception:
                pass
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
