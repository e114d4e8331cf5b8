"""Collective transport: a torch.distributed group of the trainer (rank 0) and every engine
worker, formed in `init_communicator()`, and a bucketed broadcast.

The group is built without `init_process_group` (an engine worker already has its own default
group): the trainer hosts a `TCPStore`, every rank builds `ProcessGroupGloo` (NCCL on GPU) from
it. Every wait has a timeout: a peer that never joins fails the rendezvous, a peer that stalls
mid-transfer fails the broadcast, both as `TransportTimeoutError`, never a hang.

One broadcast per bucket: the payload followed by a fixed `HEADER_RESERVE`-byte trailer
(payload length, header length, the msgpack header). Both sides know the payload size of
bucket k from the refit plan, so no size or header round trip precedes the payload; a header
too large for the trailer (a long `kv_scales`) follows in a second broadcast, announced by the
trailer. The trainer packs into its own arenas (with room for the trailer) and starts the
broadcast of bucket k without waiting for it: `send(k)` returns once bucket k-1's broadcast
completed (`plan.pack(..., hold=1)` keeps bucket k's arena untouched meanwhile), so gloo moves
bucket k while bucket k+1 is packed. Only this transport forwards `kv_scales` (in the header of
bucket 0).

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

from transports.errors import TransportError, TransportTimeoutError
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


class _Group:
    """One gloo group joined through a TCPStore, with a timeout on every operation. With
    `bind_host`, gloo's own sockets listen on that address only."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float, bind_host: str | None = None):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore("inflight-weights", store)
        try:
            if bind_host:
                options = dist.ProcessGroupGloo._Options()
                options._timeout = self.timeout
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
                self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
            else:
                self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, self.timeout)
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
        except Exception as exc:
            raise self._error(exc, what) from exc

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self.wait(self.start_broadcast(tensor, what), what)

    def _error(self, exc: Exception, what: str) -> TransportError:
        if _is_timeout(exc):
            return TransportTimeoutError(f"broadcast of {what}", self.timeout_s)
        return TransportError(f"broadcast of {what} failed: {exc}")


HEADER_RESERVE = 16 << 10  # trailer bytes after every bucket's payload
_TRAILER = 16  # two little-endian u64: payload length, header length


def _trailer(payload_len: int, header: bytes) -> tuple[bytes, bytes | None]:
    """The trailer bytes, and the header to broadcast separately when it does not fit."""
    fits = len(header) <= HEADER_RESERVE - _TRAILER
    lengths = payload_len.to_bytes(8, "little") + len(header).to_bytes(8, "little")
    return (lengths + header, None) if fits else (lengths, header)


