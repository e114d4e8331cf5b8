"""The names every transport shares, in one place to import them from: the errors
(`transports.errors`), the wire format (`transports.wire`) and the sender / receiver / control
protocols (`transports.protocols`). A leaf: those three import nothing else of this package at
run time, and this module only re-exports them.

A transport moves one *version* of the trainer's weights into every inference engine. It has
two halves:

* a **sender** on the trainer side, fed buckets by the refit plan (`transports.refit.plan`):
  each bucket is one contiguous byte buffer holding several tensors in the wire dtype, plus a
  `BucketHeader` describing them;
* a **receiver** on the engine side (registered as a vLLM weight-transfer backend in
  `transports.vllm_backend`) that writes what arrives into a `StagingArea`. The staging area
  validates every tensor against the refit info, replays the plan's allocating operations
  (dtype cast, quantization) and keeps the result until the whole version has arrived. Making
  staged weights live is a separate step, so a version that fails half-way never touches the
  weights an engine serves.

The training loop drives a `WeightSynchronizer` (`transports.synchronizer`, with the colocated
`DeviceHandoverHooks` and `engine_memory_fraction`). Those names are still importable from here
(resolved on first use, so this module imports nothing that imports it back).
"""

from __future__ import annotations

from typing import Any

from transports.errors import (
    ChecksumError,
    MissingTensorError,
    RefitMismatchError,
    TransportConfigError,
    TransportError,
    TransportTimeoutError,
    TransportUnavailableError,
    TruncatedBucketError,
    describe_error,
    rebuild_error,
)
from transports.protocols import BucketReceiver, BucketSender, EngineWeightControl
from transports.wire import BucketHeader, RefitInfo, TensorMeta, checksum, decode_header, encode_header

__all__ = [
    "BucketHeader", "BucketReceiver", "BucketSender", "ChecksumError", "DeviceHandoverHooks", "EngineWeightControl",
    "MissingTensorError", "RefitInfo", "RefitMismatchError", "StateDictFn", "TensorMeta", "TransportConfigError",
    "TransportError", "TransportTimeoutError", "TransportUnavailableError", "TruncatedBucketError",
    "WeightSynchronizer", "checksum", "decode_header", "describe_error", "encode_header", "engine_memory_fraction",
    "rebuild_error",
]

#: Names that moved to `transports.synchronizer`, still importable from here.
_MOVED = {"WeightSynchronizer", "DeviceHandoverHooks", "StateDictFn", "engine_memory_fraction"}


def __getattr__(name: str) -> Any:
    """`from transports.base import WeightSynchronizer` keeps working; the compatibility
    re-export is resolved lazily so `transports.base` stays a leaf (no import circle)."""
    if name in _MOVED:
        import transports.synchronizer as synchronizer

        return getattr(synchronizer, name)
    raise AttributeError(f"module 'transports.base' has no attribute {name!r}")
