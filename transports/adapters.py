"""Published LoRA adapters: each version one PEFT adapter directory, written atomically, and a
reader that validates one before an engine loads it.

Layout under `root` (RUN_DIR/weights):

    v00000012/                      a published version (atomic rename of the temporary dir)
        adapter_model.safetensors   the adapter's tensors in PEFT's names, e.g.
                                    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
        adapter_config.json         PEFT's LoraConfig (r, lora_alpha, target_modules, ...)
        COMPLETE                    written last, after every file and the directory are fsynced
    .tmp-v00000013/                 the version being written

The two adapter files are what `PeftModel.save_pretrained` writes, so vLLM's
`LoRARequest(name, int_id, path)` and `peft.PeftModel.from_pretrained(base, path)` load a
version directory as it is. Only the newest `keep_last` versions are kept.

Light imports only (torch, safetensors, msgspec): an engine worker may import this module.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch

from transports.errors import AdapterError

ADAPTER_MODEL = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
COMPLETE = "COMPLETE"
# adapter_config.json keys without which no reader can apply the adapter.
REQUIRED_CONFIG = ("r", "lora_alpha", "target_modules")


def adapter_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def partial_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f".tmp-v{version:08d}"


def published_adapters(root: str | os.PathLike) -> list[int]:
    """Complete versions under `root` (those with COMPLETE), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for path in root.glob("v*"):
        if path.name[1:].isdigit() and path.is_dir() and (path / COMPLETE).exists():
            out.append(int(path.name[1:]))
    return sorted(out)


