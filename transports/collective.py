"""Collective transport: a torch.distributed group of the trainer (rank 0) and every engine
worker, formed in `init_communicator()`, and a bucketed broadcast.

The group is built without `init_process_group` (an engine worker already has its own default
group): the trainer hosts a `TCPStore`, every rank builds `ProcessGroupGloo` from it for CPU
tensors, or `ProcessGroupNCCL` for CUDA tensors (`CollectiveSender(device="cuda")`; the trainer
publishes its device in the store, so every receiver builds the same kind of group, on its
current CUDA device; `TransportUnavailableError` naming what is missing where there is no CUDA
device or no NCCL; written, not yet run on a GPU). Every wait has a timeout: a peer that never
joins fails the rendezvous, a peer that stalls mid-transfer fails the broadcast, both as
`TransportTimeoutError`, never a hang.

Per bucket, in this order: a fixed `HEADER_RESERVE`-byte head (payload length, header length,
the msgpack header; a header too large for it, a long `kv_scales`, follows in a broadcast of
its own), then the payload as `bucket_segments`: every tensor of `DIRECT_MIN_BYTES` or more in
a broadcast of its own, straight from the trainer's tensor where it needs no copy (`DirectArenas`,
`BucketPayload`) into the engine's staging tensor where that can take it as it is
(`StagingArea.landing`), and each run of smaller tensors as one span of the arenas (packed on
the trainer, replayed out of the arena on the engine). Both sides derive the segments from the
same header bytes, so every broadcast's size agrees. The trainer starts every broadcast of
bucket k without waiting: `send(k)` returns once bucket k-1's completed (`plan.pack(...,
hold=1)` keeps bucket k's arena untouched meanwhile), so gloo moves bucket k while the packing
thread checksums (and packs what needs a copy of) bucket k+1. The engine hands bucket k to its
replay thread (which verifies the checksums) once bucket k+1's head arrived. Only this
transport forwards `kv_scales` (in the header of bucket 0).

Exposure: torch's `TCPStore` server listens on every interface whatever `host_name` says (checked
on torch 2.13: `ss -ltn` shows `*:PORT`, the libuv backend binds `::`), and it has no
authentication. So the trainer binds the listening socket itself, to the configured host
(`TrainCluster.host`, 127.0.0.1 by default), and hands it to the store (`master_listen_fd`): the
rendezvous is reachable only on that interface. The gloo group's own sockets are bound to the
same host where it is a loopback address (engines on the same machine); for remote engines
configure the host to the one interface that must reach them.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Any

import structlog
import torch
import torch.distributed as dist

from transports.errors import (
    TransportConfigError,
    TransportError,
    TransportTimeoutError,
    TransportUnavailableError,
)
from transports.refit.plan import BucketPayload, DirectArenas
from transports.staging import ReplayPipeline, StagingArea
from transports.wire import BucketHeader, decode_header, encode_header

log = structlog.get_logger("transports.collective")


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or isinstance(exc, TimeoutError)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A master `TCPStore` listening on `host` only (torch's own binds every interface): the
    socket is bound here and handed to the store (`master_listen_fd`, which then owns it)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    fd = -1
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
        bound_port = sock.getsockname()[1]
        fd = os.dup(sock.fileno())
        store = dist.TCPStore(host, bound_port, world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=fd)
        fd = -1  # the store owns it now
        return store
    except OSError as exc:
        raise TransportError(f"hosting the weight group's store on {host}:{port}: {exc}") from exc
    finally:
        sock.close()
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


#: gloo worker threads: each runs one broadcast at a time, so this many can be in flight (the
#: default 2 left the socket idle between a bucket's per-tensor broadcasts; 8 measured best).
GLOO_THREADS = 8
DEVICE_KEY = "inflight-weights-device"  # store key: the device the trainer broadcasts from


def require_nccl() -> None:
    """The collective transport on CUDA tensors needs a CUDA device and torch's NCCL backend;
    raises `TransportUnavailableError` naming whichever is missing."""
    if not torch.cuda.is_available():
        raise TransportUnavailableError("collective transport on cuda: no CUDA device here "
                                        "(torch.cuda.is_available() is False)")
    if not dist.is_nccl_available():
        raise TransportUnavailableError("collective transport on cuda: this torch build has no NCCL "
                                        "(torch.distributed.is_nccl_available() is False)")


class _Group:
    """One process group joined through a TCPStore, with a timeout on every operation: gloo
    for CPU tensors (with `bind_host`, gloo's own sockets listen on that address only), NCCL
    for CUDA tensors."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float, bind_host: str | None = None,
                 device: torch.device | None = None):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device or torch.device("cpu")
        prefixed = dist.PrefixStore("inflight-weights", store)
        try:
            if self.device.type == "cuda":
                require_nccl()
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            else:
                options = dist.ProcessGroupGloo._Options()
                options._timeout = self.timeout
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host) if bind_host
                                    else dist.ProcessGroupGloo.create_default_device()]
                # A bucket is several broadcasts (one per large tensor): more of them in flight
                # keeps the socket busy while a worker thread waits for the peer's next receive.
                options._threads = GLOO_THREADS
                self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        except TransportError:
            raise
        except Exception as exc:
            if _is_timeout(exc):
                raise TransportTimeoutError(f"forming the weight group (rank {rank} of {world_size})",
                                            timeout_s) from exc
            raise TransportError(f"forming the weight group (rank {rank} of {world_size}): {exc}") from exc

    def start_broadcast(self, tensor: torch.Tensor, what: str) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        try:
            return self.pg.broadcast([tensor], opts)
        except Exception as exc:
            raise self._error(exc, what) from exc

    def wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
            if self.device.type == "cuda":
                # NCCL's wait only orders this thread's stream after the broadcast: the host
                # (and the replay thread's stream) must see the bytes too.
                torch.cuda.current_stream(self.device).synchronize()
        except Exception as exc:
            raise self._error(exc, what) from exc

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self.wait(self.start_broadcast(tensor, what), what)

    def _error(self, exc: Exception, what: str) -> TransportError:
        if _is_timeout(exc):
            return TransportTimeoutError(f"broadcast of {what}", self.timeout_s)
        return TransportError(f"broadcast of {what} failed: {exc}")


