"""`inflight bench transports`: each transport against its raw reference, in the same run.

A synthetic state dict (about 100 fp32 tensors) moves from this (trainer) process to a
receiving process that replays into preallocated tensors. Per transport:

    filesystem  vs save_file + fsync, then load_file + copy_ in the other process
    ipc         vs a two-copy shared-memory reference (tensors -> segment -> destination)
    http        vs a raw socket: sendall / recv_into
    collective  vs one flat gloo broadcast of all the bytes

and the peak extra RSS of sender (sampled) and receiver (high-water mark over its baseline).
"""

from __future__ import annotations

import datetime
import os
import resource
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

GOALS = {"filesystem": 0.85, "ipc": 0.8, "http": 0.8, "collective": 0.9}


def synthetic_state(size: int, tensors: int) -> dict[str, torch.Tensor]:
    per = max(1, size // 4 // tensors)
    cols = 256
    state = {}
    g = torch.Generator().manual_seed(0)
    for i in range(tensors):
        rows = max(1, per // cols)
        state[f"model.layers.{i}.weight"] = torch.randn(rows, cols, generator=g)
    return state


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peak resident memory of this process above where it stood at start."""

    def __init__(self, every_s: float = 0.002):
        self.every_s = every_s
        self.base = _rss_now()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_now())
            time.sleep(self.every_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_now())

    @property
    def extra(self) -> int:
        return self.peak - self.base


# -- reference receivers (run in the receiving process; `destination` is preallocated) --------


def ref_load_file(destination, path: str) -> None:
    from safetensors.torch import load_file

    for name, tensor in load_file(path).items():
        destination[name].copy_(tensor)


def ref_shm_copy(destination, segment: str, layout: list[tuple[str, int, int]]) -> None:
    import mmap

    fd = os.open(f"/dev/shm/{segment.lstrip('/')}", os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    for name, offset, nbytes in layout:
        dst = destination[name]
        dst.view(-1).view(torch.uint8).copy_(raw[offset:offset + nbytes])
    del raw
    mm.close()


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


def ref_broadcast(destination, port: int, total: int, timeout_s: float = 120.0) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=timeout_s))
    buf = torch.empty(total, dtype=torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([buf], opts).wait()


# -- the run ----------------------------------------------------------------------------------


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _reference(kind: str, engine, state: dict[str, torch.Tensor], workdir: Path) -> float:
    total = sum(t.numel() * t.element_size() for t in state.values())
    if kind == "filesystem":
        from safetensors.torch import save_file

        path = workdir / "reference.safetensors"

        def run() -> None:
            save_file(state, str(path))
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            engine.bench_reference("ref_load_file", path=str(path))

        seconds = _timed(run)
        path.unlink()
        return seconds
    if kind == "ipc":
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(create=True, size=total)
        try:
            raw = torch.frombuffer(shm.buf, dtype=torch.uint8, count=total)
            layout, offset = [], 0
            for name, tensor in state.items():
                layout.append((name, offset, tensor.numel() * tensor.element_size()))
                offset += layout[-1][2]

            def run() -> None:
                for (name, off, n) in layout:
                    raw[off:off + n].copy_(state[name].view(-1).view(torch.uint8))
                engine.bench_reference("ref_shm_copy", segment=shm.name, layout=layout)

            seconds = _timed(run)
            del raw
        finally:
            shm.close()
            shm.unlink()
        return seconds
    if kind == "http":
        port = engine.bench_reference("ref_socket_listen")
        result: dict[str, Any] = {}

        def receive() -> None:
            result["got"] = engine.bench_reference("ref_socket_recv")

        def run() -> None:
            thread = threading.Thread(target=receive)
            thread.start()
            with socket.create_connection(("127.0.0.1", port)) as conn:
                for tensor in state.values():
                    conn.sendall(memoryview(tensor.view(-1).view(torch.uint8).numpy()))
            thread.join()

        return _timed(run)
    if kind == "collective":
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        flat = torch.cat([t.view(-1).view(torch.uint8) for t in state.values()])
        joined: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: joined.update(
            r=engine.bench_reference("ref_broadcast", port=store.port, total=total)))
        thread.start()
        pg = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=120))
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        seconds = _timed(lambda: pg.broadcast([flat], opts).wait())
        thread.join()
        return seconds
    raise ValueError(kind)


def _bench_one(kind: str, state, bucket_bytes: int, workdir: Path, progress, task) -> dict[str, Any]:
    from transports.factory import TrainCluster, create_weight_synchronizer
    from transports.local import ProcessEngine

    total = sum(t.numel() * t.element_size() for t in state.values())
    meta = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}
    engine = ProcessEngine(kind, preallocate=meta, timeout_s=600)
    sync = create_weight_synchronizer(
        state_dict=lambda: state, engines=[engine], colocated=kind in ("ipc", "http"), transport=kind,
        train_cluster=TrainCluster(), inference_world_size=1, filesystem_root=workdir / "weights", keep_last=1,
        bucket_bytes=bucket_bytes, wire_dtype=None, timeout_s=300)
    try:
        sync.init_communicator()
        sync.mark_stale()
        sync.sync_weights()  # warm-up: page faults, connections, arenas
        progress.advance(task)
        sync.mark_stale()
        with RssSampler() as sampler:
            seconds = _timed(sync.sync_weights)
        progress.advance(task)
        receiver_rss = engine.rss()
        reference = min(_reference(kind, engine, state, workdir) for _ in range(2))
        progress.advance(task)
        gbps, ref_gbps = total / seconds / 1e9, total / reference / 1e9
        largest = max(t.numel() * t.element_size() for t in state.values())
        bucket = sync.plan.arena_bytes
        return {
            "gbps": round(gbps, 3), "reference_gbps": round(ref_gbps, 3), "ratio": round(gbps / ref_gbps, 3),
            "goal": GOALS[kind], "seconds": round(seconds, 4), "reference_seconds": round(reference, 4),
            "peak_extra_bytes": max(sampler.extra, receiver_rss["peak"] - receiver_rss["baseline"]),
            "sender_peak_extra_bytes": sampler.extra,
            "receiver_peak_extra_bytes": receiver_rss["peak"] - receiver_rss["baseline"],
            "bucket_bytes": bucket, "memory_goal_bytes": 2 * bucket + largest,
        }
    finally:
        sync.shutdown()
        engine.stop()


def run_bench(*, size: int, tensors: int, bucket_bytes: int, transports: list[str],
              directory: str | None = None) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress

    torch.set_num_threads(1)
    state = synthetic_state(size, tensors)
    total = sum(t.numel() * t.element_size() for t in state.values())
    results: dict[str, Any] = {"size_bytes": total, "tensors": len(state), "bucket_bytes": bucket_bytes,
                               "transports": {}}
    with tempfile.TemporaryDirectory(dir=directory, prefix="inflight-bench-") as tmp, \
            Progress(console=Console(file=sys.stderr), transient=False) as progress:
        for kind in transports:
            task = progress.add_task(f"{kind}", total=3)
            results["transports"][kind] = _bench_one(kind, state, bucket_bytes, Path(tmp), progress, task)
    return results


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"transports: {results['size_bytes'] / 2**20:.0f} MiB in {results['tensors']} tensors")
    for col in ("transport", "GB/s", "reference GB/s", "ratio", "goal", "peak extra MiB", "2 buckets + largest MiB"):
        table.add_column(col, justify="right")
    for kind, r in results["transports"].items():
        table.add_row(kind, f"{r['gbps']:.2f}", f"{r['reference_gbps']:.2f}", f"{r['ratio']:.2f}",
                      f"{r['goal']:.2f}", f"{r['peak_extra_bytes'] / 2**20:.1f}",
                      f"{r['memory_goal_bytes'] / 2**20:.1f}")
    Console().print(table)


_listener: socket.socket
_ = resource  # ru_maxrss is read in the receiving process (transports.local)
