"""The raw reference receivers of `inflight bench transports`; they run in the receiving
process (`transports.local`), into `destination`, the preallocated tensors."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch


def ref_load_file(destination, path: str) -> None:
    from safetensors.torch import load_file

    for name, tensor in load_file(path).items():
        destination[name].copy_(tensor)


_mapped: dict[str, Any] = {}


def ref_shm_map(destination, segment: str) -> None:
    """Maps the reference segment once and touches it (outside the timed region)."""
    import mmap

    fd = os.open(f"/dev/shm/{segment.lstrip('/')}", os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    raw.sum(dtype=torch.int64)  # fault every page in
    _mapped[segment] = (mm, raw)


def ref_shm_unmap(destination, segment: str) -> None:
    mm, raw = _mapped.pop(segment)
    del raw
    mm.close()


def ref_shm_copy(destination, segment: str, layout: list[tuple[str, int, int]]) -> None:
    _, raw = _mapped[segment]
    for name, offset, nbytes in layout:
        dst = destination[name]
        dst.view(-1).view(torch.uint8).copy_(raw[offset:offset + nbytes])


def ref_socket_listen(destination) -> int:
    global _listener
    _listener = socket.socket()
    _listener.bind(("127.0.0.1", 0))
    _listener.listen(1)
    return _listener.getsockname()[1]


def ref_socket_recv(destination, timeout_s: float = 120.0) -> int:
    _listener.settimeout(timeout_s)
    conn, _ = _listener.accept()
    got = 0
    with conn:
        for tensor in destination.values():
            view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
            filled = 0
            while filled < len(view):
                n = conn.recv_into(view[filled:])
                if not n:
                    raise ConnectionError("sender closed early")
                filled += n
            got += filled
    _listener.close()
    return got


_group: dict[str, Any] = {}


def ref_broadcast_join(destination, port: int, total: int, timeout_s: float = 120.0) -> None:
    """Joins the reference group and allocates (and touches) its receive buffer, once."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    _group["pg"] = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=timeout_s))
    _group["store"] = store
    _group["buf"] = torch.zeros(total, dtype=torch.uint8)


def ref_broadcast(destination) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    _group["pg"].broadcast([_group["buf"]], opts).wait()


def ref_broadcast_leave(destination) -> None:
    _group.clear()
