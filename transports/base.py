"""The weight-synchronizer interface, the sender/receiver protocols, the wire format and errors.

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

The training loop drives a `WeightSynchronizer`:

    init_communicator()            once, after engine workers exist
    mark_stale()                   after every optimizer step
    is_stale                       true between mark_stale() and the next successful sync
    sync_weights(kv_scales=None)   transfer the latest weights (only the collective forwards kv_scales)
    shutdown()                     release communication resources
    prepare_refit_info()           {hf_name: (shape, dtype)} the producer packs and the consumer unpacks

Errors (all derive from `TransportError`):

    TransportError                  anything a transport raises on purpose
    ├── TransportTimeoutError       a peer never joined, or stalled past the configured limit
    │                               (also a `TimeoutError`)
    ├── TransportUnavailableError   the transport cannot run here (package or device missing); says why
    ├── TransportConfigError        a request that cannot be honoured (also a `ValueError`),
    │                               e.g. a collective transport asked for a LoRA adapter
    └── RefitMismatchError          a received tensor disagrees with the refit info; `.tensor`
        │                           names it, `.reason` says how (shape, dtype, unexpected)
        ├── MissingTensorError      a tensor of the refit info never arrived
        ├── TruncatedBucketError    a bucket holds fewer bytes than its header promises
        └── ChecksumError           a tensor's bytes do not match the checksum the sender computed
"""

from __future__ import annotations

import abc
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    import torch

    from transports.refit.plan import RefitPlan
    from transports.staging import StagingArea

# ---------------------------------------------------------------------------------------------
# errors


class TransportError(Exception):
    """Anything a transport raises on purpose."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A peer never joined, or stalled mid-transfer, past the configured limit."""

    def __init__(self, what: str, timeout_s: float):
        self.what = what
        self.timeout_s = timeout_s
        super().__init__(f"{what}: no progress within {timeout_s:g} s")

    def __reduce__(self):  # survives pickling across processes
        return (type(self), (self.what, self.timeout_s))


class TransportUnavailableError(TransportError):
    """The transport cannot run on this machine; the message says why."""


class TransportConfigError(TransportError, ValueError):
    """A request the factory or a transport cannot honour."""


class RefitMismatchError(TransportError):
    """A received tensor disagrees with the refit info. `.tensor` names it."""

    def __init__(self, tensor: str, reason: str):
        self.tensor = tensor
        self.reason = reason
        super().__init__(f"tensor {tensor!r}: {reason}")

    def __reduce__(self):  # survives pickling across processes
        return (type(self), (self.tensor, self.reason))


class MissingTensorError(RefitMismatchError):
    def __init__(self, tensor: str, reason: str = "never arrived"):
        super().__init__(tensor, reason)


class TruncatedBucketError(RefitMismatchError):
    pass


class ChecksumError(RefitMismatchError):
    pass


def describe_error(exc: BaseException) -> dict[str, Any]:
    """A JSON-able description of a transport error, for crossing a boundary that only carries
    text (a vLLM server's dev endpoints); `rebuild_error` turns it back into the same class."""
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, RefitMismatchError):
        out.update(tensor=exc.tensor, reason=exc.reason)
    elif isinstance(exc, TransportTimeoutError):
        out.update(what=exc.what, timeout_s=exc.timeout_s)
    return out


def rebuild_error(info: Mapping[str, Any]) -> TransportError:
    """The inverse of `describe_error`; an error that is not one of ours becomes a
    `TransportError` carrying its type and message."""
    kind = info.get("type")
    if kind in _REFIT_ERRORS and "tensor" in info:
        return _REFIT_ERRORS[kind](info["tensor"], info.get("reason", ""))
    if kind == "TransportTimeoutError" and "what" in info:
        return TransportTimeoutError(info["what"], float(info.get("timeout_s", 0.0)))
    if kind in _PLAIN_ERRORS:
        return _PLAIN_ERRORS[kind](info.get("message", ""))
    return TransportError(f"{kind}: {info.get('message', '')}")


_REFIT_ERRORS: dict[str, type[RefitMismatchError]] = {
    cls.__name__: cls for cls in (RefitMismatchError, MissingTensorError, TruncatedBucketError, ChecksumError)}
_PLAIN_ERRORS: dict[str, type[TransportError]] = {
    cls.__name__: cls for cls in (TransportError, TransportUnavailableError, TransportConfigError)}


# ---------------------------------------------------------------------------------------------
# wire format

#: Type of `prepare_refit_info()`: the engine-side name, shape and dtype of every tensor.
RefitInfo = dict[str, tuple[tuple[int, ...], "torch.dtype"]]


