"""Engine side: validate arriving buckets and replay them into a staging area.

A `StagingArea` holds one version being received. Each bucket is checked completely (every
tensor known to the refit plan, shape and wire dtype as planned, bytes present, checksum
right) before any of it is replayed; a version is only handed out by `finish()` once every
planned tensor arrived. Nothing here touches the weights an engine serves, so a failed
version leaves the old one live.

`begin(version, attempt=None)` takes whichever attempt of `version` starts arriving first (its bucket 0; a receiver
fed by a trainer whose attempt count the engine does not know: a coordinated activation); a
bucket of another attempt is then dropped as left over. `begin(..., on_bucket=f)` hands each
bucket's replayed tensors to `f` as soon as the bucket is accepted (the worker extension loads
them into its shadow model there, while the receiver reads the next bucket), and
`retain=False` keeps nothing once `f` took it (`finish()` then only checks completeness).

`ReplayPipeline` runs the replay of bucket k on a thread while the receiver reads bucket k+1
into its other arena. A receiver that reads a stream (http) can skip the copy out of its arena:
`landing(header)` gives, per tensor that needs no conversion, the staging tensor to read its
bytes into, and `accept(header, payload, landed)` checks those bytes (checksum included) before
they count as arrived.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from transports.errors import (
    ChecksumError,
    MissingTensorError,
    RefitMismatchError,
    TransportError,
    TransportTimeoutError,
    TruncatedBucketError,
)
from transports.refit.views import Cast, Fp8BlockQuant, fp8_block_quantize, parse_dtype
from transports.wire import BucketHeader, checksum

if TYPE_CHECKING:
    from transports.refit.plan import PlanEntry, RefitPlan


#: Takes one accepted bucket's tensors (engine names -> replayed tensors, owned by the callee).
BucketSink = Callable[[dict[str, torch.Tensor]], None]


class StagingArea:
    """Receives one version at a time. With `destination` given, replays into those
    (preallocated, engine-owned) tensors instead of allocating new ones."""

    def __init__(self, plan: RefitPlan, destination: dict[str, torch.Tensor] | None = None):
        self.plan = plan
        self.destination = destination
        self.version: int | None = None
        self.attempt: int | None = 0
        self._staged: dict[str, torch.Tensor] = {}
        self._arrived: set[str] = set()
        self._buckets: set[int] = set()
        self._lock = threading.Lock()
        self.kv_scales: dict[str, float] | None = None
        self.on_bucket: BucketSink | None = None
        self.retain = True

    def begin(self, version: int, attempt: int | None = 0, *, on_bucket: BucketSink | None = None,
              retain: bool = True) -> None:
        """Starts receiving `version`. `attempt=None`: the attempt of the first bucket of this
        version that arrives (see the module docstring)."""
        with self._lock:
            self.version = version
            self.attempt = attempt
            self._staged = {}
            self._arrived = set()
            self._buckets = set()
            self.kv_scales = None
            self.on_bucket = on_bucket
            self.retain = retain or on_bucket is None

    # -- validation -------------------------------------------------------------------------

    def is_current(self, header: BucketHeader) -> bool:
        """False for a bucket left over from an abandoned attempt (or another version):
        receivers drop those. With the attempt left open, the first bucket 0 of this version
        fixes it: every attempt starts at bucket 0, so a later bucket seen first is a leftover of
        an abandoned attempt (announced before the trainer gave up), never the start of one."""
        with self._lock:
            if header.version != self.version:
                return False
            if self.attempt is None:
                if header.index != 0:
                    return False
                self.attempt = header.attempt
            return header.attempt == self.attempt

    def is_newer(self, header: BucketHeader) -> bool:
        """True for a bucket of a later version, or of a later attempt of this version once the
        attempt is fixed (attempts only grow): the trainer has moved past what this area
        receives, so that version can no longer complete. A receiver keeps such a bucket for its
        next `receive` instead of dropping it as left over (and answering it as delivered)."""
        with self._lock:
            if self.version is None or header.version > self.version:
                return True
            if header.version < self.version:
                return False
            if self.attempt is None:  # not fixed yet: any attempt of this version is current
                return False
            return header.attempt > self.attempt

    def landing(self, header: BucketHeader) -> dict[str, torch.Tensor]:
        """Where a receiver that reads a bucket off a stream may put tensors' bytes directly
        (as flat uint8 views), skipping the copy out of its arena: the engine-owned destination
        tensor, or a fresh tensor, for each tensor that needs no allocating operation on
        arrival and whose metadata agrees with the plan. Nothing for a bucket of another
        version or attempt. The bytes still go through `accept(..., landed=...)`, which checks
        them (checksums included) before the tensor counts as arrived; a tensor that fails
        leaves its version unstaged, so only staging memory, never live weights, saw them."""
        if not self.is_current(header) or header.count != self.plan.bucket_count:
            return {}
        out: dict[str, torch.Tensor] = {}
        for meta in header.tensors:
            entry = self.plan.entries.get(meta.name)
            if (entry is None or entry.on_arrival or tuple(meta.shape) != tuple(entry.shape)
                    or meta.dtype != entry.wire_dtype or meta.nbytes != entry.nbytes
                    or entry.wire_dtype != entry.target_dtype):
                continue
            if self.destination is not None and entry.name in self.destination:
                dst = self.destination[entry.name]
                if dst.dtype != parse_dtype(entry.wire_dtype) or not dst.is_contiguous() or dst.device.type != "cpu":
                    continue
            else:
                dst = torch.empty(entry.shape, dtype=parse_dtype(entry.wire_dtype))
            flat = dst.view(-1).view(torch.uint8) if dst.numel() else torch.empty(0, dtype=torch.uint8)
            if flat.numel() == meta.nbytes:
                out[meta.name] = flat
        return out

    def validate(self, header: BucketHeader, payload: memoryview,
                 landed: dict[str, torch.Tensor] | None = None) -> None:
        """Raises naming the first tensor of the bucket that disagrees with the plan. `landed`:
        tensors whose bytes were read straight into these flat views (see `landing`)."""
        if header.version != self.version:
            raise TransportError(f"bucket {header.index} belongs to version {header.version}, "
                                 f"expected {self.version}")
        if header.count != self.plan.bucket_count:
            raise TransportError(f"sender announces {header.count} buckets, the plan has {self.plan.bucket_count}")
        for meta in header.tensors:
            entry = self.plan.entries.get(meta.name)
            if entry is None:
                raise RefitMismatchError(meta.name, "not in the refit info")
            if tuple(meta.shape) != tuple(entry.shape):
                raise RefitMismatchError(meta.name, f"shape {tuple(meta.shape)} != expected {tuple(entry.shape)}")
            if meta.dtype != entry.wire_dtype:
                raise RefitMismatchError(meta.name, f"dtype {meta.dtype} != expected {entry.wire_dtype}")
            if meta.nbytes != entry.nbytes:
                raise RefitMismatchError(meta.name, f"{meta.nbytes} bytes != expected {entry.nbytes}")
            if meta.offset < 0 or meta.offset + meta.nbytes > len(payload):
                raise TruncatedBucketError(
                    meta.name, f"bucket {header.index} holds {len(payload)} bytes, the tensor ends at "
                    f"{meta.offset + meta.nbytes}")
            if header.checksums:
                flat = landed.get(meta.name) if landed else None
                data = memoryview(flat.numpy()) if flat is not None else payload[meta.offset:meta.offset + meta.nbytes]
                got = checksum(data)
                if got != meta.checksum:
                    raise ChecksumError(meta.name, f"checksum {got:#010x} != sent {meta.checksum:#010x}")

    # -- replay -----------------------------------------------------------------------------

    def accept(self, header: BucketHeader, payload: memoryview,
               landed: dict[str, torch.Tensor] | None = None) -> None:
        """Validates the whole bucket, then replays every tensor of it into staging. A tensor in
        `landed` (bytes already read into the view `landing` gave) is staged without a copy."""
        self.validate(header, payload, landed)
        if header.kv_scales is not None:
            self.kv_scales = dict(header.kv_scales)
        # A device payload (a uint8 CUDA tensor: CUDA IPC, NCCL) is replayed on its device.
        raw = payload if isinstance(payload, torch.Tensor) else (
            torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8))
        bucket: dict[str, torch.Tensor] = {}
        for meta in header.tensors:
            entry = self.plan.entries[meta.name]
            flat = landed.get(meta.name) if landed else None
            if flat is not None:
                bucket[meta.name] = flat.view(parse_dtype(entry.wire_dtype)).view(entry.shape)
                continue
            wire = raw[meta.offset:meta.offset + meta.nbytes].view(parse_dtype(entry.wire_dtype)).view(entry.shape)
            bucket.update(self._replay(entry, wire))
        if self.on_bucket is not None:
            # Before the tensors count as arrived: a sink that fails fails the version.
            self.on_bucket(bucket)
        if self.retain:
            self._staged.update(bucket)
        with self._lock:
            self._arrived.update(m.name for m in header.tensors)
            self._buckets.add(header.index)

    def _replay(self, entry: PlanEntry, wire: torch.Tensor) -> dict[str, torch.Tensor]:
        """The plan's allocating operations; the wire bytes are always copied out, because the
        receiver reuses its arena for a later bucket."""
        for op in entry.on_arrival:
            if isinstance(op, Fp8BlockQuant):
                quant, scale_inv = fp8_block_quantize(wire.to(torch.float32), op.block)
                return {entry.name: quant, entry.name + op.scale_suffix: scale_inv}
        target = parse_dtype(entry.target_dtype)
        if self.destination is not None and entry.name in self.destination:
            dst = self.destination[entry.name]
            dst.copy_(wire)  # copy_ casts on the way
            return {entry.name: dst}
        if any(isinstance(op, Cast) for op in entry.on_arrival) or wire.dtype != target:
            return {entry.name: wire.to(target, copy=True)}
        return {entry.name: wire.clone()}

    def finish(self) -> dict[str, torch.Tensor]:
        """The complete staged version; raises `MissingTensorError` naming a missing tensor."""
        for entry in self.plan.spec.entries:
            if entry.name not in self._arrived:
                raise MissingTensorError(entry.name, f"never arrived in version {self.version} "
                                         f"(bucket {entry.bucket} of {self.plan.bucket_count})")
        staged, self._staged = self._staged, {}
        return staged


class ReplayPipeline:
    """Replays buckets on one worker thread, at most one bucket behind the receiver.

    Usage per bucket k: `slot = pipe.acquire(k)` (waits until the replay that last used that
    arena finished, raising its error), read bucket k into `arenas[slot]`, `pipe.submit(...)`.
    `drain()` waits for the last replay and raises the first error.
    """

    def __init__(self, staging: StagingArea, arenas: int = 2, timeout_s: float = 60.0):
        self.staging = staging
        self.arenas = arenas
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-replay")
        self._slots: list[Future | None] = [None] * arenas

    def acquire(self, index: int) -> int:
        slot = index % self.arenas
        self._wait(self._slots[slot])
        self._slots[slot] = None
        return slot

    def submit(self, slot: int, header: BucketHeader, payload: memoryview,
               after: Callable[[], None] | None = None, landed: dict[str, torch.Tensor] | None = None) -> None:
        def job() -> None:
            try:
                self.staging.accept(header, payload, landed)
            finally:
                if after is not None:
                    after()

        self._slots[slot] = self._pool.submit(job)

    def drain(self) -> None:
        for slot in range(self.arenas):
            self._wait(self._slots[slot])
            self._slots[slot] = None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _wait(self, future: Future | None) -> None:
        if future is None:
            return
        try:
            future.result(timeout=self.timeout_s)
        except TransportError:
            raise
        except TimeoutError as exc:
            raise TransportTimeoutError("replaying a bucket", self.timeout_s) from exc


def materialize(plan: RefitPlan, state_dict, **pack_kwargs) -> dict[str, torch.Tensor]:
    """Packs and stages in one process: the engine-side state dict `plan` produces. (Here, not
    on the plan: the plan packs, staging replays; the plan never imports staging.)"""
    staging = StagingArea(plan)
    staging.begin(0)
    for header, payload in plan.pack(state_dict, version=0, **pack_kwargs):
        staging.accept(header, payload)
    return staging.finish()
