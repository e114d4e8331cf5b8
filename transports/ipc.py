"""IPC transport for colocated engines: two shared-memory arenas, reused across versions.

The trainer packs bucket k straight into arena k % 2 (that write is the only sender-side copy)
and announces it over ZMQ as soon as it is packed; each engine replays it out of shared memory
(the second and last copy) and acknowledges. `send(k)` returns once every engine acknowledged
bucket k-1, not k: so while an engine applies bucket k, the next announcement is already
queued for it, and the trainer's packing thread writes bucket k+1 into the other arena
(`plan.pack(..., hold=1)`: an arena is refilled only once its bucket was acknowledged, every
wait bounded by the timeout).

On a GPU the same flow carries CUDA IPC handles of device arenas instead of shared-memory
names (`torch.multiprocessing.reductions.reduce_tensor`): the plan packs into the device arenas
with torch ops, and the engine replays straight out of the trainer's mapped arena on the device
(no host copy), synchronizing its stream before it acks. `IpcSender(device="cuda")` without a
CUDA device raises `TransportUnavailableError`. Written, not yet run on a GPU (`test_gpu_*`
tests, marked `gpu`, skip without one).

Messages (ZMQ ROUTER on the trainer, one DEALER per engine), all multipart:
    engine  -> trainer   [b"hello"]                       once, after connecting
    trainer -> engine    [b"bucket", slot, header, length, cuda_handle]   bucket in arena `slot`
    engine  -> trainer   [b"ack", index, attempt] | [b"error", index, message, attempt]

The CUDA handle is a pickle (`reduce_tensor`'s `(rebuild_cuda_tensor, args)`). The engine never
unpickles it with the standard unpickler: `load_cuda_handle` resolves only the one rebuild
function and the plain types its arguments hold (`torch.Tensor`, `torch.Size`, the storage
classes, dtypes), checks the shape of what it got, and refuses anything else with
`UnsafeHandleError` before calling anything: a peer on the ZMQ socket cannot make the engine
run code of its choosing.
"""

from __future__ import annotations

import mmap
import os
import pickle
import tempfile
import uuid
from multiprocessing import shared_memory
from typing import Any

import structlog
import torch
import zmq

from transports.errors import (
    TransportError,
    TransportTimeoutError,
    TransportUnavailableError,
)
from transports.staging import StagingArea
from transports.wire import BucketHeader, decode_header, encode_header

log = structlog.get_logger("transports.ipc")


class UnsafeHandleError(TransportError):
    """A CUDA IPC handle that is not exactly `(rebuild_cuda_tensor, args)` of plain values."""


_REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
_TYPES = {("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch.storage", "TypedStorage"),
          ("torch.storage", "UntypedStorage"), ("torch", "TypedStorage"), ("torch", "UntypedStorage")}
_REBUILD_ARGS = 15  # rebuild_cuda_tensor's parameters


def _allowed_global(module: str, name: str) -> Any:
    """The object a handle may name, or None: the rebuild function, the plain types of its
    arguments, a dtype, a legacy CUDA storage class."""
    if (module, name) == _REBUILD:
        from torch.multiprocessing import reductions

        return reductions.rebuild_cuda_tensor
    if (module, name) in _TYPES:
        import importlib

        return getattr(importlib.import_module(module), name)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module == "torch.cuda" and name.endswith("Storage"):
        cls = getattr(torch.cuda, name, None)
        if isinstance(cls, type) and issubclass(cls, torch.storage.TypedStorage):
            return cls
    return None


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_global(module, name)
        if found is None:
            raise UnsafeHandleError(f"CUDA IPC handle refused: it names {module}.{name}, "
                                    f"only {'.'.join(_REBUILD)} and plain tensor types are allowed")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeHandleError("CUDA IPC handle refused: persistent ids are not allowed")


def load_cuda_handle(data: bytes) -> tuple[Any, tuple]:
    """`(rebuild_cuda_tensor, args)` from a handle the trainer pickled; raises
    `UnsafeHandleError` for anything else (before anything it names is called)."""
    import io

    try:
        obj = _HandleUnpickler(io.BytesIO(data)).load()
    except UnsafeHandleError:
        raise
    except Exception as exc:
        raise UnsafeHandleError(f"CUDA IPC handle refused: undecodable ({type(exc).__name__}: {exc})") from exc
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if (not isinstance(obj, tuple) or len(obj) != 2 or obj[0] is not rebuild_cuda_tensor
            or not isinstance(obj[1], tuple) or len(obj[1]) != _REBUILD_ARGS):
        raise UnsafeHandleError("CUDA IPC handle refused: not (rebuild_cuda_tensor, args)")
    args = obj[1]
    if not (isinstance(args[0], type) and issubclass(args[0], torch.Tensor)):
        raise UnsafeHandleError(f"CUDA IPC handle refused: {args[0]!r} is not a tensor class")
    return obj[0], args


