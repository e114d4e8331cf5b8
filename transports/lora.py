"""Reading checkpoints inside an engine worker: every safetensors file of a directory, and a
PEFT-format LoRA adapter merged into base weights (W + (alpha / r) * B @ A), staged like any
version. Light imports only (torch, safetensors)."""

from __future__ import annotations

import glob
import json
import os

import torch


def load_safetensors_dir(path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` file in `path` (sorted by file name); floating
    tensors cast to `dtype` when given."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(os.fspath(path), "*.safetensors"))):
        for name, tensor in load_file(file).items():
            weights[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    return weights


def merge_lora(base_dir: str, lora_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Base weights (every safetensors file of `base_dir`) with a PEFT-format adapter
    (`adapter_config.json` r / lora_alpha, `adapter_model.safetensors` lora_A / lora_B) merged:
    W + (alpha / r) * B @ A. Staged like any version, so the adapter lands beside the serving
    copy and is swapped in by a flip between two engine steps."""
    from safetensors.torch import load_file

    base = load_safetensors_dir(base_dir)
    with open(os.path.join(lora_dir, "adapter_config.json")) as f:
        config = json.load(f)
    scale = float(config["lora_alpha"]) / float(config["r"])
    adapter = load_file(os.path.join(lora_dir, "adapter_model.safetensors"))
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        module = key.split(".lora_A.")[0]
        if module.startswith("base_model.model."):
            module = module[len("base_model.model."):]
        name = module + ".weight"
        if name not in base:
            raise KeyError(f"adapter targets {name}, which the base model does not have")
        base[name] = base[name].float() + scale * (b.float() @ a.float())
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in base.items()}
