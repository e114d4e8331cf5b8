"""The engine side of every transport, without vLLM: init info -> receiver + staging area.

`ReceivingEndpoint` speaks vLLM's four weight-sync calls. `transports.vllm_backend` wraps it
as a vLLM `WeightTransferEngine`; tests and `inflight bench transports` run it in a plain
process. `update_weights` receives a whole version into staging (validated); a failure leaves
nothing staged. `finish_weight_update` hands the staged version to `apply` (unless the init
info asked to keep it staged for a later, coordinated activation: `apply_staged()`).

The `apply_on_finish` mode is not atomic across engines: each engine applies at its own
`finish_weight_update`. `receive_version` is the one staging path: the endpoint (vLLM's `update_weights`, the simple
`apply_on_finish` mode) and the swap worker extension's staging thread (a coordinated
activation, `transports.swap`) both receive a version through it, from a receiver built by
`make_receiver`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from transports.errors import TransportConfigError, TransportError
from transports.protocols import BucketReceiver
from transports.refit.plan import RefitPlan
from transports.staging import BucketSink, StagingArea

log = structlog.get_logger("transports.endpoint")

ApplyFn = Callable[[dict[str, torch.Tensor]], None]


def make_receiver(transport: str, plan: RefitPlan, options: dict[str, Any], worker_rank: int = 0) -> BucketReceiver:
    timeout_s = float(options.get("timeout_s", 60.0))
    if transport == "filesystem":
        from transports.filesystem import FilesystemReceiver

        return FilesystemReceiver(options["root"], arena_bytes=plan.arena_bytes, timeout_s=timeout_s)
    if transport == "collective":
        from transports.collective import CollectiveReceiver

        return CollectiveReceiver(host=options["host"], port=int(options["port"]),
                                  world_size=int(options["world_size"]),
                                  rank=int(options["rank_offset"]) + worker_rank,
                                  arena_bytes=plan.arena_bytes, timeout_s=timeout_s)
    if transport == "ipc":
        from transports.ipc import IpcReceiver

        return IpcReceiver(endpoint=options["endpoint"], segments=options.get("segments"), timeout_s=timeout_s,
                           device=options.get("device", "cpu"), index=options.get("index"))
    if transport == "http":
        from transports.http import HttpReceiver

        return HttpReceiver(host=options["host"], port=int(options["port"]), arena_bytes=plan.arena_bytes,
                            timeout_s=timeout_s, token=options.get("token"))
    raise TransportConfigError(f"unknown transport {transport!r}")


def receive_version(receiver: BucketReceiver, staging: StagingArea, version: int, attempt: int | None = 0, *,
                    committed: bool = False, on_bucket: BucketSink | None = None,
                    retain: bool = True) -> dict[str, torch.Tensor]:
    """Receives `version` through `receiver` into `staging` (validated bucket by bucket) and
    returns the complete staged version (empty with `retain=False`: `on_bucket` took every
    bucket). `attempt=None`: whichever attempt of the version arrives first. `committed`
    (filesystem only): report it only once the trainer's commit names the buckets read.
    Raises on any failure; nothing partial is ever returned."""
    staging.begin(version, attempt, on_bucket=on_bucket, retain=retain)
    if committed:
        receiver.receive(version, staging, committed=True)  # type: ignore[call-arg]
    else:
        receiver.receive(version, staging)
    return staging.finish()


class ReceivingEndpoint:
    def __init__(self, transport: str, apply: ApplyFn, *, worker_rank: int = 0,
                 destination: dict[str, torch.Tensor] | None = None):
        self.transport = transport
        self.apply = apply
        self.worker_rank = worker_rank
        self.destination = destination
        self.receiver: BucketReceiver | None = None
        self.staging: StagingArea | None = None
        self.staged: dict[str, torch.Tensor] | None = None
        self.staged_version: int | None = None
        self.live_version: int | None = None
        self.apply_on_finish = True
        self.last_error: Exception | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        plan = RefitPlan.decode(init_info["plan"])
        self.apply_on_finish = bool(init_info.get("apply_on_finish", True))
        self.staging = StagingArea(plan, destination=self.destination)
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = make_receiver(self.transport, plan, dict(init_info.get("options", {})), self.worker_rank)

    def start_weight_update(self) -> None:
        if self.receiver is None or self.staging is None:
            raise TransportError("init_weight_transfer_engine was not called")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.receiver is None or self.staging is None:
            raise TransportError("init_weight_transfer_engine was not called")
        version = int(update_info["version"])
        self.last_error = None
        if update_info.get("discard"):
            self.staged, self.staged_version = None, None
            return
        self.staged, self.staged_version = None, None
        try:
            self.staged = receive_version(self.receiver, self.staging, version, int(update_info.get("attempt", 0)))
        except Exception as exc:
            # Kept for callers that only see text (a server's HTTP endpoints): see
            # `InflightWorkerExtension.inflight_last_error`.
            self.last_error = exc
            raise
        self.staged_version = version
        log.info("endpoint.staged", transport=self.transport, version=version, tensors=len(self.staged))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self.apply_on_finish:
            self.apply_staged()

    def apply_staged(self) -> int | None:
        """Makes the staged version live (the activation step); returns its number."""
        if self.staged is None:
            return None
        staged, version = self.staged, self.staged_version
        self.staged, self.staged_version = None, None
        self.apply(staged)
        self.live_version = version
        return version

    @property
    def kv_scales(self) -> dict[str, float] | None:
        return self.staging.kv_scales if self.staging is not None else None

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
