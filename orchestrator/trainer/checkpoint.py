"""Trainer checkpoints: RUN_DIR/trainer/step-00000012/{model.safetensors, optimizer.pt, meta.json}.

A checkpoint is written under `.tmp-step-...`, every file and the directory fsynced, then
renamed into place: a directory named `step-*` is complete. It is written BEFORE the step's
version is published, so a crash between the two is repaired on resume by re-publishing that
version from the checkpoint (the same weights): a version number never names two weight sets.

meta.json also holds the step's consumption (rollout ids, advantages, log-ratio statistics),
so an orchestrator that crashed after the trainer finished a step can still record it
(`latest(run_dir)`).

A LoRA run (`trainer.lora`, `orchestrator.trainer.lora`) checkpoints the adapter alone:
model.safetensors holds the adapter's tensors under PEFT's names, optimizer.pt the state of
the adapter's parameters (the only ones the optimizer has), meta.json `lora: true`. A
checkpoint of one kind is refused by a trainer of the other (`check_kind`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
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
    # New fields only here, with defaults: older meta.json files still read.
    lora: bool = False  # the model files hold a LoRA adapter alone (PEFT names), not the model


class CheckpointError(RuntimeError):
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


def check_kind(run_dir: str | os.PathLike, step: int, lora: bool) -> CheckpointMeta:
    """The meta of `step`'s checkpoint, which must be of the trainer's kind (`lora`: it trains
    a LoRA adapter); CheckpointError (a RuntimeError) says which kind is which otherwise."""
    meta = read_meta(run_dir, step)
    if meta.lora != lora:
        def kind(adapter: bool) -> str:
            return "a LoRA run (trainer.lora set)" if adapter else "a full-model run (trainer.lora unset)"

        raise CheckpointError(f"checkpoint {checkpoint_dir(run_dir, step)} was written by {kind(meta.lora)}, but "
                              f"this trainer is {kind(lora)}: resume with the configuration the run was started "
                              "with, or use a new run directory")
    return meta


def save(run_dir: str | os.PathLike, model, optimizer, meta: CheckpointMeta, keep: int) -> Path:
    """Write the checkpoint of meta.step atomically and durably; keep the newest `keep`. A LoRA
    model's checkpoint holds its adapter alone."""
    import torch
    from safetensors.torch import save_file, save_model

    from orchestrator.trainer import lora

    adapter = lora.is_adapter(model)

    def write_state(tmp: Path) -> None:
        if adapter:
            save_file(lora.adapter_state(model), str(tmp / MODEL_FILE), metadata={"format": "pt"})
        else:
            save_model(model, str(tmp / MODEL_FILE))
        torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, tmp / OPTIMIZER_FILE)

    # The kind is the model's, whatever the caller's meta said.
    return write_checkpoint(run_dir, msgspec.structs.replace(meta, lora=adapter), keep, write_state)


def write_checkpoint(run_dir: str | os.PathLike, meta: CheckpointMeta, keep: int,
                      write_state: Callable[[Path], None]) -> Path:
    """The one way a checkpoint reaches disk: `write_state(tmp)` writes the model and optimizer
    files into a temporary directory, the meta follows, every file and the directory are
    fsynced, and only then is it renamed into place (a crash leaves either no checkpoint of
    meta.step or a whole one); the newest `keep` are kept."""
    final = checkpoint_dir(run_dir, meta.step)
    if final.exists():
        # Only the checkpoint resumed from could be there, and that step is never redone.
        raise CheckpointError(f"checkpoint {final} already exists; refusing to replace the weights of a version")
    root = checkpoints_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_state(tmp)
    (tmp / META_FILE).write_bytes(msgspec.json.encode(meta))
    for name in (MODEL_FILE, OPTIMIZER_FILE, META_FILE):
        fsync_path(tmp / name)
    fsync_path(tmp)
    os.rename(tmp, final)
    fsync_path(root)
    _prune(run_dir, keep)
    return final


