"""The refit plan: how the trainer's tensors become the engine's, bucket by bucket.

Built once per model from the trainer's tensor metadata and a name map
(`transports.refit.maps`). For every engine tensor the plan lists

* the **views** taken of a trainer tensor (select, slice, transpose, reshape): read in place on
  the sender, so no trainer-side copy is made beyond the bucket the bytes are packed into;
* the **wire dtype** (bf16 by default; a per-model list of tensors stays in fp32);
* the **allocating operations** replayed on arrival (dtype cast, FP8 block quantization),
  which run on the engine while the next bucket is still in transit.

Tensors are grouped into buckets of at most `bucket_bytes` (a tensor larger than that travels
alone), so the extra memory of a transfer stays at two buckets plus the largest tensor on either
side. The sender packs bucket k+1 into one arena while bucket k, in the other, is on the wire.
"""

from __future__ import annotations

import fnmatch
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from transports.errors import TransportError
from transports.refit.views import (  # re-exported: the plan's operations are importable from here too
    AllocOp,
    Cast,
    Fp8BlockQuant,
    Reshape,
    Select,
    Slice,
    Transpose,
    ViewOp,
    apply_view,
    apply_views,
    dtype_name,
    fp8_block_dequantize,
    fp8_block_quantize,
    parse_dtype,
)
from transports.wire import BucketHeader, RefitInfo, TensorMeta, checksum

if TYPE_CHECKING:
    from transports.refit.maps import NameMap

ALIGN = 64  # byte alignment of every tensor inside a bucket, so typed views are aligned
DEFAULT_BUCKET_BYTES = 64 << 20

# ---------------------------------------------------------------------------------------------
# the plan


