"""The sender / receiver protocols and vLLM's weight-sync control plane, as typing protocols.

Imports nothing at run time from this package (the staging area only for type checking).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from transports.wire import BucketHeader

if TYPE_CHECKING:
    from transports.staging import StagingArea


@runtime_checkable
class BucketSender(Protocol):
    """Trainer side of a transport: moves the buckets of one version to every engine."""

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        """What engine `engine_index`'s receiver needs to reach this sender (JSON-able)."""

    def connect(self) -> None:
        """Forms the connection; runs while every engine handles its init info."""

    def begin(self, version: int, bucket_count: int) -> None: ...

    def send(self, header: BucketHeader, payload: memoryview) -> None:
        """Moves one bucket. Returns once `payload` may be overwritten; a sender with a class
        attribute `in_flight = n` returns earlier, while it may still read the last n payloads
        (the synchronizer then packs with `hold=n`, so they stay intact), and `commit` waits
        for them."""

    def commit(self, version: int) -> None:
        """All buckets of `version` have been sent; publish them (where the transport needs to)."""

    def close(self) -> None: ...


@runtime_checkable
class BucketReceiver(Protocol):
    """Engine side of a transport: receives one version into a staging area.

    Every wait on the sender is bounded by the receiver's timeout and raises
    `TransportTimeoutError`; every disagreement with the plan raises a `RefitMismatchError`
    naming the tensor, before anything reaches the engine's live weights.
    """

    def receive(self, version: int, staging: StagingArea) -> None: ...

    def close(self) -> None: ...


class EngineWeightControl(Protocol):
    """vLLM's weight-sync control plane for one engine (`VLLMWeightSyncClient`'s shape).

    `orchestrator` supplies these (in-process `vllm.LLM`, or its HTTP dev endpoints);
    `transports.vllm_backend` has adapters for both.
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...
