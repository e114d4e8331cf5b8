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
    ) -> Iterator[tuple[BucketHeader, memoryview | torch.Tensor | BucketPayload]]:
        """Yields (header, payload) per bucket: a memoryview of a host arena, the slice of a CUDA
        arena (a uint8 tensor), or with `arenas=DirectArenas(...)` a `BucketPayload` (tensors
        that need no copy are the trainer's own). A payload stays valid until bucket k+1+`hold` is
        requested; with two arenas, bucket k+1 is packed on a thread while bucket k is sent.
        `hold=1` is for a sender that returns from `send(k)` while the far side still reads
        bucket k (it waits for bucket k-1 instead): the arena of bucket k is then refilled only
        once bucket k+2 is asked for. `hold` must stay below the number of arenas.

        Sources that are DTensors (FSDP2) are gathered with `full_tensor()`, a collective every
        rank must run in the same order: then packing stays on the calling thread."""
        direct = arenas.min_bytes if isinstance(arenas, DirectArenas) else None
        if direct is not None and not arenas:  # a sender's own, filled on first use and kept across versions
            arenas.extend(torch.empty(self.arena_bytes, dtype=torch.uint8, device=arenas.device) for _ in range(2))
        arenas = list(arenas) if arenas is not None else [torch.empty(self.arena_bytes, dtype=torch.uint8) for _ in range(2)]
        if not 0 <= hold < len(arenas):
            raise TransportError(f"hold={hold} needs more than {len(arenas)} arenas")
        # A mapping that gathers on read (transports.refit.gather.GatheredStateDict) is never
        # indexed up front: each read there is a collective, taken in plan order on this thread.
        sharded = getattr(state_dict, "gathers_on_read", False) or any(
            _is_dtensor(state_dict[e.source]) for e in self.spec.entries)
        if prefetch is None:
            prefetch = not sharded and self.bucket_count > 1
        fill = lambda k: self._fill(k, state_dict, arenas[k % len(arenas)], version, kv_scales, checksums,  # noqa: E731
                                    attempt, direct)
        if not prefetch:
            return (fill(k) for k in range(self.bucket_count))
        # The packing thread starts now, not at the first next(): a caller can overlap its own
        # set-up (the engines' start_weight_update round trips) with packing the first buckets.
        return _Prefetched(fill, self.bucket_count, depth=len(arenas), hold=hold)

    def _fill(self, k: int, state_dict, arena: torch.Tensor, version: int, kv_scales, checksums: bool,
              attempt: int = 0, direct: int | None = None):
        """Packs bucket k into `arena` (torch copies, so a CUDA arena is filled on its device).
        `direct` (a byte count): a tensor at least that large whose views leave it contiguous,
        in the wire dtype and on the arena's device is not copied at all; the payload (`BucketPayload`) points at the trainer's own
        bytes for it. Checksums (crc32c) are computed over host bytes only: a device bucket
        (CUDA IPC, NCCL) never crosses a wire of ours, so its header says `checksums=False`."""
        metas = []
        on_host = arena.device.type == "cpu"
        checksums = checksums and on_host
        view = memoryview(arena.numpy()) if on_host else None
        sent_directly: dict[str, torch.Tensor] = {}
        for entry in self.by_bucket[k]:
            source = state_dict.get(entry.source)
            if source is None:
                raise TransportError(f"trainer tensor {entry.source!r} (for {entry.name!r}) is missing")
            if _is_dtensor(source):
                source = source.full_tensor()
            src = apply_views(source.detach(), entry.views)
            wire = parse_dtype(entry.wire_dtype)
            crc = 0
            if (direct is not None and entry.nbytes and entry.nbytes >= direct and src.dtype == wire and src.device == arena.device
                    and src.is_contiguous() and src.numel() * wire.itemsize == entry.nbytes):
                flat = src.reshape(-1).view(torch.uint8)
                sent_directly[entry.name] = flat
                if checksums:
                    crc = checksum(memoryview(flat.numpy()))
            else:
                dst = arena[entry.offset:entry.offset + entry.nbytes].view(wire).view(entry.shape)
                dst.copy_(src)
                if checksums:
                    crc = checksum(view[entry.offset:entry.offset + entry.nbytes])
            metas.append(TensorMeta(entry.name, entry.shape, entry.wire_dtype, entry.offset, entry.nbytes, crc))
        nbytes = self.bucket_nbytes[k]
        header = BucketHeader(version, k, self.bucket_count, nbytes, tuple(metas), checksums,
                              kv_scales if k == 0 else None, attempt)
        if not on_host:
            # The copies above were queued on this thread's stream: the bucket is complete, for
            # another process (CUDA IPC) or another stream (NCCL), only once they ran.
            torch.cuda.current_stream(arena.device).synchronize()
        if direct is not None:
            return header, BucketPayload(arena, sent_directly, header.tensors, nbytes)
        return header, (view[:nbytes] if on_host else arena[:nbytes])


