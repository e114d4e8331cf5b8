"""Gathering a sharded (FSDP2, DTensor) state dict to the sending rank, one tensor at a time,
in the order a refit plan packs its buckets.

`RefitPlan.pack` reads its source tensors bucket by bucket. A DTensor's `full_tensor()` would
give *every* rank the whole tensor, and over gloo its all-gather briefly holds two copies of it
(a flat receive buffer, then the output). Only the rank that writes or sends a version needs the
whole tensor, so:

* the sending rank (rank 0 of the shards' mesh) packs `GatheredStateDict(state, plan)`: a
  mapping whose DTensor values are gathered when read, each rank's shard received straight into
  its rows of one full tensor (no second copy). The mapping holds only the tensor last read, and
  drops it before gathering the next, so the sender's extra memory while publishing stays
  within its two bucket arenas plus the largest tensor (a bucket's tensors sum to at most its
  arena; the one being gathered is the only one not yet packed). `peak_bytes` counts the
  gathered bytes alive at once (a finalizer on each storage sees when torch frees it).
* every other rank calls `send_shards(state, plan)`: it sends its shard of each DTensor in the
  same order and allocates nothing.
* `connect()`, once before the first gather (a collective), opens the point-to-point path, so
  that gloo's own first-use buffers are not part of a publish.

Both sides derive the order from the plan (`gather_order`); a read out of that order raises
`TransportError` naming the tensor, instead of pairing a shard with the wrong tensor.
Placements other than one `Shard(0)` on a one-dimensional mesh (what `fully_shard` makes) fall
back to `full_tensor()` on every rank: the decision is the same everywhere, placements being
global. Plain tensors (FSDP2 leaves buffers unsharded) are read as they are, without any
communication. Over NCCL the same sends and receives run on the device: written, not yet run on
a GPU.
"""

from __future__ import annotations

import math
import mmap
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from transports.errors import TransportError

if TYPE_CHECKING:
    from transports.refit.plan import RefitPlan