class CollectiveSender:
    """Rank 0. `engine_workers`: ranks 1..engine_workers are the engines' workers.
    `arena_bytes` (the plan's): the refit plan packs straight into this sender's arenas."""

    #: `send(k)` returns while bucket k is still being broadcast (see the module docstring).
    in_flight = 1

    def __init__(self, *, engine_workers: int, workers_per_engine: int = 1, host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 60.0, arena_bytes: int | None = None):
        if engine_workers < 1:
            raise TransportError("the collective transport needs at least one engine worker")
        self.world_size = 1 + engine_workers
        self.workers_per_engine = workers_per_engine
        self.timeout_s = timeout_s
        self.host = host
        # The store is hosted here and listening (on `host` only) before any engine is told where it is.
        self.store = host_store(host, port, self.world_size, timeout_s)
        self.port = self.store.port
        self.group: _Group | None = None
        size = (arena_bytes or 0) + HEADER_RESERVE
        self._arenas = [torch.empty(size, dtype=torch.uint8) for _ in range(2)] if arena_bytes else None
        self._buffers: list[torch.Tensor | None] = [None, None]  # for payloads not packed in place
        self._pending: list[tuple[int, list[Any], str]] = []  # (bucket index, works, what), oldest first

    def arenas(self) -> list[torch.Tensor] | None:
        """Where the refit plan packs (each with room for the trailer); None: packed elsewhere."""
        return self._arenas

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "world_size": self.world_size,
                "rank_offset": 1 + engine_index * self.workers_per_engine, "timeout_s": self.timeout_s}

    def connect(self) -> None:
        unspecified = self.host in ("", "0.0.0.0", "::")  # every interface, asked for explicitly
        self.group = _Group(self.store, 0, self.world_size, self.timeout_s, bind_host=None if unspecified else self.host)
        log.info("collective.joined", world_size=self.world_size, port=self.port)

    def begin(self, version: int, bucket_count: int) -> None:
        if self.group is None:
            raise TransportError("init_communicator() was not called: no weight group")
        self._pending = []

    def _buffer_for(self, slot: int, payload: memoryview, size: int) -> torch.Tensor:
        """The tensor broadcast for this bucket: the arena the payload was packed into, or a
        buffer of this sender's (reused) that it is copied into."""
        if self._arenas is not None:
            arena = self._arenas[slot]
            if len(payload) and _address(payload) == arena.data_ptr() and arena.numel() >= size:
                return arena
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[slot] = torch.empty(size, dtype=torch.uint8)
        if len(payload):
            buffer[:len(payload)].copy_(torch.frombuffer(payload, dtype=torch.uint8))
        return buffer

    def send(self, header: BucketHeader, payload: memoryview) -> None:
        assert self.group is not None
        what = f"bucket {header.index} of version {header.version}"
        if header.index == 0:
            self._pending = []
        if len(payload) > header.nbytes:
            raise TransportError(f"{what}: {len(payload)} payload bytes, the header announces {header.nbytes}")
        trailer, extra = _trailer(len(payload), encode_header(header))
        size = header.nbytes + HEADER_RESERVE
        buffer = self._buffer_for(header.index % 2, payload, size)
        buffer[header.nbytes:header.nbytes + len(trailer)].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
        works = [self.group.start_broadcast(buffer[:size], what)]
        if extra is not None:
            works.append(self.group.start_broadcast(torch.frombuffer(bytearray(extra), dtype=torch.uint8), what))
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
    def __init__(self, *, host: str, port: int, world_size: int, rank: int, arena_bytes: int,
                 timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        try:
            store = dist.TCPStore(host, port, world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            if _is_timeout(exc):
                raise TransportTimeoutError(f"reaching the trainer's store at {host}:{port}", timeout_s) from exc
            raise TransportError(f"reaching the trainer's store at {host}:{port}: {exc}") from exc
        # Same machine as the trainer (a loopback store): gloo listens on loopback too.
        self.group = _Group(store, rank, world_size, timeout_s, bind_host=host if is_loopback(host) else None)
        self._arenas = [torch.empty(max(arena_bytes, 0) + HEADER_RESERVE, dtype=torch.uint8) for _ in range(2)]

    def receive(self, version: int, staging: StagingArea) -> None:
        """A rejected bucket does not end the loop: the rest of the version is still received
        (and dropped) so the trainer's broadcasts complete, then the error is raised."""
        plan = staging.plan
        pipe = ReplayPipeline(staging, arenas=2, timeout_s=self.timeout_s)
        error: TransportError | None = None
        try:
            for k in range(plan.bucket_count):
                what = f"bucket {k} of version {version}"
                nbytes = plan.bucket_nbytes[k]
                slot = k % 2
                if error is None:
                    try:
                        pipe.acquire(k)  # the arena's previous replay must be done before reuse
                    except TransportError as exc:
                        error = exc
                if nbytes + HEADER_RESERVE > self._arenas[slot].numel():
                    self._arenas[slot] = torch.empty(nbytes + HEADER_RESERVE, dtype=torch.uint8)
                arena = self._arenas[slot]
                self.group.broadcast(arena[:nbytes + HEADER_RESERVE], what)
                trailer = arena[nbytes:nbytes + HEADER_RESERVE].numpy()
                payload_len = int.from_bytes(trailer[:8].tobytes(), "little")
                header_len = int.from_bytes(trailer[8:_TRAILER].tobytes(), "little")
                if header_len <= HEADER_RESERVE - _TRAILER:
                    raw = trailer[_TRAILER:_TRAILER + header_len].tobytes()
                else:
                    extra = torch.empty(header_len, dtype=torch.uint8)
                    self.group.broadcast(extra, what)
                    raw = extra.numpy().tobytes()
                header = decode_header(raw)
                if payload_len > nbytes:
                    raise TransportError(f"{what}: {payload_len} payload bytes, the plan has {nbytes}")
                if error is None:
                    pipe.submit(slot, header, memoryview(arena.numpy())[:payload_len])
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
