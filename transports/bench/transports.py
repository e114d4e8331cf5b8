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

from transports.rss import PeakRss, RssSampler  # noqa: F401  (RssSampler re-exported)

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

            from transports.collective import host_store

            self.store = host_store("127.0.0.1", 0, 2, 120.0)  # loopback only, like the transport
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


def _bench_one(kind: str, state, bucket_bytes: int, workdir: Path, progress, task, rounds: int = 3,
               checksums: bool = True) -> dict[str, Any]:
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
        bucket_bytes=bucket_bytes, wire_dtype=None, timeout_s=300, checksums=checksums)
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
              directory: str | None = None, rounds: int = 3, checksums: bool = True) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress

    torch.set_num_threads(1)
    state = synthetic_state(size, tensors)
    total = sum(t.numel() * t.element_size() for t in state.values())
    results: dict[str, Any] = {"size_bytes": total, "tensors": len(state), "bucket_bytes": bucket_bytes,
                               "rounds": rounds, "checksums": checksums, "transports": {}}
    with tempfile.TemporaryDirectory(dir=directory, prefix="inflight-bench-") as tmp, \
            Progress(console=Console(file=sys.stderr), transient=False) as progress:
        for kind in transports:
            task = progress.add_task(f"{kind}", total=3)
            results["transports"][kind] = _bench_one(kind, state, bucket_bytes, Path(tmp), progress, task, rounds,
                                                     checksums)
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