def is_dtensor(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor"


def gather_order(plan: RefitPlan, state: Mapping[str, Any]) -> list[str]:
    """The DTensor sources in the order `plan.pack` reads them (bucket by bucket, entry by entry);
    consecutive reads of one source (several engine tensors viewed from it) count once."""
    order: list[str] = []
    for bucket in plan.by_bucket:
        for entry in bucket:
            source = state.get(entry.source)
            if source is None:
                raise TransportError(f"trainer tensor {entry.source!r} (for {entry.name!r}) is missing")
            if is_dtensor(source) and (not order or order[-1] != entry.source):
                order.append(entry.source)
    return order


def _row_split(dtensor) -> tuple[Any, int, int] | None:
    """(process group, group rank, world) when `dtensor` is one Shard(0) over a 1-D mesh, else
    None (gather it with full_tensor())."""
    from torch.distributed.tensor import Shard

    mesh, placements = dtensor.device_mesh, dtensor.placements
    if mesh.ndim != 1 or len(placements) != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
        return None
    group = mesh.get_group()
    return group, mesh.get_local_rank(), mesh.size()


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of `rank`'s shard of n rows: torch.chunk's split, which DTensor's
    Shard uses (the last ranks may hold fewer rows, or none)."""
    full = -(-n // world) if n else 0
    start = min(full * rank, n)
    return start, max(0, min(n, start + full) - start)


def _local_rows(name: str, dtensor, rank: int, world: int) -> torch.Tensor:
    local = dtensor.to_local()
    start, count = _rows(dtensor.shape[0], world, rank)
    if tuple(local.shape) != (count, *dtensor.shape[1:]):
        raise TransportError(f"tensor {name!r}: rank {rank} holds a shard of shape {tuple(local.shape)}, expected "
                             f"{(count, *tuple(dtensor.shape[1:]))} (rows {start}..{start + count} of {dtensor.shape[0]})")
    return local


# Gathered host tensors at least this large get their own anonymous mapping (see `_empty`).
MAP_BYTES = 256 << 10


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor for one gathered tensor. On the host a large one is its own anonymous mapping,
    unmapped when torch frees it: gathering one tensor after another through malloc's heap
    would leave holes that the next, larger one does not fit, so resident memory would grow
    past what is alive (measured: +2 MiB per publish of a 59 MB model, at 4 MiB buckets)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MAP_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    # frombuffer keeps the mapping alive exactly as long as the tensor's storage.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)


def gather_to_root(name: str, dtensor) -> torch.Tensor:
    """The whole tensor on the mesh's rank 0 (every rank of the mesh must call `send_shard` for
    the same tensor at the same point)."""
    import torch.distributed as dist

    split = _row_split(dtensor)
    if split is None:
        return dtensor.full_tensor()
    group, rank, world = split
    if rank != 0:
        raise TransportError(f"tensor {name!r}: gather_to_root called on rank {rank}; the other ranks send_shard")
    local = _local_rows(name, dtensor, rank, world)
    out = _empty(tuple(dtensor.shape), dtensor.dtype, local.device)
    _, own = _rows(dtensor.shape[0], world, 0)
    out[:own].copy_(local)
    for peer in range(1, world):
        start, count = _rows(dtensor.shape[0], world, peer)
        if count:  # both sides know the split: an empty shard is never sent
            # A dim-0 slice of a contiguous tensor is contiguous: received in place, no copy.
            dist.recv(out[start:start + count], src=dist.get_global_rank(group, peer), group=group)
    return out


def send_shard(name: str, dtensor) -> None:
    """This rank's part of `gather_to_root` (ranks other than the mesh's rank 0)."""
    import torch.distributed as dist

    split = _row_split(dtensor)
    if split is None:
        dtensor.full_tensor()  # the collective fallback: every rank takes part; the result is dropped
        return
    group, rank, world = split
    local = _local_rows(name, dtensor, rank, world)
    if local.shape[0]:
        dist.send(local.contiguous(), dst=dist.get_global_rank(group, 0), group=group)


def connect(group=None) -> None:
    """Opens the point-to-point path between the root and every other rank (one element each
    way), so that the first gather does not pay for it. A collective: every rank calls it."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # NCCL sends device tensors only (a CPU probe would raise): written, not yet run on a GPU.
    nccl = dist.get_backend(group) == "nccl"
    probe = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    for peer in range(1, world):
        if rank == 0:
            dist.recv(probe, src=dist.get_global_rank(group, peer) if group else peer, group=group)
            dist.send(probe, dst=dist.get_global_rank(group, peer) if group else peer, group=group)
        elif rank == peer:
            dist.send(probe, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
            dist.recv(probe, src=dist.get_global_rank(group, 0) if group else 0, group=group)


def send_shards(state: Mapping[str, Any], plan: RefitPlan) -> int:
    """A non-sending rank's whole part of one publish: its shard of every DTensor, in plan
    order. Returns how many tensors it took part in."""
    order = gather_order(plan, state)
    for name in order:
        send_shard(name, state[name])
    return len(order)


class GatheredStateDict(Mapping):
    """The sending rank's view of a sharded state dict for `plan.pack`: DTensor values are
    gathered when read, in plan order (see the module docstring). Only the tensor last read is
    held here; the one before is dropped before the next is gathered, so what stays alive is
    what the packer itself still holds (at most the tensors of the bucket it is packing)."""

    # RefitPlan.pack: read sources in plan order, once, on the calling thread; never index
    # every entry up front (each read is a collective).
    gathers_on_read = True

    def __init__(self, state: Mapping[str, Any], plan: RefitPlan):
        self._state = state
        self._order = gather_order(plan, state)
        self._next = 0
        self._current: tuple[str, torch.Tensor] | None = None
        # Bytes of gathered tensors whose storage is still alive (here or in the packer), and
        # the most at once: a finalizer on each storage counts it down when torch frees it.
        self.alive_bytes = 0
        self.peak_bytes = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._state[name]
        if not is_dtensor(value):
            return value
        if self._current is not None and self._current[0] == name:
            return self._current[1]
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing (all were read)"
            raise TransportError(f"tensor {name!r} read out of the gather order: expected {expected!r}; "
                                 "every rank sends its shards in plan order")
        self._next += 1
        self._current = None  # dropped before the next one is allocated
        full = gather_to_root(name, value)
        self._current = (name, full)
        if _row_split(value) is not None:  # our own allocation (full_tensor() may share storage)
            storage = full.untyped_storage()
            self.alive_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.alive_bytes)
            weakref.finalize(storage, self._freed, storage.nbytes())
        return full

    def _freed(self, nbytes: int) -> None:
        self.alive_bytes -= nbytes

    @property
    def complete(self) -> bool:
        """Every scheduled tensor was gathered (the other ranks sent all they will send)."""
        return self._next == len(self._order)

    @property
    def progress(self) -> tuple[int, int]:
        """(tensors gathered so far, tensors the other ranks send)."""
        return self._next, len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)