class PlanEntry(msgspec.Struct, frozen=True):
    name: str  # engine (HF) name of the tensor on the wire
    source: str  # trainer name it is read from
    views: tuple[ViewOp, ...]
    shape: tuple[int, ...]  # after the views: the wire shape
    wire_dtype: str
    target_dtype: str
    on_arrival: tuple[AllocOp, ...]
    bucket: int
    offset: int
    nbytes: int

    def outputs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Engine tensors this entry produces once its allocating operations ran."""
        quant = next((op for op in self.on_arrival if isinstance(op, Fp8BlockQuant)), None)
        if quant is None:
            return {self.name: (self.shape, self.target_dtype)}
        rows, cols = self.shape
        br, bc = quant.block
        return {
            self.name: (self.shape, "float8_e4m3fn"),
            self.name + quant.scale_suffix: ((-(-rows // br), -(-cols // bc)), "float32"),
        }


class PlanSpec(msgspec.Struct, frozen=True):
    """The serialisable part of a plan: what a receiver needs to validate and replay."""

    entries: tuple[PlanEntry, ...]
    bucket_bytes: int
    bucket_count: int
    arena_bytes: int  # max(bucket payload sizes): what one arena must hold


class RefitPlan:
    """See the module docstring. Build with `RefitPlan.build(...)`."""

    def __init__(self, spec: PlanSpec):
        self.spec = spec
        self.entries: dict[str, PlanEntry] = {e.name: e for e in spec.entries}
        self.by_bucket: list[list[PlanEntry]] = [[] for _ in range(spec.bucket_count)]
        for entry in spec.entries:
            self.by_bucket[entry.bucket].append(entry)
        self.bucket_nbytes = [max((e.offset + e.nbytes for e in b), default=0) for b in self.by_bucket]

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        trainer_meta: Mapping[str, tuple[Sequence[int], torch.dtype]],
        name_map: NameMap | None = None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        wire_dtype: torch.dtype | None = torch.bfloat16,
        keep_fp32: Sequence[str] | None = None,
        target_dtype: torch.dtype | None = None,
        fp8_block: Sequence[str] = (),
        fp8_block_size: tuple[int, int] = (128, 128),
    ) -> RefitPlan:
        """`trainer_meta`: {trainer name: (full shape, dtype)}. `wire_dtype=None` sends each
        tensor in its own dtype. `keep_fp32`: fnmatch patterns of engine names sent in fp32
        (default: the name map's list). `target_dtype`: the engine's dtype (default: the
        trainer's). `fp8_block`: patterns of engine names block-quantized on arrival."""
        from transports.refit.maps import IdentityMap

        name_map = name_map or IdentityMap()
        keep = list(name_map.keep_fp32 if keep_fp32 is None else keep_fp32)
        mapped = name_map.refit({k: (tuple(s), d) for k, (s, d) in trainer_meta.items()})
        raw: list[tuple[str, str, tuple[ViewOp, ...], tuple[int, ...], torch.dtype, torch.dtype, tuple[AllocOp, ...]]] = []
        for name, source, views in mapped:
            shape, src_dtype = trainer_meta[source]
            # Views are checked on a meta tensor: a view that would need a copy fails here, once.
            wire_shape = tuple(apply_views(torch.empty(tuple(shape), dtype=src_dtype, device="meta"), views).shape)
            on_wire = cls._wire_dtype(name, src_dtype, wire_dtype, keep)
            target = target_dtype if (target_dtype is not None and src_dtype.is_floating_point) else src_dtype
            ops: list[AllocOp] = []
            if any(fnmatch.fnmatchcase(name, p) for p in fp8_block) and len(wire_shape) == 2:
                ops.append(Fp8BlockQuant(block=fp8_block_size))
            elif on_wire != target:
                ops.append(Cast(dtype_name(target)))
            raw.append((name, source, tuple(views), wire_shape, on_wire, target, tuple(ops)))
        return cls(cls._layout(raw, bucket_bytes))

    @staticmethod
    def _wire_dtype(name: str, src: torch.dtype, wire: torch.dtype | None, keep_fp32: Sequence[str]) -> torch.dtype:
        if wire is None or not src.is_floating_point:
            return src
        if any(fnmatch.fnmatchcase(name, p) for p in keep_fp32):
            return torch.float32
        return wire

    @staticmethod
    def _layout(raw, bucket_bytes: int) -> PlanSpec:
        entries: list[PlanEntry] = []
        bucket, offset = 0, 0
        for name, source, views, shape, wire, target, ops in raw:
            nbytes = _numel(shape) * wire.itemsize
            if offset and offset + nbytes > bucket_bytes:
                bucket, offset = bucket + 1, 0
            entries.append(PlanEntry(name, source, views, shape, dtype_name(wire), dtype_name(target),
                                     ops, bucket, offset, nbytes))
            offset = _align(offset + nbytes)
        count = bucket + 1 if entries else 0
        arena = max((e.offset + e.nbytes for e in entries), default=0)
        return PlanSpec(tuple(entries), bucket_bytes, count, _align(arena))

    # -- queries ----------------------------------------------------------------------------

    def refit_info(self) -> RefitInfo:
        info: RefitInfo = {}
        for entry in self.spec.entries:
            for name, (shape, dtype) in entry.outputs().items():
                info[name] = (shape, parse_dtype(dtype))
        return info

    @property
    def bucket_count(self) -> int:
        return self.spec.bucket_count

    @property
    def arena_bytes(self) -> int:
        return self.spec.arena_bytes

    @property
    def wire_bytes(self) -> int:
        return sum(e.nbytes for e in self.spec.entries)

    def encode(self) -> bytes:
        return msgspec.json.encode(self.spec)

    @classmethod
    def decode(cls, data: bytes | str) -> RefitPlan:
        return cls(msgspec.json.decode(data, type=PlanSpec))

    # -- sending ----------------------------------------------------------------------------

    def pack(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        version: int,
        kv_scales: dict[str, float] | None = None,
        checksums: bool = True,
        arenas: Sequence[torch.Tensor] | None = None,
        prefetch: bool | None = None,
        attempt: int = 0,
        hold: int = 0,
    ) -> Iterator[tuple[BucketHeader, memoryview]]:
        """Yields (header, payload) per bucket. A payload stays valid until bucket k+1+`hold` is
        requested; with two arenas, bucket k+1 is packed on a thread while bucket k is sent.
        `hold=1` is for a sender that returns from `send(k)` while the far side still reads
        bucket k (it waits for bucket k-1 instead): the arena of bucket k is then refilled only
        once bucket k+2 is asked for. `hold` must stay below the number of arenas.

        Sources that are DTensors (FSDP2) are gathered with `full_tensor()`, a collective every
        rank must run in the same order: then packing stays on the calling thread."""
        arenas = list(arenas) if arenas is not None else [torch.empty(self.arena_bytes, dtype=torch.uint8) for _ in range(2)]
        if not 0 <= hold < len(arenas):
            raise TransportError(f"hold={hold} needs more than {len(arenas)} arenas")
        sharded = any(_is_dtensor(state_dict[e.source]) for e in self.spec.entries)
        if prefetch is None:
            prefetch = not sharded and self.bucket_count > 1
        fill = lambda k: self._fill(k, state_dict, arenas[k % len(arenas)], version, kv_scales, checksums, attempt)  # noqa: E731
        if not prefetch:
            return (fill(k) for k in range(self.bucket_count))
        # The packing thread starts now, not at the first next(): a caller can overlap its own
        # set-up (the engines' start_weight_update round trips) with packing the first buckets.
        return _Prefetched(fill, self.bucket_count, depth=len(arenas), hold=hold)

    def _fill(self, k: int, state_dict, arena: torch.Tensor, version: int, kv_scales, checksums: bool,
              attempt: int = 0):
        metas = []
        view = memoryview(arena.numpy())
        for entry in self.by_bucket[k]:
            source = state_dict.get(entry.source)
            if source is None:
                raise TransportError(f"trainer tensor {entry.source!r} (for {entry.name!r}) is missing")
            if _is_dtensor(source):
                source = source.full_tensor()
            src = apply_views(source.detach(), entry.views)
            dst = arena[entry.offset:entry.offset + entry.nbytes].view(parse_dtype(entry.wire_dtype)).view(entry.shape)
            dst.copy_(src)
            crc = checksum(view[entry.offset:entry.offset + entry.nbytes]) if checksums else 0
            metas.append(TensorMeta(entry.name, entry.shape, entry.wire_dtype, entry.offset, entry.nbytes, crc))
        nbytes = self.bucket_nbytes[k]
        header = BucketHeader(version, k, self.bucket_count, nbytes, tuple(metas), checksums,
                              kv_scales if k == 0 else None, attempt)
        return header, view[:nbytes]


class _Prefetched:
    """Runs `fill(k)` ahead on a thread, into `depth` arenas used in turn: the arena of bucket k
    is refilled (with bucket k + depth) only once the consumer asked for bucket k+1+hold.
    An iterator with `close()` (stops the thread; `contextlib.closing` works)."""

    def __init__(self, fill, count: int, depth: int, hold: int = 0):
        self._fill, self._count, self._hold = fill, count, hold
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._consumed = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._next = 0
        self._thread = threading.Thread(target=self._work, name="refit-pack", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        try:
            for k in range(self._count):
                while not self._consumed.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                self._ready.put(("ok", self._fill(k)))
        except BaseException as exc:  # handed to the consumer, raised there
            self._ready.put(("error", exc))

    def __iter__(self) -> _Prefetched:
        return self

    def __next__(self) -> tuple[BucketHeader, memoryview]:
        k = self._next
        if k > self._hold:  # the consumer asks for bucket k: bucket k-1-hold's arena is free
            self._consumed.release()
        if k >= self._count or self._stop.is_set():
            self.close()
            raise StopIteration
        kind, item = self._ready.get()
        if kind == "error":
            self.close()
            raise item
        self._next = k + 1
        return item

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._consumed.release()
            self._thread.join(timeout=5)

    def __del__(self) -> None:
        self._stop.set()


def _is_dtensor(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
