"""`inflight bench transports`: each transport against its raw reference, in the same run.

A synthetic state dict (about 100 fp32 tensors) moves from this (trainer) process to a
receiving process that replays into preallocated tensors. Per transport:

    filesystem  vs save_file + fsync, then load_file + copy_ in the other process
    ipc         vs a two-copy shared-memory reference (tensors -> segment -> destination),
                segment created, mapped and touched once, outside the timed region
    http        vs a raw socket: sendall / recv_into straight into the destination tensors
    collective  vs one flat gloo broadcast of all the bytes on a group formed and warmed up
                once, into a receive buffer allocated and touched once

Transport and reference run interleaved (`rounds` times each, after one warm-up of each);
the best time of each is reported. Peak extra RSS of sender and receiver: the resident
high-water mark (VmHWM, reset through /proc/self/clear_refs; a 2 ms sampling thread where
that is not permitted) across init, a warm-up version and one more, over the process's RSS
before the transport existed (so arenas that live across versions count as well as transient
buffers), measured before the reference allocates anything.
"""

from __future__ import annotations

import datetime
import os
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


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    """Resets this process's resident high-water mark (Linux >= 4.0); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Peak resident memory of this process while it is entered: the kernel's high-water mark
    after a reset where permitted, and a sampling thread (every `every_s`) in any case."""

    def __init__(self, every_s: float = 0.002):
        self.every_s = every_s
        self.base = _rss_now()
        self.peak = self.base
        self._exact = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_now())
            time.sleep(self.every_s)

    def __enter__(self) -> RssSampler:
        self._exact = _reset_hwm()
        self.peak = max(self.peak, _rss_now())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_now(), _hwm() if self._exact else 0)

    @property
    def extra(self) -> int:
        return self.peak - self.base


class PeakRss:
    """Peak RSS over several scoped measurements, against one baseline taken at creation."""

    def __init__(self) -> None:
        self.base = _rss_now()
        self.peak = self.base
        self._sampler: RssSampler | None = None

    def start(self) -> None:
        self._sampler = RssSampler()
        self._sampler.__enter__()

    def stop(self) -> int:
        if self._sampler is not None:
            self._sampler.__exit__(None, None, None)
            self.peak = max(self.peak, self._sampler.peak)
            self._sampler = None
        return self.peak - self.base


# -- reference receivers (run in the receiving process; `destination` is preallocated) --------


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


# -- the run ----------------------------------------------------------------------------------


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Reference:
    """The raw limit of one transport: `setup()` once (untimed), `run()` per round (timed),
    `close()`."""

    def __init__(self, kind: str, engine, state: dict[str, torch.Tensor], workdir: Path):
        self.kind, self.engine, self.state, self.workdir = kind, engine, state, workdir
        self.total = sum(t.numel() * t.element_size() for t in state.values())

    def setup(self) -> None:
        kind, engine, state = self.kind, self.engine, self.state
        if kind == "ipc":
            from multiprocessing import shared_memory

            self.shm = shared_memory.SharedMemory(create=True, size=self.total)
            self.raw = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=self.total)
            self.raw.fill_(0)  # fault the pages in once, as the transport's arenas are
            self.layout, offset = [], 0
            for name, tensor in state.items():
                self.layout.append((name, offset, tensor.numel() * tensor.element_size()))
                offset += self.layout[-1][2]
            engine.bench_reference("ref_shm_map", segment=self.shm.name)
        elif kind == "collective":
            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=120))
            self.flat = torch.cat([t.view(-1).view(torch.uint8) for t in state.values()])
            thread = threading.Thread(target=lambda: engine.bench_reference(
                "ref_broadcast_join", port=self.store.port, total=self.total))
            thread.start()
            self.pg = dist.ProcessGroupGloo(self.store, 0, 2, datetime.timedelta(seconds=120))
            thread.join()
            self.run()  # warm-up: the first broadcast on a new group sets up its pairs

    def run(self) -> float:
        kind, engine, state = self.kind, self.engine, self.state
        if kind == "filesystem":
            from safetensors.torch import save_file

            path = self.workdir / "reference.safetensors"

            def go() -> None:
                save_file(state, str(path))
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                engine.bench_reference("ref_load_file", path=str(path))

            seconds = _timed(go)
            path.unlink()
            return seconds
        if kind == "ipc":
            def go() -> None:
                for (name, off, n) in self.layout:
                    self.raw[off:off + n].copy_(state[name].view(-1).view(torch.uint8))
                engine.bench_reference("ref_shm_copy", segment=self.shm.name, layout=self.layout)

            return _timed(go)
        if kind == "http":
            port = engine.bench_reference("ref_socket_listen")
            result: dict[str, Any] = {}

            def receive() -> None:
                result["got"] = engine.bench_reference("ref_socket_recv")

            def go() -> None:
                thread = threading.Thread(target=receive)
                thread.start()
                with socket.create_connection(("127.0.0.1", port), timeout=120) as conn:
                    for tensor in state.values():
                        conn.sendall(memoryview(tensor.view(-1).view(torch.uint8).numpy()))
                thread.join()

            seconds = _timed(go)
            if result.get("got") != self.total:
                raise RuntimeError(f"reference socket received {result.get('got')} of {self.total} bytes")
            return seconds
        if kind == "collective":
            import torch.distributed as dist

            thread = threading.Thread(target=lambda: engine.bench_reference("ref_broadcast"))
            opts = dist.BroadcastOptions()
            opts.rootRank = 0

            def go() -> None:
                thread.start()
                self.pg.broadcast([self.flat], opts).wait()
                thread.join()

            return _timed(go)
        raise ValueError(kind)

    def close(self) -> None:
        if self.kind == "ipc" and hasattr(self, "shm"):
            self.engine.bench_reference("ref_shm_unmap", segment=self.shm.name)
            del self.raw
            self.shm.close()
            self.shm.unlink()
        if self.kind == "collective" and hasattr(self, "pg"):
            self.engine.bench_reference("ref_broadcast_leave")
            del self.pg, self.store, self.flat