class DirectArenas(list):
    """The two arenas of a sender that can send one bucket from several buffers (vectored
    socket writes, one broadcast per tensor): `pack(..., arenas=DirectArenas())` then yields a
    `BucketPayload` per bucket, in which every tensor that needs no copy (contiguous after its
    views, already in the wire dtype, on the arenas' device) is the trainer's own memory and
    only the rest is packed into the arena. Empty: `pack` allocates both arenas (of the plan's
    size, on `device`) on first use; the sender keeps them across versions. An arena page that
    no tensor is packed into is never touched, so it costs no resident memory."""

    def __init__(self, arenas=(), device: str | torch.device = "cpu", min_bytes: int = 0):
        super().__init__(arenas)
        self.device = torch.device(device)
        self.min_bytes = min_bytes  # smaller tensors are packed all the same


class BucketPayload:
    """One bucket's payload as the trainer's own tensors plus an arena: `segments()` gives the
    buffers in payload order, `len()` the payload length. Behaves as a read-only byte sequence
    for code that slices or copies a payload (`payload[:n]`, `bytes(payload)`): those
    assemble the bytes (slow; fault injection in tests, never a sender's hot path)."""

    def __init__(self, arena: torch.Tensor, direct: Mapping[str, torch.Tensor], tensors: Sequence[TensorMeta],
                 nbytes: int):
        self.arena = arena
        self.direct = dict(direct)  # engine name -> flat uint8 view of the trainer's tensor
        self.tensors = tuple(sorted(tensors, key=lambda m: m.offset))
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def source(self, meta: TensorMeta) -> torch.Tensor:
        """The flat uint8 bytes of one tensor: the trainer's own, or its span of the arena."""
        flat = self.direct.get(meta.name)
        if flat is not None and flat.numel() == meta.nbytes:
            return flat
        return self.arena[meta.offset:meta.offset + meta.nbytes]

    def segments(self) -> list[torch.Tensor]:
        """Flat uint8 tensors that, written one after another, are the payload: arena spans
        (packed tensors and the padding between them) merged where they touch."""
        out: list[torch.Tensor] = []
        pos, run = 0, 0  # run: start of the arena span not yet emitted
        for meta in self.tensors:
            if meta.name not in self.direct or meta.offset < pos or meta.offset >= self.nbytes:
                continue  # packed into the arena (or overlapping: left to the arena's bytes)
            if meta.offset > run:
                out.append(self.arena[run:meta.offset])
            end = min(meta.offset + meta.nbytes, self.nbytes)  # a truncated payload ends inside it
            out.append(self.direct[meta.name][:end - meta.offset])
            pos = run = end
        if self.nbytes > run:
            out.append(self.arena[run:self.nbytes])
        return out

    def tobytes(self) -> bytes:
        return b"".join(t.cpu().numpy().tobytes() for t in self.segments())

    def __bytes__(self) -> bytes:
        return self.tobytes()

    def __iter__(self):
        return iter(self.tobytes())

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.nbytes)
            if start == 0 and step == 1:  # a truncated payload: the same buffers, fewer bytes
                return BucketPayload(self.arena, self.direct, self.tensors, max(0, stop))
            return memoryview(self.tobytes())[index]
        return self.tobytes()[index]


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