def write_adapter(root: str | os.PathLike, version: int, tensors: dict[str, torch.Tensor],
                  adapter_config: dict, keep_last: int) -> Path:
    """Publish `version`: the tensors and config are checked as `check_adapter` would check them
    (an adapter no reader would accept is never published), written under `.tmp-vNNNNNNNN`,
    every file and the directory fsynced, renamed into place, then COMPLETE written and fsynced.
    Older versions beyond the newest `keep_last` are removed. Returns the version's directory."""
    from safetensors.torch import save_file

    root = Path(root)
    final = adapter_dir(root, version)
    if (final / COMPLETE).exists():
        # A version number never names two weight sets: a complete one is never replaced.
        raise FileExistsError(f"{final} is already published (it has {COMPLETE}); refusing to replace it")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    _check_config(final / ADAPTER_CONFIG, adapter_config)
    _check_tensors(final / ADAPTER_MODEL, tensors, adapter_config)
    root.mkdir(parents=True, exist_ok=True)
    # Left by an attempt that crashed between the rename and COMPLETE: never complete, so no
    # reader trusts it; this attempt replaces it.
    shutil.rmtree(final, ignore_errors=True)
    tmp = partial_dir(root, version)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(tensors, str(tmp / ADAPTER_MODEL), metadata={"format": "pt"})  # PEFT's own metadata
    # PEFT writes its config with these settings (PeftConfig.save_pretrained).
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
    for name in (ADAPTER_MODEL, ADAPTER_CONFIG):
        _fsync(tmp / name)
    _fsync(tmp)
    os.rename(tmp, final)  # atomic: a reader sees the whole directory or none of it
    _fsync(root)
    fd = os.open(final / COMPLETE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync(final)  # the COMPLETE entry itself is durable once its directory is
    _prune(root, keep_last)
    return final


def check_adapter(path: str | os.PathLike, complete: bool = True) -> dict[str, Any]:
    """Read the adapter directory `path` and check it whole: both files present (and COMPLETE,
    unless `complete` is false: a directory `PeftModel.save_pretrained` wrote has none), the
    config JSON with r, lora_alpha and target_modules, the safetensors file parseable, every
    lora_A with its lora_B, shapes A [r, in] and B [out, r], every value finite. Raises
    AdapterError naming the file and the tensor (or the byte offset of a torn header).
    Returns {"rank", "alpha", "target_modules", "tensors", "bytes"}."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(str(path), "no such adapter directory")
    for name in (ADAPTER_CONFIG, ADAPTER_MODEL) + ((COMPLETE,) if complete else ()):
        if not (path / name).is_file():
            raise AdapterError(str(path / name), "missing" + (" (the version is not complete)" if name == COMPLETE
                                                             else ""))
    config = _read_config(path / ADAPTER_CONFIG)
    tensors = read_tensors(path / ADAPTER_MODEL)
    _check_tensors(path / ADAPTER_MODEL, tensors, config)
    return {"rank": config["r"], "alpha": config["lora_alpha"], "target_modules": config["target_modules"],
            "tensors": len(tensors), "bytes": (path / ADAPTER_MODEL).stat().st_size}


class _Entry(msgspec.Struct, frozen=True):
    """One tensor's entry in a safetensors header."""

    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, its header checked first so that a torn or corrupt
    file is reported with the byte offset (or the tensor) at fault."""
    from safetensors.torch import load

    data = file.read_bytes()
    if len(data) < 8:
        raise AdapterError(str(file), f"torn safetensors header: the file has {len(data)} bytes, the header "
                                      "length at byte offset 0 needs 8")
    size = int.from_bytes(data[:8], "little")
    if 8 + size > len(data):
        raise AdapterError(str(file), f"torn safetensors header: its length at byte offset 0 says {size} bytes "
                                      f"from byte offset 8, but the file ends at byte offset {len(data)}")
    try:
        header = msgspec.json.decode(data[8:8 + size])
    except msgspec.DecodeError as exc:
        raise AdapterError(str(file), f"the safetensors header (byte offsets 8 to {8 + size}) is not JSON: "
                                      f"{exc}") from None
    if not isinstance(header, dict):
        raise AdapterError(str(file), "the safetensors header at byte offset 8 is not a JSON object")
    body = len(data) - 8 - size
    for name, value in header.items():
        if name == "__metadata__":
            continue
        try:
            entry = msgspec.convert(value, _Entry)
        except msgspec.ValidationError as exc:
            raise AdapterError(str(file), f"bad header entry: {exc}", tensor=name) from None
        if entry.data_offsets[1] > body:
            raise AdapterError(str(file), f"its data ends at byte offset {8 + size + entry.data_offsets[1]}, past "
                                          f"the end of the file ({len(data)} bytes)", tensor=name)
    try:
        return load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types vary by version
        raise AdapterError(str(file), f"does not parse as safetensors: {exc}") from None


def _read_config(file: Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(str(file), f"not JSON: {exc}") from None
    _check_config(file, config)
    return config


def _check_config(file: Path, config: Any) -> None:
    if not isinstance(config, dict):
        raise AdapterError(str(file), f"not a JSON object (a {type(config).__name__})")
    for key in REQUIRED_CONFIG:
        if key not in config:
            raise AdapterError(str(file), f"no {key!r}: a reader cannot apply the adapter without it")
    r, alpha, targets = config["r"], config["lora_alpha"], config["target_modules"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(str(file), f"'r' must be an integer >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(str(file), f"'lora_alpha' must be a number, got {alpha!r}")
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise AdapterError(str(file), f"'target_modules' must be a list of module names or a pattern, got {targets!r}")


def lora_partner(name: str) -> tuple[str, str] | None:
    """("A" or "B", the name of its partner) for a LoRA tensor name (PEFT's lora_A / lora_B of
    a linear layer, lora_embedding_A / lora_embedding_B of an embedding); None for another."""
    if ".lora_A." in name:
        return "A", name.replace(".lora_A.", ".lora_B.")
    if ".lora_B." in name:
        return "B", name.replace(".lora_B.", ".lora_A.")
    if name.endswith(".lora_embedding_A"):
        return "A", name[:-1] + "B"
    if name.endswith(".lora_embedding_B"):
        return "B", name[:-1] + "A"
    return None


def _check_tensors(file: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Pairs, shapes against r, finite values; AdapterError names the tensor."""
    # With a rank_pattern some modules have another rank: then A and B need only agree.
    r = None if config.get("rank_pattern") else config["r"]
    pairs = 0
    for name in sorted(tensors):
        t = tensors[name]
        role = lora_partner(name)
        if role is not None:
            kind, partner = role
            if partner not in tensors:
                raise AdapterError(str(file), f"lora_{kind} without its lora_{'B' if kind == 'A' else 'A'} "
                                              f"({partner!r})", tensor=name)
            pairs += kind == "A"
            _check_shape(file, name, t, kind, tensors[partner], r)
        if not t.is_floating_point():
            if role is not None:
                raise AdapterError(str(file), f"dtype {t.dtype}: a LoRA factor must be floating point", tensor=name)
            continue
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise AdapterError(str(file), f"{bad} non-finite value(s) (NaN or inf) of {t.numel()}", tensor=name)
    if not pairs:
        raise AdapterError(str(file), f"no lora_A/lora_B tensors among its {len(tensors)}")


def _check_shape(file: Path, name: str, t: torch.Tensor, kind: str, partner: torch.Tensor, r: int | None) -> None:
    """A is [r, in], B is [out, r] (r: the config's; None: whatever the partner's is)."""
    want = "[r, in]" if kind == "A" else "[out, r]"
    if t.dim() != 2 or partner.dim() != 2:
        raise AdapterError(str(file), f"shape {list(t.shape)} with partner {list(partner.shape)}: lora_{kind} must "
                                      f"be {want}", tensor=name)
    rank = t.shape[0] if kind == "A" else t.shape[1]
    partner_rank = partner.shape[1] if kind == "A" else partner.shape[0]
    if r is not None:
        # Each factor against r: the one at fault is named (both agreeing with r agree together).
        if rank != r:
            raise AdapterError(str(file), f"shape {list(t.shape)} disagrees with r = {r} (lora_{kind} is {want})",
                               tensor=name)
    elif rank != partner_rank:
        raise AdapterError(str(file), f"shape {list(t.shape)} disagrees with its partner's {list(partner.shape)} "
                                      f"(lora_{kind} is {want})", tensor=name)


def _prune(root: Path, keep_last: int) -> None:
    for old in published_adapters(root)[:-max(1, keep_last)]:
        shutil.rmtree(adapter_dir(root, old), ignore_errors=True)


def _fsync(path: Path) -> None:
    """fsync a file or a directory (a rename or a new entry is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