def _attach(name: str) -> mmap.mmap:
    """Maps the trainer's segment without `SharedMemory`, whose resource tracker (shared with a
    spawning parent) would otherwise unlink or un-register a segment this process does not own."""
    fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class IpcSender:
    def __init__(self, *, arena_bytes: int, engines: int = 1, timeout_s: float = 60.0, device: str = "cpu",
                 endpoint: str | None = None):
        self.engines = engines
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.endpoint = endpoint or f"ipc://{tempfile.gettempdir()}/inflight-ipc-{uuid.uuid4().hex[:12]}"
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._peer_of: dict[int, bytes] = {}  # engine index -> its receiver's socket identity
        self._excluded: set[int] = set()  # engines left out of every version (see `exclude`)
        self._shm: list[shared_memory.SharedMemory] = []
        size = max(arena_bytes, 1)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            self._sock.close(linger=0)
            raise TransportUnavailableError("ipc on cuda: no CUDA device here (torch.cuda.is_available() is False)")
        if self.device.type == "cuda":
            self._arenas = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        else:
            # Named segments created once and reused for every version: no per-version mmap churn.
            self._shm = [shared_memory.SharedMemory(create=True, size=size) for _ in range(2)]
            self._arenas = [torch.frombuffer(s.buf, dtype=torch.uint8, count=size) for s in self._shm]
        self._acked: dict[bytes, int] = {}  # per engine: the highest bucket acknowledged this attempt
        self._attempt = 0
        self._sent = -1  # the highest bucket announced this attempt
        # This attempt's announcements whose bytes are still in an arena (the last two): a restarted
        # engine that says hello mid-version is sent them (`_rejoined`).
        self._announced: dict[int, list[bytes]] = {}
        self._count = 0  # buckets in this version

    #: `send(k)` returns while the engines may still read bucket k (see the module docstring).
    in_flight = 1

    def arenas(self) -> list[torch.Tensor]:
        """The refit plan packs into these directly."""
        return self._arenas

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        info: dict[str, Any] = {"endpoint": self.endpoint, "timeout_s": self.timeout_s, "device": self.device.type,
                                "index": engine_index}
        if self._shm:
            info["segments"] = [s.name for s in self._shm]
        return info

    def connect(self) -> None:
        while any(i not in self._peer_of and i not in self._excluded for i in range(self.engines)):
            frames = self._recv("an engine to connect")
            if frames[1] == b"hello":
                self._hello(frames)
        log.info("ipc.connected", engines=len(self._peer_of), endpoint=self.endpoint)

    def _hello(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        """An engine's receiver said hello: `[identity, b"hello", index]` (a receiver of an older
        build sends no index and takes the next free one). A second hello for an index is a
        restarted engine: its new socket replaces the old one, returned with the index."""
        peer = frames[0]
        try:
            index = int(frames[2]) if len(frames) > 2 and frames[2] else next(
                i for i in range(len(self._peer_of) + 1) if i not in self._peer_of)
        except ValueError:
            log.warning("ipc.bad_hello", frames=len(frames))
            return None
        if not 0 <= index < self.engines:
            log.warning("ipc.unknown_engine", index=index, engines=self.engines)
            return None
        replaced = self._peer_of.get(index)
        self._peer_of[index] = peer
        return (index, replaced) if replaced is not None and replaced != peer else None

    def _rejoined(self, frames: list[bytes]) -> None:
        """A hello while a version is sent. A restarted engine's hello can reach this socket
        after `begin` (ZMQ connects in the background, later on a loaded host): the attempt
        then announced to the dead socket and waited on it to the timeout. The new socket takes
        the old one's place in this attempt and is sent what was announced, while every bucket
        from 0 is still in an arena; past that the version fails now, naming the engine."""
        replaced = self._hello(frames)
        if replaced is None or replaced[1] not in self._acked:
            return  # a first hello, or an engine this attempt does not send to
        index, old = replaced
        if self._sent == self._count - 1 and self._acked[old] >= self._sent:
            return  # it had every bucket before it restarted: the new socket takes part from the next version
        del self._acked[old]
        if self._sent >= 0 and 0 not in self._announced:
            raise TransportError(f"engine {index} restarted while version buckets were sent (a new hello after "
                                 f"bucket {self._sent}): the buckets it missed are no longer held; the next "
                                 "attempt sends it every bucket")
        peer = frames[0]
        self._acked[peer] = -1
        for index_sent in sorted(self._announced):
            self._sock.send_multipart([peer, *self._announced[index_sent]])
        log.info("ipc.rejoined", engine=index, resent=len(self._announced))

    def _take_hellos(self) -> None:
        """Registers the hellos waiting on the socket (restarted engines), without blocking."""
        while self._sock.poll(0):
            frames = self._sock.recv_multipart()
            if frames[1] == b"hello":
                self._hello(frames)  # anything else is a late answer of a finished version

    def exclude(self, engine_index: int) -> None:
        """Leave engine `engine_index` out of every version from the next one on (a fenced
        engine: no bucket is announced to it and no acknowledgement is awaited from it)."""
        self._check_index(engine_index)
        self._excluded.add(engine_index)

    def include(self, engine_index: int) -> None:
        """Send to engine `engine_index` again from the next version on (a restarted engine's
        receiver says hello again and replaces the old one)."""
        self._check_index(engine_index)
        self._excluded.discard(engine_index)

    def _check_index(self, engine_index: int) -> None:
        if not 0 <= engine_index < self.engines:
            raise TransportError(f"engine index {engine_index} is outside 0..{self.engines - 1}")

    def _targets(self) -> list[bytes]:
        return [peer for i, peer in sorted(self._peer_of.items()) if i not in self._excluded]

    def _recv(self, what: str) -> list[bytes]:
        if not self._sock.poll(int(self.timeout_s * 1000)):
            raise TransportTimeoutError(f"waiting for {what}", self.timeout_s)
        return self._sock.recv_multipart()

    def begin(self, version: int, bucket_count: int) -> None:
        if any(i not in self._peer_of and i not in self._excluded for i in range(self.engines)):
            raise TransportError("init_communicator() was not called: engines are not connected")
        self._take_hellos()
        self._acked = {peer: -1 for peer in self._targets()}
        self._sent = -1
        self._announced = {}
        self._count = bucket_count

    def _slot_of(self, payload: memoryview | torch.Tensor) -> int:
        if isinstance(payload, torch.Tensor):  # a device payload: the plan packed into a CUDA arena
            return next((slot for slot, arena in enumerate(self._arenas)
                         if arena.device == payload.device and arena.data_ptr() == payload.data_ptr()), -1)
        for slot, arena in enumerate(self._arenas):
            if arena.device.type == "cpu" and payload.obj is not None:
                base = memoryview(arena.numpy())
                if payload.obj is base.obj or _same_buffer(payload, arena):
                    return slot
        return -1

    def send(self, header: BucketHeader, payload: memoryview | torch.Tensor) -> None:
        if header.index == 0 or header.attempt != self._attempt:
            self._attempt = header.attempt
            self._acked = {peer: -1 for peer in self._targets()}
            self._sent = -1
            self._announced = {}
        slot = header.index % 2
        if self._slot_of(payload) != slot:
            # Not packed in place (e.g. a caller with its own buffers): copy into the arena once
            # the bucket it held (k-2) was applied everywhere.
            self._wait_acked(header.index - 2)
            source = payload if isinstance(payload, torch.Tensor) else torch.frombuffer(payload, dtype=torch.uint8)
            self._arenas[slot][:len(payload)].copy_(source)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # complete before it is announced
        announcement = [b"bucket", bytes([slot]), encode_header(header), str(len(payload)).encode(),
                        self._handle(slot)]
        # Bucket k's bytes now fill the arena that held k - 2's.
        self._announced.pop(header.index - 2, None)
        self._announced[header.index] = announcement
        for peer in self._acked:
            self._sock.send_multipart([peer, *announcement])
        self._sent = header.index
        # The packer refills the other arena (bucket k-1's) with bucket k+1 as soon as this
        # returns; bucket k's arena is left alone until send(k+1) saw bucket k acknowledged.
        self._wait_acked(header.index - 1)

    def _handle(self, slot: int) -> bytes:
        if self.device.type != "cuda":
            return b""
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps(reduce_tensor(self._arenas[slot]))

    def _wait_acked(self, index: int) -> None:
        """Until every engine acknowledged bucket `index` of the current attempt (acks arrive
        in order per engine; those of an abandoned attempt are ignored)."""
        if index < 0:
            return
        while min(self._acked.values(), default=index) < index:
            frames = self._recv(f"engines to apply bucket {index}")
            peer, kind = frames[0], frames[1]
            if kind == b"hello":  # a restarted engine
                self._rejoined(frames)
                continue
            if peer not in self._acked:
                continue  # an engine left out of this version, or a socket a restart replaced
            if kind == b"error":
                if len(frames) > 4 and int(frames[4]) != self._attempt:
                    continue  # an engine's late answer to an abandoned attempt
                raise TransportError(f"engine failed on bucket {int(frames[2])}: {frames[3].decode()}")
            if kind == b"ack" and len(frames) > 3 and int(frames[3]) == self._attempt:
                self._acked[peer] = max(self._acked[peer], int(frames[2]))

    def commit(self, version: int) -> None:
        self._wait_acked(self._sent)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._arenas = []
        for shm in self._shm:
            try:
                shm.close()
                shm.unlink()
            except (FileNotFoundError, BufferError):
                pass
        self._shm = []


def _same_buffer(payload: memoryview, arena: torch.Tensor) -> bool:
    import numpy as np

    try:
        return np.frombuffer(payload, dtype=np.uint8).__array_interface__["data"][0] == arena.data_ptr()
    except (ValueError, TypeError):
        return False


class IpcReceiver:
    def __init__(self, *, endpoint: str, segments: list[str] | None = None, timeout_s: float = 60.0,
                 device: str = "cpu", index: int | None = None):
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, f"engine-{os.getpid()}-{uuid.uuid4().hex[:6]}".encode())
        self._sock.connect(endpoint)
        # The engine's index tells the trainer which engine this socket is (a restarted engine
        # replaces its old socket; an excluded one is skipped).
        self._sock.send_multipart([b"hello"] if index is None else [b"hello", str(int(index)).encode()])
        self._shm = [_attach(n) for n in (segments or [])]
        self._views = [memoryview(s) for s in self._shm]
        self._held: list[bytes] | None = None  # an announcement of a later version or attempt, not yet acked

    def receive(self, version: int, staging: StagingArea) -> None:
        k, count = 0, None
        while count is None or k < count:
            if self._held is not None:
                frames, self._held = self._held, None
            else:
                if not self._sock.poll(int(self.timeout_s * 1000)):
                    raise TransportTimeoutError(f"waiting for bucket {k} of version {version}", self.timeout_s)
                frames = self._sock.recv_multipart()
            _, slot_raw, raw, length, handle = frames
            header = decode_header(raw)
            ack = [b"ack", str(header.index).encode(), str(header.attempt).encode()]
            if not staging.is_current(header):
                if staging.is_newer(header):
                    # The trainer moved on (a retry of this version, or the next one): this version
                    # can no longer complete. Not acknowledged: the next receive takes it first.
                    self._held = frames
                    raise TransportError(
                        f"version {version}: bucket {header.index} of version {header.version} (attempt "
                        f"{header.attempt}) arrived after {k} of {count if count is not None else '?'} buckets "
                        f"of attempt {staging.attempt}: the trainer has moved past it (a retried attempt, or a later "
                        "version)")
                self._sock.send_multipart(ack)  # left over from an abandoned attempt
                continue
            count = header.count
            try:
                payload = self._payload(slot_raw[0], int(length), handle)
                staging.accept(header, payload)
                if isinstance(payload, torch.Tensor):
                    # The replay's device copies were only queued: they must have read the
                    # trainer's arena before the ack lets the trainer refill it.
                    torch.cuda.current_stream(payload.device).synchronize()
            except Exception as exc:
                self._sock.send_multipart([b"error", str(header.index).encode(), str(exc).encode(),
                                           str(header.attempt).encode()])
                raise
            self._sock.send_multipart(ack)
            k += 1

    def _payload(self, slot: int, length: int, handle: bytes) -> memoryview | torch.Tensor:
        """The bucket's bytes: a view of the shared-memory segment, or (CUDA IPC) the trainer's
        device arena itself, mapped from its handle: replayed on the device, never copied to
        the host."""
        if handle:
            func, args = load_cuda_handle(handle)  # refuses anything but a plain handle, calling nothing
            if not torch.cuda.is_available():
                raise TransportUnavailableError("ipc: the trainer sent a CUDA IPC handle, but this process "
                                                "has no CUDA device (torch.cuda.is_available() is False)")
            device_arena = func(*args)
            if device_arena.dtype != torch.uint8 or device_arena.dim() != 1 or device_arena.numel() < length:
                raise UnsafeHandleError(f"CUDA IPC handle refused: {tuple(device_arena.shape)} "
                                        f"{device_arena.dtype} is not a byte arena of {length} bytes")
            return device_arena[:length]
        return self._views[slot][:length]

    def close(self) -> None:
        self._sock.close(linger=0)
        for view in self._views:
            view.release()
        self._views = []
        for shm in self._shm:
            try:
                shm.close()
            except BufferError:
                pass
        self._shm = []
