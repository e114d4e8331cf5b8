"""Checkpoints written in the background (`trainer.checkpoint_background`, on by default for
one trainer process): the next step starts while the last one's checkpoint reaches the disk.

A checkpoint is model + Adam state (three times the model's bytes) written and fsynced: seconds
a step on a CPU (3.4 s for the 69M `small` preset here), which a synchronous trainer spends
before it can publish. Here the step is made durable by its journal entry instead (its batch and
consumption, kilobytes: `step_journal`), written before the version is published, as
`checkpoint_every` > 1 does; then a **snapshot** (CPU copies of the weights, the optimizer state
and the torch generator, taken between steps so nothing moves under it) is handed to one writer
thread, which writes it through the same atomic path as a synchronous checkpoint
(`checkpoint.write_checkpoint`) and then removes the journal entries it covers.

So a crash at any point loses nothing: before the checkpoint is in place the journal holds every
step after the previous one, and `--resume` trains those again (`step_journal`: the same state
on the same machine and thread count; compared with the published version and logged). A
checkpoint due while the writer is still busy is skipped (the journal covers it; counted in the
step's metrics as `checkpoint_skipped`), so the trainer never waits for the disk. A failed write
fails the trainer at its next step, naming the checkpoint. Cost: one extra copy of the model and
optimizer state in host memory while a checkpoint is written.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import msgspec
import torch

from orchestrator.trainer import checkpoint, lora, step_journal
from orchestrator.trainer.checkpoint import CheckpointError, CheckpointMeta


class Snapshot(NamedTuple):
    meta: CheckpointMeta
    model_state: dict[str, torch.Tensor]  # safetensors names (a tied head left out, as save_model does)
    optimizer_state: dict[str, Any]  # optimizer.state_dict(), every tensor copied
    torch_rng: torch.Tensor


def take(model, optimizer, meta: CheckpointMeta) -> Snapshot:
    """Copy what a checkpoint of `meta.step` holds, between steps (the copies are the writer's)."""
    adapter = lora.is_adapter(model)
    if adapter:
        state = lora.adapter_state(model)  # copies already
    else:
        state = {name: _copy(t) for name, t in model.state_dict().items() if not checkpoint.is_tied(model, name)}
    return Snapshot(meta=msgspec.structs.replace(meta, lora=adapter), model_state=state, optimizer_state=_copy_tree(optimizer.state_dict()),
                    torch_rng=torch.get_rng_state())


def write(run_dir: str | os.PathLike, snapshot: Snapshot, keep: int) -> float:
    """Write the snapshot's checkpoint atomically and durably, then drop the journal entries it
    covers; the seconds it took."""
    from safetensors.torch import save_file

    started = time.perf_counter()

    def write_state(tmp) -> None:
        save_file(snapshot.model_state, str(tmp / checkpoint.MODEL_FILE), metadata={"format": "pt"})
        torch.save({"optimizer": snapshot.optimizer_state, "torch_rng": snapshot.torch_rng},
                   tmp / checkpoint.OPTIMIZER_FILE)

    checkpoint.write_checkpoint(run_dir, snapshot.meta, keep, write_state)
    step_journal.prune(run_dir, snapshot.meta.step)
    return time.perf_counter() - started


class BackgroundWriter:
    """One writer thread, one checkpoint at a time. Used from the trainer's main thread only."""

    def __init__(self, run_dir: str | os.PathLike, keep: int) -> None:
        self.run_dir, self.keep = run_dir, keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: tuple[int, Future] | None = None  # (step, its write)

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending[1].done()

    def submit(self, snapshot: Snapshot) -> None:
        assert not self.busy, "one checkpoint at a time: collect() first"
        self._pending = (snapshot.meta.step, self._pool.submit(write, self.run_dir, snapshot, self.keep))

    def collect(self, timeout_s: float | None = 0.0) -> dict[str, float]:
        """The finished write's figures ({} if none finished within `timeout_s`; None waits);
        a failed write raises CheckpointError naming its step."""
        if self._pending is None:
            return {}
        step, future = self._pending
        try:
            seconds = future.result(timeout=timeout_s)
        except TimeoutError:
            return {}
        except Exception as exc:
            self._pending = None
            raise CheckpointError(f"the background checkpoint of step {step} failed: {type(exc).__name__}: {exc}") from exc
        self._pending = None
        return {"checkpoint_write_s": seconds, "checkpoint_written_step": float(step)}

    def close(self, timeout_s: float) -> None:
        """Let a write under way finish (bounded; a checkpoint cut short is a temporary
        directory that the journal makes up for), then stop the thread."""
        if self._pending is not None:
            try:
                self.collect(timeout_s)
            except CheckpointError:
                pass  # closing after a failure: the step that found it has already reported it
        self._pool.shutdown(wait=False, cancel_futures=True)


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if hasattr(tensor, "full_tensor"):  # a DTensor (never here: background checkpoints are one process's)
        tensor = tensor.full_tensor()
    return tensor.to("cpu", copy=True).contiguous()


def _copy_tree(value):
    if isinstance(value, torch.Tensor):
        return _copy(value)
    if isinstance(value, dict):
        return {k: _copy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_tree(v) for v in value)
    return value
