"""Which weights each published version names: RUN_DIR/trainer/published.jsonl, one JSON line per
version, `{"version": 7, "digest": "…", "tensors": 120, "at": 1766000000.0}`, appended (and
fsynced) by the trainer right after the version is published.

The digest is the weights' own, in checkpoint form (`state_digest`: every tensor's name, dtype,
shape and crc32c of its bytes, a tied output head left out as a checkpoint leaves it; a LoRA
run's adapter alone), so that a checkpoint's model.safetensors is checked against it without
loading a model (`file_digest`): `inflight export-model` says whether the weights it exports
are the ones published under their version. The ledger outlives `transport.keep_last`, which
prunes the published files.

A version is recorded once. Recording it again with another digest is refused
(`CheckpointError`): a version number never names two sets of weights. A torn last line (the
crash hit the write) is ignored; the version is recorded again by the resumed trainer, whose
weights are then the published ones (`restore`). One trainer process only: under torchrun the
weights are sharded and no ledger is written (the export then cannot tell, and says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from orchestrator.trainer.checkpoint import CheckpointError, checkpoints_root, fsync_path

LEDGER = "published.jsonl"


def ledger_path(run_dir: str | os.PathLike) -> Path:
    return checkpoints_root(run_dir) / LEDGER


def state_digest(tensors: Mapping[str, object]) -> str:
    """sha256 over every tensor's name, dtype, shape and crc32c of its bytes, in name order."""
    import torch

    from transports.wire import checksum

    h = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
        h.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}|{checksum(raw)}\n".encode())
    return h.hexdigest()


def model_digest(model) -> tuple[str, int]:
    """The digest of the model's weights as its checkpoint holds them, and how many tensors."""
    from orchestrator.trainer import checkpoint, lora

    if lora.is_adapter(model):
        state = lora.adapter_state(model)
    else:
        state = {n: t for n, t in model.state_dict().items() if not checkpoint.is_tied(model, n)}
    return state_digest(state), len(state)


def file_digest(path: str | os.PathLike) -> tuple[str, int]:
    """The digest of a safetensors file's tensors (a checkpoint's model.safetensors)."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    return state_digest(state), len(state)


def read(run_dir: str | os.PathLike) -> dict[int, str]:
    """{version: digest} of every complete line."""
    path = ledger_path(run_dir)
    if not path.is_file():
        return {}
    out: dict[int, str] = {}
    for line in path.read_bytes().split(b"\n"):
        try:
            entry = json.loads(line)
            out[int(entry["version"])] = str(entry["digest"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line, or an empty one
    return out


def check(run_dir: str | os.PathLike, version: int, digest: str) -> bool:
    """Whether the ledger records `version` already (with `digest`); CheckpointError, naming
    both, when it records it with another."""
    known = read(run_dir).get(version)
    if known is not None and known != digest:
        raise CheckpointError(f"version {version} was published with weights {known[:16]}, and is now being "
                              f"published with weights {digest[:16]} ({ledger_path(run_dir)}): a version number never "
                              "names two sets of weights")
    return known is not None


def record(run_dir: str | os.PathLike, version: int, digest: str, tensors: int) -> bool:
    """Record that `version` names the weights of `digest`; False when it already did. A
    version recorded with another digest is refused, naming both (`check`)."""
    if check(run_dir, version, digest):
        return False
    path = ledger_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"version": version, "digest": digest, "tensors": tensors, "at": time.time()}) + "\n"
    if path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        line = "\n" + line  # after a torn line: never glued onto it
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = memoryview(line.encode())
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent)
    return True
