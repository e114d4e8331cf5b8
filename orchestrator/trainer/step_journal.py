"""The steps since the last checkpoint (`trainer.checkpoint_every` > 1, or background
checkpoints: `checkpoint_background`): RUN_DIR/trainer/journal/step-00000013.msgpack, one file
per step.

A full checkpoint (model + optimizer: three times the model's size) every step is seconds of the
critical path on a CPU; a step's batch is a few kilobytes to megabytes. So between checkpoints
each step's batch and the trainer's account of it (the consumption a checkpoint's meta.json
would hold) are written instead, durably (temporary file, fsync, rename, fsync of the
directory), after the step and before its version is published, the same place in the order a
checkpoint takes. A step is done, as far as a crash goes, once it is checkpointed or journaled.

`--resume` restores the newest checkpoint and trains the journaled steps after it again, in
order, on the batches they trained on: one process's step is pure compute on its batch, the
checkpoint restores the model, the optimizer and the torch generator, so the steps come out
the same on the same machine and thread count (the re-derived weights are compared with the
published version where it is retained, and the result is logged: `trainer.replayed`). The
journal up to a checkpoint's step is removed once that checkpoint is in place.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from orchestrator.trainer.checkpoint import CheckpointError, CheckpointMeta, checkpoints_root, fsync_path
from orchestrator.trainer.link import Batch

JOURNAL_DIR = "journal"


class JournaledStep(msgspec.Struct, frozen=True):
    batch: Batch
    meta: CheckpointMeta  # what the step's checkpoint would have said (its consumption)
    published: bool  # its version is published after the entry (trainer.publish_every)


def journal_dir(run_dir: str | os.PathLike) -> Path:
    return checkpoints_root(run_dir) / JOURNAL_DIR


def step_path(run_dir: str | os.PathLike, step: int) -> Path:
    return journal_dir(run_dir) / f"step-{step:08d}.msgpack"


def journaled_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps with a complete journal entry, oldest first (a temporary file is not one)."""
    root = journal_dir(run_dir)
    if not root.is_dir():
        return []
    steps = []
    for path in root.glob("step-*.msgpack"):
        digits = path.name.removeprefix("step-").removesuffix(".msgpack")
        if digits.isdigit():
            steps.append(int(digits))
    return sorted(steps)


def write(run_dir: str | os.PathLike, batch: Batch, meta: CheckpointMeta, published: bool) -> Path:
    """Journal step meta.step (its batch and consumption), atomically and durably."""
    root = journal_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = step_path(run_dir, meta.step)
    tmp = root / f".tmp-{final.name}"
    with open(tmp, "wb") as f:
        f.write(msgspec.msgpack.encode(JournaledStep(batch=batch, meta=meta, published=published)))
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    fsync_path(root)
    return final


def read(run_dir: str | os.PathLike, step: int) -> JournaledStep:
    path = step_path(run_dir, step)
    try:
        entry = msgspec.msgpack.decode(path.read_bytes(), type=JournaledStep)
    except (OSError, msgspec.DecodeError) as exc:
        raise CheckpointError(f"journal entry {path}: unreadable: {exc}") from None
    if entry.meta.step != step or entry.batch.step != step:
        raise CheckpointError(f"journal entry {path} holds step {entry.meta.step} (batch {entry.batch.step}), "
                              f"not {step}")
    return entry


def prune(run_dir: str | os.PathLike, upto: int) -> None:
    """Remove the entries of steps <= upto (a checkpoint holds them now)."""
    for step in journaled_steps(run_dir):
        if step <= upto:
            step_path(run_dir, step).unlink(missing_ok=True)


def to_replay(run_dir: str | os.PathLike, checkpoint_step: int) -> list[int]:
    """The journaled steps after `checkpoint_step`, which must follow it without a gap."""
    steps = [s for s in journaled_steps(run_dir) if s > checkpoint_step]
    expected = list(range(checkpoint_step + 1, checkpoint_step + 1 + len(steps)))
    if steps != expected:
        missing = sorted(set(range(checkpoint_step + 1, max(steps) + 1)) - set(steps))
        raise CheckpointError(f"{journal_dir(run_dir)} holds steps {steps[0]}..{steps[-1]} after the checkpoint of "
                              f"step {checkpoint_step}, but not step {missing[0]}: the steps cannot be trained again")
    return steps


def consumption_of(run_dir: str | os.PathLike, step: int):
    """The trainer's own account of step `step` as the StepDone it sent (or would have sent),
    from its checkpoint or its journal entry; None when neither is kept. The orchestrator uses
    it on --resume for a step that finished after the orchestrator died, and for a batch the
    trainer held when it was lost."""
    import numpy as np

    from orchestrator.trainer.checkpoint import complete_steps, read_meta
    from orchestrator.trainer.link import StepDone

    if step in complete_steps(run_dir):
        meta = read_meta(run_dir, step)
        version = meta.version
    elif step in journaled_steps(run_dir):
        entry = read(run_dir, step)
        meta, version = entry.meta, (entry.meta.version if entry.published else None)
    else:
        return None
    c = meta.consumption

    def f32(values) -> bytes:
        return np.asarray([np.nan if v is None else v for v in values], dtype="<f4").tobytes()

    return StepDone(step=meta.step, version=version, loss=c.loss, reward_mean=c.reward_mean,
                    metrics=dict(c.metrics), seconds=0.0, rollout_ids=list(c.rollout_ids),
                    advantages=f32(c.advantages), log_ratio_mean=f32(c.log_ratio_mean),
                    log_ratio_max_abs=f32(c.log_ratio_max_abs))