class TensorMeta(msgspec.Struct, frozen=True):
    """One tensor inside a bucket: where its bytes lie and what they must decode to."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # wire dtype, e.g. "bfloat16"
    offset: int  # byte offset inside the bucket payload
    nbytes: int
    checksum: int = 0  # crc32 of the bytes; 0 with checksums off


class BucketHeader(msgspec.Struct, frozen=True):
    """Describes one bucket of one version. `count` is the number of buckets in the version."""

    version: int
    index: int
    count: int
    nbytes: int
    tensors: tuple[TensorMeta, ...]
    checksums: bool = True
    kv_scales: dict[str, float] | None = None
    attempt: int = 0  # which try at sending this version: buckets of an abandoned try are dropped


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(BucketHeader)


def encode_header(header: BucketHeader) -> bytes:
    return _header_encoder.encode(header)


def decode_header(data: bytes | memoryview) -> BucketHeader:
    try:
        return _header_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise TransportError(f"undecodable bucket header: {exc}") from exc


def checksum(data: memoryview | bytes) -> int:
    """crc32c where the `crc32c` package imports (hardware speed), zlib crc32 otherwise.

    Sender and receiver of one deployment run the same code, so they agree on the function.
    The value is never 0, so that 0 can mean "not computed".
    """
    return (_crc(data) & 0xFFFFFFFF) or 1


def _pick_crc() -> Callable[[Any], int]:
    try:
        import crc32c

        return crc32c.crc32c
    except ImportError:  # pragma: no cover - crc32c is a declared dependency
        return zlib.crc32


_crc = _pick_crc()


# ---------------------------------------------------------------------------------------------
# sender / receiver protocols


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


# ---------------------------------------------------------------------------------------------
# colocated device hand-over


@dataclass
class DeviceHandoverHooks:
    """What a colocated transport does with the shared device around a refit.

    The trainer and the engine share one device; a refit needs room on it for the engine's
    new weights, so the optimizer state moves out first and the engine is readied after.
    """

    offload_optimizer: Callable[[], None] = lambda: None
    prepare_for_generation: Callable[[], None] = lambda: None
    offload_after_refit: Callable[[], None] = lambda: None
    calls: list[str] = field(default_factory=list)

    def run(self, name: str) -> None:
        self.calls.append(name)
        getattr(self, name)()


def engine_memory_fraction(colocated: bool, max_colocated_worker_groups: int = 1) -> float:
    """Share of the device an engine claims: a dedicated engine takes all of it; a colocated
    one leaves room for the trainer's worker groups."""
    if not colocated:
        return 1.0
    return min(0.2, 1.0 / max(1, max_colocated_worker_groups))


# ---------------------------------------------------------------------------------------------
# the synchronizer


StateDictFn = Callable[[], Mapping[str, "torch.Tensor"]]


class WeightSynchronizer(abc.ABC):
    """Moves the trainer's latest weights into every engine; the training loop drives it."""

    transport_name: str = "abstract"
    forwards_kv_scales: bool = False

    def __init__(self, plan: RefitPlan, state_dict: StateDictFn):
        self.plan = plan
        self._state_dict = state_dict
        self._stale = False
        self._version = 0
        self._lock = threading.Lock()

    # -- contract ---------------------------------------------------------------------------

    @abc.abstractmethod
    def init_communicator(self) -> None:
        """Called once after engine workers exist."""

    def mark_stale(self) -> None:
        with self._lock:
            self._stale = True
            self._version += 1

    @property
    def is_stale(self) -> bool:
        return self._stale

    @property
    def version(self) -> int:
        return self._version

    def sync_weights(self, kv_scales: Mapping[str, float] | None = None) -> int:
        """Transfers the latest weights; returns the version sent. Stays stale on failure."""
        if kv_scales is not None and not self.forwards_kv_scales:
            # Only the collective path carries kv_scales (FP8 KV cache calibration); the others
            # would silently drop them, which is worse than refusing.
            raise TransportConfigError(f"the {self.transport_name} transport does not forward kv_scales")
        version = self._version
        self._transfer(version, dict(kv_scales) if kv_scales is not None else None)
        with self._lock:
            if self._version == version:
                self._stale = False
        return version

    @abc.abstractmethod
    def _transfer(self, version: int, kv_scales: dict[str, float] | None) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    def prepare_refit_info(self) -> RefitInfo:
        return self.plan.refit_info()

    # -- helpers ----------------------------------------------------------------------------

    def _buckets(self, version: int, kv_scales: dict[str, float] | None = None) -> Iterable[tuple[BucketHeader, memoryview]]:
        return self.plan.pack(self._state_dict(), version=version, kv_scales=kv_scales)
