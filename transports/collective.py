"""Collective transport: a torch.distributed group of the trainer (rank 0) and every engine
worker, formed in `init_communicator()`, and a bucketed broadcast.

The group is built without `init_process_group` (an engine worker already has its own default
group): the trainer hosts a `TCPStore`, every rank builds `ProcessGroupGloo` (NCCL on GPU) from
it. Every wait has a timeout: a peer that never joins fails the rendezvous, a peer that stalls
mid-transfer fails the broadcast, both as `TransportTimeoutError`, never a hang.

Per bucket, three broadcasts: the sizes (int64 [2]), the msgpack header, the payload.
Only this transport forwards `kv_scales` (in the header of bucket 0).
"""

from __future__ import annotations

import datetime
from typing import Any

import structlog
import torch
import torch.distributed as dist

from transports.base import BucketHeader, TransportError, TransportTimeoutError, decode_header, encode_header
from transports.staging import ReplayPipeline, StagingArea

log = structlog.get_logger("transports.collective")


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or isinstance(exc, TimeoutError)


class _Group:
    """One gloo group joined through a TCPStore, with a timeout on every operation."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore("inflight-weights", store)
        try:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, self.timeout)
        except Exception as exc:
            if _is_timeout(exc):
                raise TransportTimeoutError(f"forming the weight group (rank {rank} of {world_size})",
                                            timeout_s) from exc
            raise TransportError(f"forming the weight group (rank {rank} of {world_size}): {exc}") from exc

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        try:
            work = self.pg.broadcast([tensor], opts)
            work.wait(self.timeout)
        except Exception as exc:
            if _is_timeout(exc):
                raise TransportTimeoutError(f"broadcast of {what}", self.timeout_s) from exc
            raise TransportError(f"broadcast of {what} failed: {exc}") from exc


class CollectiveSender:
    """Rank 0. `engine_workers`: ranks 1..engine_workers are the engines' workers."""

    def __init__(self, *, engine_workers: int, workers_per_engine: int = 1, host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 60.0):
        if engine_workers < 1:
            raise TransportError("the collective transport needs at least one engine worker")
        self.world_size = 1 + engine_workers
        self.workers_per_engine = workers_per_engine
        self.timeout_s = timeout_s
        self.host = host
        # The store is hosted here and listening before any engine is told where it is.
        self.store = dist.TCPStore(host, port, self.world_size, is_master=True,
                                   timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        self.port = self.store.port
        self.group: _Group | None = None
        self._sizes = torch.zeros(2, dtype=torch.int64)

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "world_size": self.world_size,
                "rank_offset": 1 + engine_index * self.workers_per_engine, "timeout_s": self.timeout_s}

    def connect(self) -> None:
        self.group = _Group(self.store, 0, self.world_size, self.timeout_s)
        log.info("collective.joined", world_size=self.world_size, port=self.port)

    def begin(self, version: int, bucket_count: int) -> None:
        if self.group is None:
            raise TransportError("init_communicator() was not called: no weight group")

    def send(self, header: BucketHeader, payload: memoryview) -> None:
        assert self.group is not None
        raw = encode_header(header)
        self._sizes[0], self._sizes[1] = len(raw), len(payload)
        what = f"bucket {header.index} of version {header.version}"
        self.group.broadcast(self._sizes, what)
        self.group.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), what)
        if len(payload):
            self.group.broadcast(torch.frombuffer(payload, dtype=torch.uint8), what)

    def commit(self, version: int) -> None:
        pass

    def close(self) -> None:
        self.group = None


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
        self.group = _Group(store, rank, world_size, timeout_s)
        self._arenas = [torch.empty(max(arena_bytes, 1), dtype=torch.uint8) for _ in range(2)]
        self._sizes = torch.zeros(2, dtype=torch.int64)

    def receive(self, version: int, staging: StagingArea) -> None:
        """A rejected bucket does not end the loop: the rest of the version is still received
        (and dropped) so the trainer's broadcasts complete, then the error is raised."""
        pipe = ReplayPipeline(staging, arenas=2, timeout_s=self.timeout_s)
        error: TransportError | None = None
        try:
            k, count = 0, None
            while count is None or k < count:
                what = f"bucket {k} of version {version}"
                self.group.broadcast(self._sizes, what)
                header_len, payload_len = int(self._sizes[0]), int(self._sizes[1])
                raw = torch.empty(header_len, dtype=torch.uint8)
                self.group.broadcast(raw, what)
                header = decode_header(raw.numpy().tobytes())
                count = header.count
                slot = k % 2
                if error is None:
                    try:
                        pipe.acquire(k)  # the arena's previous replay must be done before reuse
                    except TransportError as exc:
                        error = exc
                arena = self._arenas[slot]
                if payload_len > arena.numel():
                    raise TransportError(f"{what}: {payload_len} bytes exceed the arena ({arena.numel()})")
                if payload_len:
                    self.group.broadcast(arena[:payload_len], what)
                if error is None:
                    pipe.submit(slot, header, memoryview(arena.numpy())[:payload_len])
                k += 1
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
