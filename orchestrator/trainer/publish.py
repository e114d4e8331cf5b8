"""Publishing trainer weights as versions through the project's own synchronizer.

The filesystem transport writes RUN_DIR/weights/vNNNNNNNN/ (safetensors buckets, a manifest,
then COMPLETE); engines stage a version from there. Weights travel in fp32 (`wire_dtype=None`
keeps each tensor's own dtype), so what an engine loads is bit-identical to the checkpoint.

Under torchrun (FSDP2) every rank takes part in each publish, bucket by bucket: rank 0 packs a
`GatheredStateDict` (each DTensor gathered to it when its bucket needs it) and writes; the
other ranks send their shards in the same order (`transports.refit.gather`). The extra memory
each rank needs while publishing is measured (`PublishMemory`).
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Self

import msgspec

from orchestrator.config.run import TransportConfig
from transports.rss import reset_hwm, status_bytes


def weights_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "weights"


class PublishMemory(msgspec.Struct, frozen=True):
    """One rank's resident memory during one publish. `extra_bytes`: the peak over the publish
    minus the resident size just before it, less pages of mapped files (code run for the first
    time) (`_Window`), after freed heap was handed back to the system so that it cannot hide
    new allocations. `bound_bytes`: two buckets (the
    arenas, allocated at the first publish and kept) plus the largest tensor."""

    rank: int
    extra_bytes: int
    bound_bytes: int
    # Counted, not sampled: the packing arenas this rank holds plus the most gathered tensor
    # bytes alive at once (`GatheredStateDict.peak_bytes`); what the bound is about, exactly.
    arena_bytes: int
    gathered_peak_bytes: int
    exact: bool  # the high-water mark could be reset (else sampled only)
    file_growth_bytes: int = 0  # pages of mapped files (code run for the first time), not in extra_bytes


class _Window:
    """Peak resident memory of this process over a `with` block, above its size at entry: the
    kernel's high-water mark reset at entry (exact, no thread) where /proc/self/clear_refs is
    writable, else a sampling thread (`transports.rss.RssSampler`, which may miss a short peak)."""

    def __enter__(self) -> Self:
        _trim_heap()
        self.exact = reset_hwm()
        self._sampler = None
        if not self.exact:
            from transports.rss import RssSampler

            self._sampler = RssSampler().__enter__()
        self.base = status_bytes("VmRSS")
        self.file0 = status_bytes("RssFile")
        return self

    def __exit__(self, *exc) -> None:
        if self._sampler is not None:
            self._sampler.__exit__(*exc)
            self.extra = max(0, self._sampler.peak - self.base)
        else:
            self.extra = status_bytes("VmHWM") - self.base
        # Pages of mapped files (library code run for the first time) count in the high-water
        # mark too, but they are code, not memory the publish holds: left out of `extra`.
        self.file_growth = max(0, status_bytes("RssFile") - self.file0)
        self.extra = max(0, self.extra - self.file_growth)


def _trim_heap() -> None:
    # glibc keeps freed memory (the checkpoint's gathered state dict, a previous publish's
    # buffers) resident for reuse; returning it first makes the measured extra an honest one.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Publisher:
    """One filesystem synchronizer over the model's state dict; `publish(v)` writes version v.
    `rank`/`world`: this trainer rank under torchrun (FSDP2: the state dict holds DTensors)."""

    def __init__(self, model, run_dir: str | os.PathLike, transport: TransportConfig, version: int, *,
                 bucket_bytes: int | None = None, rank: int = 0, world: int = 1,
                 dtype=None) -> None:
        """`dtype` (a torch.dtype): every floating tensor is published in it, cast while packed
        (a trainer holding bf16 for an fp32 engine); None: each tensor in its own dtype."""
        from transports.refit.plan import DEFAULT_BUCKET_BYTES, RefitPlan

        self.model = model
        self.rank, self.world = rank, world
        self.root = weights_root(run_dir)
        state = model.state_dict()
        # DTensors report their global shape: the plan is the unsharded model's on every rank.
        meta = {k: (tuple(v.shape), dtype if dtype is not None and v.dtype.is_floating_point else v.dtype)
                for k, v in state.items()}
        self.plan = RefitPlan.build(meta, None, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES, wire_dtype=None)
        self.largest_bytes = max((_numel(s) * d.itemsize for s, d in meta.values()), default=0)
        self.memory: PublishMemory | None = None
        self._gathers: list = []  # the GatheredStateDict of the publish under way
        self.sync = None
        if world > 1:
            from transports.refit.gather import connect

            # The first send and receive between two gloo ranks sets up buffers of its own:
            # done here, once, not inside the first publish.
            connect()
        if rank != 0:
            return  # the other ranks only send shards (publish()); rank 0 writes
        from transports.factory import create_weight_synchronizer

        state_dict = (lambda: model.state_dict()) if world == 1 else self._gathered
        self.sync = create_weight_synchronizer(
            state_dict=state_dict, engines=[], colocated=False, transport="filesystem",
            filesystem_root=self.root, keep_last=transport.keep_last, plan=self.plan,
            timeout_s=transport.timeout_s)
        self.sync.init_communicator()
        # The synchronizer numbers versions by counting mark_stale() calls from 0; ours are
        # optimizer steps, so a resumed trainer starts its counter at the step it resumed at.
        self.sync._version = version

    def _gathered(self):
        from transports.refit.gather import GatheredStateDict

        gathered = GatheredStateDict(self.model.state_dict(), self.plan)
        self._gathers.append(gathered)
        return gathered

    @property
    def plan_json(self) -> str:
        return self.plan.encode().decode()

    @property
    def bound_bytes(self) -> int:
        return 2 * self.plan.arena_bytes + self.largest_bytes

    def is_complete(self, version: int) -> bool:
        from transports.filesystem import COMPLETE, version_dir

        return (version_dir(self.root, version) / COMPLETE).exists()

    def published(self) -> list[int]:
        from transports.filesystem import published_versions

        return published_versions(self.root) if self.root.is_dir() else []

    def compare(self, version: int) -> tuple[int, float]:
        """The model's tensors against published `version`'s: (tensors compared, max |diff|)."""
        from transports.filesystem import version_dir

        return compare_with_files(self.model.state_dict(), sorted(version_dir(self.root, version).glob("*.safetensors")))

    def load(self, version: int) -> None:
        """Set the model's weights to published `version`'s, bit for bit (one process): after a
        replayed step whose weights came out otherwise, the trainer continues from the ones the
        engines served under that number (`restore`)."""
        from transports.filesystem import version_dir

        load_files_into(self.model.state_dict(), sorted(version_dir(self.root, version).glob("*.safetensors")),
                        f"published version {version}")

    def publish(self, version: int) -> float:
        """Write `version` (the weights now in the model); returns the seconds it took. Under
        torchrun every rank calls it (the gather is collective); `self.memory` then holds this
        rank's measured extra memory."""
        started = time.perf_counter()
        if self.world == 1:
            self._write(version)
            return time.perf_counter() - started
        with _Window() as window:
            if self.sync is not None:
                try:
                    self._write(version)
                    # The other ranks sent a shard of every DTensor in plan order: a publish
                    # that read fewer would leave sends pending, to be paired with the next
                    # publish's receives (another tensor's rows). Refused, not carried over.
                    if len(self._gathers) != 1 or not self._gathers[0].complete:
                        raise RuntimeError(f"publish of version {version}: the synchronizer read the sharded state "
                                           f"{len(self._gathers)} time(s), (gathered, scheduled) tensors "
                                           f"{[g.progress for g in self._gathers]}, instead of once and whole: the "
                                           "other ranks' pending shards would pair with the wrong tensors")
                    peak = self._gathers[0].peak_bytes
                finally:
                    self._gathers.clear()  # frees the last gathered tensor
            else:
                from transports.refit.gather import send_shards

                send_shards(self.model.state_dict(), self.plan)
                peak = 0  # a shard is sent from the parameter itself
        self.memory = PublishMemory(rank=self.rank, extra_bytes=window.extra, bound_bytes=self.bound_bytes,
                                    arena_bytes=2 * self.plan.arena_bytes if self.sync is not None else 0,
                                    gathered_peak_bytes=peak, exact=window.exact,
                                    file_growth_bytes=window.file_growth)
        return time.perf_counter() - started

    def _write(self, version: int) -> None:
        # With publish_every > 1, or when re-publishing the resumed step, the counter is behind
        # or at `version`: align it so that mark_stale() names exactly this step.
        self.sync._version = version - 1
        self.sync.mark_stale()
        sent = self.sync.sync_weights()
        if sent != version:
            raise RuntimeError(f"synchronizer published version {sent}, expected {version}")

    def close(self) -> None:
        if self.sync is not None:
            self.sync.shutdown()


def compare_with_files(own: dict, files) -> tuple[int, float]:
    """(how many of `own`'s tensors the safetensors `files` hold under the same name, the
    largest |difference| between them), one file tensor in memory at a time."""
    from safetensors import safe_open

    compared, worst = 0, 0.0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in own:
                    mine, theirs = own[name].detach(), f.get_tensor(name)
                    worst = max(worst, float((mine.double() - theirs.double()).abs().max()) if mine.numel() else 0.0)
                    compared += 1
    return compared, worst


def load_files_into(own: dict, files, what: str) -> None:
    """Copy the safetensors `files`' tensors into `own` (a state dict sharing the parameters'
    storage) by name, in each tensor's own dtype; every tensor of `own` must be among them
    (RuntimeError naming the first that is not)."""
    import torch
    from safetensors import safe_open

    written: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in own:
                        own[name].copy_(f.get_tensor(name).to(own[name].dtype))
                        written.add(name)
    missing = sorted(set(own) - written)
    if missing:
        raise RuntimeError(f"{what} lacks {len(missing)} of the model's tensors (first: {missing[0]})")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
