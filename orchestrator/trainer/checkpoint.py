"""Trainer checkpoints: RUN_DIR/trainer/step-00000012/{model.safetensors, optimizer.pt, meta.json}.

A checkpoint is written under `.tmp-step-...`, every file and the directory fsynced, then
renamed into place: a directory named `step-*` is complete. It is written BEFORE the step's
version is published, so a crash between the two is repaired on resume by re-publishing that
version from the checkpoint (the same weights): a version number never names two weight sets.

meta.json also holds the step's consumption (rollout ids, advantages, log-ratio statistics),
so an orchestrator that crashed after the trainer finished a step can still record it
(`latest(run_dir)`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "meta.json"


class Consumption(msgspec.Struct, frozen=True):
    """What step `step` trained on; lists aligned with rollout_ids. None: unknown (a rollout
    without completion tokens has no log-ratio)."""

    rollout_ids: list[int]
    advantages: list[float]
    log_ratio_mean: list[float | None]
    log_ratio_max_abs: list[float | None]
    reward_mean: float
    loss: float
    metrics: dict[str, float]


class CheckpointMeta(msgspec.Struct, frozen=True):
    step: int
    version: int  # the version these weights are published as (== step)
    consumption: Consumption
    created_unix: float


class CheckpointError(Exception):
    pass


def checkpoints_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "trainer"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step-{step:08d}"


def complete_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint, oldest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    steps = []
    for path in root.glob("step-*"):
        digits = path.name.removeprefix("step-")
        if digits.isdigit() and (path / META_FILE).is_file():
            steps.append(int(digits))
    return sorted(steps)


def read_meta(run_dir: str | os.PathLike, step: int) -> CheckpointMeta:
    path = checkpoint_dir(run_dir, step) / META_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=CheckpointMeta)
    except (OSError, msgspec.DecodeError) as exc:
        raise CheckpointError(f"checkpoint {path.parent}: unreadable {META_FILE}: {exc}") from None


def latest(run_dir: str | os.PathLike) -> CheckpointMeta | None:
    """The newest complete checkpoint's meta (step, version, consumption), or None."""
    steps = complete_steps(run_dir)
    return read_meta(run_dir, steps[-1]) if steps else None


def save(run_dir: str | os.PathLike, model, optimizer, meta: CheckpointMeta, keep: int) -> Path:
    """Write the checkpoint of meta.step atomically and durably; keep the newest `keep`."""
    import torch
    from safetensors.torch import save_model

    final = checkpoint_dir(run_dir, meta.step)
    if final.exists():
        # Only the checkpoint resumed from could be there, and that step is never redone.
        raise CheckpointError(f"checkpoint {final} already exists; refusing to replace the weights of a version")
    root = checkpoints_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, str(tmp / MODEL_FILE))
    torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, tmp / OPTIMIZER_FILE)
    (tmp / META_FILE).write_bytes(msgspec.json.encode(meta))
    for name in (MODEL_FILE, OPTIMIZER_FILE, META_FILE):
        _fsync(tmp / name)
    _fsync(tmp)
    os.rename(tmp, final)
    _fsync(root)
    _prune(run_dir, keep)
    return final


def load(run_dir: str | os.PathLike, step: int, model, optimizer) -> CheckpointMeta:
    """Restore model, optimizer and torch RNG from the checkpoint of `step`."""
    import torch
    from safetensors.torch import load_model

    path = checkpoint_dir(run_dir, step)
    meta = read_meta(run_dir, step)
    missing, unexpected = load_model(model, str(path / MODEL_FILE), strict=False)
    if unexpected or [m for m in missing if not _tied(model, m)]:
        raise CheckpointError(f"checkpoint {path}: weights do not fit the model "
                              f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    state = torch.load(path / OPTIMIZER_FILE, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return meta


def _tied(model, name: str) -> bool:
    # save_model drops the second name of a shared tensor; loading it back is fine.
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False)) and name.endswith("lm_head.weight")


def _prune(run_dir: str | os.PathLike, keep: int) -> None:
    for step in complete_steps(run_dir)[:-max(1, keep)]:
        shutil.rmtree(checkpoint_dir(run_dir, step), ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def consumption_of(run_dir: str | os.PathLike, step: int):
    """The trainer's own account of step `step` as the StepDone it sent (or would have sent),
    from its checkpoint; None when no checkpoint of that step is kept. The orchestrator uses it
    on --resume for a step that finished after the orchestrator died."""
    import numpy as np

    from orchestrator.trainer.link import StepDone

    if step not in complete_steps(run_dir):
        return None
    meta = read_meta(run_dir, step)
    c = meta.consumption

    def f32(values) -> bytes:
        return np.asarray([np.nan if v is None else v for v in values], dtype="<f4").tobytes()

    return StepDone(step=meta.step, version=meta.version, loss=c.loss, reward_mean=c.reward_mean,
                    metrics=dict(c.metrics), seconds=0.0, rollout_ids=list(c.rollout_ids),
                    advantages=f32(c.advantages), log_ratio_mean=f32(c.log_ratio_mean),
                    log_ratio_max_abs=f32(c.log_ratio_max_abs))