HEADER_RESERVE = 16 << 10  # the head broadcast that opens every bucket
_LENGTHS = 16  # two little-endian u64: payload length, header length
#: A tensor of at least this many bytes travels in a broadcast of its own, straight from the
#: trainer's tensor into its staging tensor; smaller neighbours share one broadcast of their
#: arena span (a copy costs less than a collective's fixed cost there).
DIRECT_MIN_BYTES = 512 << 10


def _head(payload_len: int, header: bytes) -> tuple[bytes, bytes | None]:
    """The head's bytes, and the header to broadcast separately when it does not fit."""
    fits = len(header) <= HEADER_RESERVE - _LENGTHS
    lengths = payload_len.to_bytes(8, "little") + len(header).to_bytes(8, "little")
    return (lengths + header, None) if fits else (lengths, header)


def bucket_segments(tensors, min_bytes: int = DIRECT_MIN_BYTES) -> list[tuple[int, int, str | None]]:
    """The broadcasts of one bucket after its head, as (start, end, tensor name or None for an
    arena span): a tensor of `min_bytes` or more alone, runs of smaller ones as one span of the
    payload. Sender and receivers both derive this from the same header bytes, so they agree on
    every broadcast's size whatever the header says."""
    out: list[tuple[int, int, str | None]] = []
    run: list[int] | None = None
    for meta in sorted(tensors, key=lambda m: m.offset):
        if meta.nbytes <= 0:
            continue
        end = meta.offset + meta.nbytes
        if meta.nbytes >= min_bytes:
            if run is not None:
                out.append((run[0], run[1], None))
                run = None
            out.append((meta.offset, end, meta.name))
        elif run is None:
            run = [meta.offset, end]
        else:
            run[1] = max(run[1], end)
    if run is not None:
        out.append((run[0], run[1], None))
    return out