def _bench_one(kind: str, state, bucket_bytes: int, workdir: Path, progress, task, rounds: int = 3) -> dict[str, Any]:
    from transports.factory import TrainCluster, create_weight_synchronizer
    from transports.local import ProcessEngine

    total = sum(t.numel() * t.element_size() for t in state.values())
    meta = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}
    engine = ProcessEngine(kind, preallocate=meta, timeout_s=600)
    engine.rss_baseline()  # before the receiver exists: its arenas count as extra memory
    sender_rss = PeakRss()  # likewise for the sender: the trainer's state already exists
    sync = create_weight_synchronizer(
        state_dict=lambda: state, engines=[engine], colocated=kind in ("ipc", "http"), transport=kind,
        train_cluster=TrainCluster(), inference_world_size=1, filesystem_root=workdir / "weights", keep_last=1,
        bucket_bytes=bucket_bytes, wire_dtype=None, timeout_s=300)
    reference = Reference(kind, engine, state, workdir)
    try:
        # Memory: init, a warm-up version and a warm one, before the reference holds any.
        sender_rss.start()
        engine.rss_start()
        sync.init_communicator()
        for _ in range(2):
            sync.mark_stale()
            sync.sync_weights()  # the first is the warm-up: page faults, connections, arenas
        sender_extra = sender_rss.stop()
        receiver_extra = engine.rss_stop()
        reference.setup()
        reference.run()  # warm-up
        progress.advance(task)
        times, ref_times = [], []
        for _ in range(rounds):  # interleaved, so both see the same machine load
            sync.mark_stale()
            times.append(_timed(sync.sync_weights))
            ref_times.append(reference.run())
        progress.advance(task)
        seconds, ref_seconds = min(times), min(ref_times)
        progress.advance(task)
        gbps, ref_gbps = total / seconds / 1e9, total / ref_seconds / 1e9
        largest = max(t.numel() * t.element_size() for t in state.values())
        bucket = sync.plan.arena_bytes
        return {
            "gbps": round(gbps, 3), "reference_gbps": round(ref_gbps, 3), "ratio": round(gbps / ref_gbps, 3),
            "goal": GOALS[kind], "seconds": round(seconds, 4), "reference_seconds": round(ref_seconds, 4),
            "rounds": rounds, "seconds_all": [round(t, 4) for t in times],
            "reference_seconds_all": [round(t, 4) for t in ref_times],
            "peak_extra_bytes": max(sender_extra, receiver_extra),
            "sender_peak_extra_bytes": sender_extra,
            "receiver_peak_extra_bytes": receiver_extra,
            "bucket_bytes": bucket, "memory_goal_bytes": 2 * bucket + largest,
        }
    finally:
        try:
            reference.close()
        finally:
            sync.shutdown()
            engine.stop()


def run_bench(*, size: int, tensors: int, bucket_bytes: int, transports: list[str],
              directory: str | None = None, rounds: int = 3) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress

    torch.set_num_threads(1)
    state = synthetic_state(size, tensors)
    total = sum(t.numel() * t.element_size() for t in state.values())
    results: dict[str, Any] = {"size_bytes": total, "tensors": len(state), "bucket_bytes": bucket_bytes,
                               "rounds": rounds, "transports": {}}
    with tempfile.TemporaryDirectory(dir=directory, prefix="inflight-bench-") as tmp, \
            Progress(console=Console(file=sys.stderr), transient=False) as progress:
        for kind in transports:
            task = progress.add_task(f"{kind}", total=3)
            results["transports"][kind] = _bench_one(kind, state, bucket_bytes, Path(tmp), progress, task, rounds)
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