def load(run_dir: str | os.PathLike, step: int, model, optimizer) -> CheckpointMeta:
    """Restore model, optimizer and torch RNG from the checkpoint of `step` (written by a trainer
    of any world size)."""
    import torch
    from safetensors.torch import load_file, load_model

    from orchestrator.trainer import lora

    path = checkpoint_dir(run_dir, step)
    adapter = lora.is_adapter(model)
    meta = check_kind(run_dir, step, adapter)
    if adapter:
        _load_adapter(path, model, load_file(str(path / MODEL_FILE)))
    else:
        missing, unexpected = load_model(model, str(path / MODEL_FILE), strict=False)
        if unexpected or [m for m in missing if not is_tied(model, m)]:
            raise CheckpointError(f"checkpoint {path}: weights do not fit the model "
                                  f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    state = torch.load(path / OPTIMIZER_FILE, weights_only=True)
    # Written under torchrun: keyed by parameter name.
    optimizer.load_state_dict(_by_index(model, state[FQN_OPTIMIZER]) if FQN_OPTIMIZER in state else state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return meta


# -- under torchrun (FSDP2): the same files, gathered to rank 0 --------------------------------

# optimizer.pt key of the optimizer state keyed by parameter name (what a sharded optimizer's
# full state dict is); a single-process trainer's "optimizer" is keyed by parameter index.
FQN_OPTIMIZER = "optimizer_by_name"


def save_full(run_dir: str | os.PathLike, model, optimizer, meta: CheckpointMeta, keep: int, rank: int) -> Path | None:
    """`save` for an FSDP2 model: every rank calls it (the gather is collective); rank 0 gathers
    the full model and optimizer state (to CPU, the other ranks get nothing) and writes the same
    files as a single-process trainer, so a checkpoint resumes at any world size. Returns the
    directory on rank 0, None elsewhere."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from orchestrator.trainer import lora

    adapter = lora.is_adapter(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # A LoRA model's adapter alone, gathered whole on every rank (small; collective).
    model_state = lora.adapter_state(model) if adapter else get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if rank != 0:
        return None

    def write_state(tmp: Path) -> None:
        # save_model's convention: the second name of a shared tensor (tied lm_head) is left out.
        tensors = {k: v.contiguous() for k, v in model_state.items() if adapter or not is_tied(model, k)}
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        torch.save({FQN_OPTIMIZER: optim_state, "torch_rng": torch.get_rng_state()}, tmp / OPTIMIZER_FILE)

    return write_checkpoint(run_dir, msgspec.structs.replace(meta, lora=adapter), keep, write_state)


def load_full(run_dir: str | os.PathLike, step: int, model, optimizer, rank: int) -> CheckpointMeta:
    """`load` for an FSDP2 model: every rank calls it; rank 0 reads the files and the state is
    broadcast to the others, each keeping its shards (the run directory need not be shared).
    Reads checkpoints written at any world size."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from orchestrator.trainer import lora

    path = checkpoint_dir(run_dir, step)
    adapter = lora.is_adapter(model)
    meta = check_kind(run_dir, step, adapter) if rank == 0 else None
    model_state: dict = {}
    optim_state: dict = {}
    rng = [None]
    if rank == 0:
        model_state = load_file(str(path / MODEL_FILE))
        if not adapter:  # an adapter's names are checked where it is loaded (`_load_adapter`)
            _fit_model_state(path, model, model_state)
        state = torch.load(path / OPTIMIZER_FILE, weights_only=True)
        optim_state = state[FQN_OPTIMIZER] if FQN_OPTIMIZER in state else _by_name(model, state["optimizer"])
        rng = [state["torch_rng"]]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    if adapter:
        # The adapter is small: rank 0 sends it whole, each rank keeps its shards.
        box = [model_state]
        dist.broadcast_object_list(box, src=0)
        _load_adapter(path, model, box[0])
    else:
        set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)
    box = [meta, rng[0]]
    dist.broadcast_object_list(box, src=0)
    torch.set_rng_state(box[1])
    return box[0]


def _fit_model_state(path: Path, model, model_state: dict) -> None:
    """A full model's gathered state checked against the model, in place: a tied embedding
    stored under one of its two names gets the other too."""
    expected = set(model.state_dict())
    twins = _tied_twins(model)
    for name in expected - set(model_state):
        if twins.get(name) in model_state:
            # A tied embedding is stored under one of its two names: `save` (safetensors'
            # save_model) keeps the head's, `save_full` the input embedding's.
            model_state[name] = model_state[twins[name]]
    missing, unexpected = expected - set(model_state), set(model_state) - expected
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path}: weights do not fit the model "
                              f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")


def _load_adapter(path: Path, model, tensors: dict) -> None:
    """Every rank: the adapter's whole tensors into the model (each rank keeps its shards)."""
    from orchestrator.trainer import lora

    try:
        lora.load_adapter_state(model, tensors)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None


def _trainable_names(model) -> list[str]:
    """The names of the parameters the trainer's optimizer was built from, in its order: the
    trainable ones (all of them; a LoRA model's adapter only)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _by_name(model, state: dict) -> dict:
    """A single-process optimizer state (keyed by parameter index, in the order of the trainable
    parameters, which the trainer's optimizer was built from) keyed by parameter name instead."""
    names = _trainable_names(model)
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def is_tied(model, name: str) -> bool:
    # save_model drops the second name of a shared tensor; loading it back is fine.
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False)) and name.endswith("lm_head.weight")


def _tied_twins(model) -> dict[str, str]:
    """{input embedding weight name: output head weight name} and back, when the model ties them
    (found by module, so that it holds under FSDP2 too); {} otherwise."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {}
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return {}
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    if inp is None or out is None or id(inp) not in names or id(out) not in names:
        return {}
    a, b = f"{names[id(inp)]}.weight", f"{names[id(out)]}.weight"
    return {a: b, b: a}


def _prune(run_dir: str | os.PathLike, keep: int) -> None:
    for step in complete_steps(run_dir)[:-max(1, keep)]:
        shutil.rmtree(checkpoint_dir(run_dir, step), ignore_errors=True)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename or a new entry is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def _by_index(model, state: dict) -> dict:
    """The inverse of `_by_name`: what a single-process optimizer's load_state_dict takes."""
    index = {name: i for i, name in enumerate(_trainable_names(model))}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise CheckpointError(f"optimizer state for parameters the model does not have: {unknown[:3]}")
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}