class CollectiveSender:
    """Rank 0. `engine_workers`: ranks 1..engine_workers are the engines' workers.
    `device`: "cpu" (gloo, CPU tensors) or "cuda" (NCCL, CUDA tensors; `TransportUnavailableError`
    where there is no CUDA device or no NCCL). The refit plan packs into this sender's
    `arenas()` (a `DirectArenas`): tensors of `DIRECT_MIN_BYTES` or more that need no copy are
    broadcast straight from the trainer's memory."""

    #: `send(k)` returns while bucket k is still being broadcast (see the module docstring).
    in_flight = 1

    def __init__(self, *, engine_workers: int, workers_per_engine: int = 1, host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 60.0, arena_bytes: int | None = None, device: str = "cpu"):
        if engine_workers < 1:
            raise TransportError("the collective transport needs at least one engine worker")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            require_nccl()  # before anything listens
            if self.device.index is None:  # the trainer's current device, named, so devices compare equal
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.device.type != "cpu":
            raise TransportConfigError(f"collective transport: device {device!r} is neither cpu nor cuda")
        self.world_size = 1 + engine_workers
        self.workers_per_engine = workers_per_engine
        self.timeout_s = timeout_s
        self.host = host
        # The store is hosted here and listening (on `host` only) before any engine is told where it is.
        self.store = host_store(host, port, self.world_size, timeout_s)
        self.store.set(DEVICE_KEY, self.device.type)  # receivers build the same kind of group
        self.port = self.store.port
        self.group: _Group | None = None
        arenas = [torch.empty(arena_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)] if arena_bytes else []
        self._arenas = DirectArenas(arenas, device=self.device, min_bytes=DIRECT_MIN_BYTES)
        self._heads = [torch.zeros(HEADER_RESERVE, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._buffers: list[torch.Tensor | None] = [None, None]  # for payloads not packed in place
        self._pending: list[tuple[int, list[Any], str]] = []  # (bucket index, works, what), oldest first

    def arenas(self) -> DirectArenas:
        """Where the refit plan packs (what needs a copy); empty until the first `pack`."""
        return self._arenas

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "world_size": self.world_size,
                "rank_offset": 1 + engine_index * self.workers_per_engine, "timeout_s": self.timeout_s}

    def connect(self) -> None:
        unspecified = self.host in ("", "0.0.0.0", "::")  # every interface, asked for explicitly
        self.group = _Group(self.store, 0, self.world_size, self.timeout_s,
                            bind_host=None if unspecified else self.host, device=self.device)
        log.info("collective.joined", world_size=self.world_size, port=self.port, device=self.device.type)

    def begin(self, version: int, bucket_count: int) -> None:
        if self.group is None:
            raise TransportError("init_communicator() was not called: no weight group")
        self._pending = []

    def _copy_of(self, slot: int, payload: memoryview, size: int) -> torch.Tensor:
        """A buffer of this sender's (reused per slot) holding a payload packed elsewhere."""
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        if len(payload):
            buffer[:len(payload)].copy_(torch.frombuffer(payload, dtype=torch.uint8))
        return buffer

    def _sources(self, header: BucketHeader, payload, slot: int,
                 segments: list[tuple[int, int, str | None]]) -> list[torch.Tensor]:
        """One tensor per segment, to broadcast from: the trainer's own tensor where the plan
        left it in place, else the span of the arena the payload was packed into (or of a
        buffer it is copied into)."""
        size = max([header.nbytes, *(end for _, end, _ in segments)])
        if isinstance(payload, BucketPayload):
            arena = payload.arena
            out = []
            for start, end, name in segments:
                flat = payload.direct.get(name) if name is not None else None
                if flat is not None and flat.numel() == end - start and flat.device == self.device:
                    out.append(flat)
                    continue
                # A span the plan did not pack (a tensor it left in place): pack it now.
                for meta in payload.tensors:
                    if meta.name in payload.direct and start <= meta.offset and meta.offset + meta.nbytes <= end:
                        arena[meta.offset:meta.offset + meta.nbytes].copy_(payload.source(meta))
                out.append(arena[start:end])
            return out
        arena = None
        if isinstance(payload, torch.Tensor):  # a device payload packed by the plan
            arena = next((a for a in self._arenas if a.data_ptr() == payload.data_ptr()), None)
            if arena is None:
                arena = self._copy_of_tensor(slot, payload, size)
        elif len(payload):
            arena = next((a for a in self._arenas if a.device.type == "cpu" and _address(payload) == a.data_ptr()),
                         None)
        if arena is None or arena.numel() < size:
            arena = self._copy_of(slot, payload, size)
        return [arena[start:end] for start, end, _ in segments]

    def _copy_of_tensor(self, slot: int, payload: torch.Tensor, size: int) -> torch.Tensor:
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        buffer[:payload.numel()].copy_(payload)
        return buffer

    def send(self, header: BucketHeader, payload: memoryview | BucketPayload) -> None:
        assert self.group is not None
        what = f"bucket {header.index} of version {header.version}"
        if header.index == 0:
            self._pending = []
        if len(payload) > header.nbytes:
            raise TransportError(f"{what}: {len(payload)} payload bytes, the header announces {header.nbytes}")
        slot = header.index % 2
        head, extra = _head(len(payload), encode_header(header))
        buffer = self._heads[slot]
        buffer[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        segments = bucket_segments(header.tensors)
        sources = self._sources(header, payload, slot, segments)
        works = [self.group.start_broadcast(buffer, what)]
        if extra is not None:
            extra_tensor = torch.frombuffer(bytearray(extra), dtype=torch.uint8).to(self.device)
            works.append(self.group.start_broadcast(extra_tensor, what))
        works += [self.group.start_broadcast(source, what) for source in sources]
        self._pending.append((header.index, works, what))
        # Bucket k-1's arena is refilled (with bucket k+1) as soon as this returns.
        while len(self._pending) > self.in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        assert self.group is not None
        _, works, what = self._pending.pop(0)
        for work in works:
            self.group.wait(work, what)

    def commit(self, version: int) -> None:
        while self._pending:
            self._finish_oldest()

    def close(self) -> None:
        self._pending = []
        self.group = None


def _address(view: memoryview) -> int:
    import numpy as np

    try:
        return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
    except (ValueError, TypeError):
        return -1


class CollectiveReceiver:
    """Joins the trainer's group as `rank`, with the kind of group the trainer chose (the
    device it published in the store: gloo and CPU arenas, or NCCL and arenas on this
    worker's current CUDA device)."""

    def __init__(self, *, host: str, port: int, world_size: int, rank: int, arena_bytes: int,
                 timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        try:
            store = dist.TCPStore(host, port, world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            kind = store.get(DEVICE_KEY).decode()
        except Exception as exc:
            if _is_timeout(exc):
                raise TransportTimeoutError(f"reaching the trainer's store at {host}:{port}", timeout_s) from exc
            raise TransportError(f"reaching the trainer's store at {host}:{port}: {exc}") from exc
        if kind == "cuda":
            require_nccl()
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif kind == "cpu":
            self.device = torch.device("cpu")
        else:
            raise TransportError(f"the trainer's store names device {kind!r}, neither cpu nor cuda")
        # Same machine as the trainer (a loopback store): gloo listens on loopback too.
        self.group = _Group(store, rank, world_size, timeout_s, bind_host=host if is_loopback(host) else None,
                            device=self.device)
        self._arena_bytes = max(arena_bytes, 0)
        self._arenas: list[torch.Tensor | None] = [None, None]  # allocated on first use, then kept
        self._head = torch.zeros(HEADER_RESERVE, dtype=torch.uint8, device=self.device)

    def _arena(self, slot: int, size: int) -> torch.Tensor:
        arena = self._arenas[slot]
        if arena is None or arena.numel() < size:
            arena = self._arenas[slot] = torch.empty(max(size, self._arena_bytes), dtype=torch.uint8,
                                                     device=self.device)
        return arena

    def _read_head(self, what: str) -> tuple[BucketHeader, int]:
        self.group.broadcast(self._head, what)
        head = self._head.cpu().numpy() if self.device.type != "cpu" else self._head.numpy()
        payload_len = int.from_bytes(head[:8].tobytes(), "little")
        header_len = int.from_bytes(head[8:_LENGTHS].tobytes(), "little")
        if header_len <= HEADER_RESERVE - _LENGTHS:
            raw = head[_LENGTHS:_LENGTHS + header_len].tobytes()
        else:
            extra = torch.empty(header_len, dtype=torch.uint8, device=self.device)
            self.group.broadcast(extra, what)
            raw = extra.cpu().numpy().tobytes()
        return decode_header(raw), payload_len

    def receive(self, version: int, staging: StagingArea) -> None:
        """Per bucket: the head (lengths and header), then its segments (`bucket_segments`),
        each straight into its staging tensor where the staging area can take it as it is
        (`landing`), else into the arena at its offset. Bucket k is handed to the replay thread
        (which verifies its checksums) once bucket k+1's head arrived, so it is checked while
        bucket k+1 streams in. A rejected bucket does not end the loop: the rest of the version
        is still received (and dropped) so the trainer's broadcasts complete, then the error is
        raised."""
        plan = staging.plan
        pipe = ReplayPipeline(staging, arenas=2, timeout_s=self.timeout_s)
        error: TransportError | None = None
        previous = None

        def finish(bucket) -> None:
            nonlocal error
            slot, header, payload, landed, works, what = bucket
            for work in works:
                self.group.wait(work, what)
            if error is None:
                pipe.submit(slot, header, payload, landed=landed)

        try:
            for k in range(plan.bucket_count):
                what = f"bucket {k} of version {version}"
                header, payload_len = self._read_head(what)
                if header.index != k or header.count != plan.bucket_count:
                    # A trainer that restarted mid-version (a retry after a failure of its own):
                    # taking this bucket as bucket k would splice two attempts together.
                    raise TransportError(
                        f"{what}: the trainer sent bucket {header.index} of {header.count} of version "
                        f"{header.version} (attempt {header.attempt}), expected bucket {k} of "
                        f"{plan.bucket_count}: the group is out of step and needs a fresh rendezvous")
                if previous is not None:
                    finish(previous)
                    previous = None
                if payload_len > plan.bucket_nbytes[k]:
                    raise TransportError(f"{what}: {payload_len} payload bytes, the plan has {plan.bucket_nbytes[k]}")
                slot = k % 2
                if error is None:
                    try:
                        pipe.acquire(k)  # the arena's previous replay must be done before reuse
                    except TransportError as exc:
                        error = exc
                segments = bucket_segments(header.tensors)
                size = max([payload_len, *(end for _, end, _ in segments)])
                if size > max(plan.arena_bytes, self._arena_bytes):
                    name = next((n for _, end, n in segments if end > plan.arena_bytes), None)
                    raise TransportError(f"{what}: {'tensor ' + repr(name) if name else 'a span'} ends past the "
                                         f"plan's arena of {plan.arena_bytes} bytes")
                arena = self._arena(slot, size)
                # Straight into staging only on the host (the staging area's tensors live there).
                landing = staging.landing(header) if error is None and self.device.type == "cpu" else {}
                landed, works = {}, []
                for start, end, name in segments:
                    flat = landing.get(name) if name is not None else None
                    if flat is not None and flat.numel() == end - start and name not in landed:
                        landed[name] = flat
                        works.append(self.group.start_broadcast(flat, what))
                    else:
                        works.append(self.group.start_broadcast(arena[start:end], what))
                payload = memoryview(arena.numpy())[:payload_len] if self.device.type == "cpu" else arena[:payload_len]
                previous = (slot, header, payload, landed, works, what)
            if previous is not None:
                finish(previous)
                previous = None
            if error is None:
                pipe.drain()
        except TransportError as exc:
            error = error or exc
        finally:
            pipe.close()
        if error is not None:
            raise error

    def close(self) -> None:
        pass
