"""LoRA adapter versions: a PEFT adapter directory (`adapter_config.json` +
`adapter_model.safetensors`, as `PeftModel.save_pretrained` writes it) merged into base weights.

The merge is the one the engines serve: W + (lora_alpha / r) * B @ A, computed in fp32 and cast
to the weight's dtype (plain LoRA; an adapter whose config asks for rsLoRA, DoRA or per-module
ranks/alphas is refused, naming the key, rather than merged into weights no engine served).
Everything is checked before any weight is written, so a refused adapter leaves the weights as
they were. Light imports only (torch, safetensors); nothing here imports `orchestrator/` or
`transports/` (whose `transports.lora.merge_lora` is the engines' copy of the same formula).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from replay.errors import AdapterError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel adds before the base model's module names
_A, _B = ".lora_A.weight", ".lora_B.weight"
# Config keys that change the formula above; a true (or non-empty) value is refused.
_UNSERVED = {"use_rslora": "rsLoRA scales by alpha / sqrt(r)", "use_dora": "DoRA rescales each column",
             "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas"}


@dataclass(frozen=True)
class LoraPair:
    a_name: str  # the tensor names as stored, for errors
    b_name: str
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]


@dataclass(frozen=True)
class Adapter:
    """A parsed adapter: `pairs` maps each base weight name (Hugging Face) to its A and B."""

    source: str  # the file its tensors were read from
    rank: int
    scale: float  # lora_alpha / r
    fan_in_fan_out: bool  # PEFT's flag for Conv1D layers (GPT-2): the base stores W transposed
    pairs: dict[str, LoraPair]


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """A directory that holds an adapter config (a LoRA version, not full weights)."""
    return Path(path, ADAPTER_CONFIG).is_file()


def has_adapter_tensors(names: Iterable[str]) -> bool:
    """Tensor names that are a LoRA adapter's (a LoRA run's trainer checkpoint)."""
    return any(".lora_A." in name or ".lora_B." in name for name in names)


def read_config(path: str | os.PathLike[str]) -> dict:
    """adapter_config.json as a dict; AdapterError naming the file when it is unreadable."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(os.fspath(path), f"unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(os.fspath(path), "not a JSON object")
    return config


def check_config(config: Mapping, where: str) -> tuple[int, float]:
    """(r, lora_alpha / r) of a plain LoRA config; AdapterError naming the key otherwise."""
    for key, meaning in _UNSERVED.items():
        if config.get(key):
            raise AdapterError(where, f"is {json.dumps(config[key])}: {meaning}, which the engines do not compute "
                                      "(they serve W + (lora_alpha / r) * B @ A)", key=key)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(where, f"must be a positive integer, got {rank!r}", key="r")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise AdapterError(where, f"must be a number, got {alpha!r}", key="lora_alpha")
    return rank, float(alpha) / rank


def read_adapter(directory: str | os.PathLike[str]) -> Adapter:
    """The adapter in a PEFT adapter directory; AdapterError naming the file and tensor when it
    is unreadable or malformed."""
    from safetensors.torch import load_file

    root = Path(directory)
    config = read_config(root / ADAPTER_CONFIG)
    weights = root / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterError(os.fspath(weights), "not found (an adapter version holds its tensors there)")
    try:
        tensors = load_file(os.fspath(weights))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own and OS errors
        raise AdapterError(os.fspath(weights), f"unreadable: {exc}") from None
    return adapter_from_tensors(tensors, config, os.fspath(weights), os.fspath(root / ADAPTER_CONFIG))


def adapter_from_tensors(tensors: Mapping[str, torch.Tensor], config: Mapping, source: str,
                         config_source: str | None = None) -> Adapter:
    """An adapter from PEFT-named tensors (`get_peft_model_state_dict`) and its config.
    `source` names the tensors' file in errors, `config_source` the config's."""
    rank, scale = check_config(config, config_source or source)
    pairs: dict[str, LoraPair] = {}
    for name in tensors:
        if name.endswith(_B) and name[:-len(_B)] + _A not in tensors:
            raise AdapterError(source, "has no lora_A beside it", tensor=name)
        if name.endswith(_B):
            continue
        if not name.endswith(_A):
            raise AdapterError(source, "is not a lora_A/lora_B weight: only plain LoRA weights are merged "
                                       "(no modules_to_save, biases or embedding adapters)", tensor=name)
        module = name[:-len(_A)]
        b_name = module + _B
        if b_name not in tensors:
            raise AdapterError(source, "has no lora_B beside it", tensor=name)
        pair = LoraPair(name, b_name, tensors[name], tensors[b_name])
        _check_pair(pair, rank, source)
        pairs[base_weight_name(module)] = pair
    if not pairs:
        raise AdapterError(source, "holds no lora_A/lora_B tensors")
    return Adapter(source=source, rank=rank, scale=scale, fan_in_fan_out=bool(config.get("fan_in_fan_out")),
                   pairs=pairs)


def base_weight_name(module: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj` -> `model.layers.0.self_attn.q_proj.weight`."""
    return module.removeprefix(PEFT_PREFIX) + ".weight"


def _check_pair(pair: LoraPair, rank: int, source: str) -> None:
    if pair.a.dim() != 2 or pair.a.shape[0] != rank:
        raise AdapterError(source, f"shape {tuple(pair.a.shape)} is not [r={rank}, in]", tensor=pair.a_name)
    if pair.b.dim() != 2 or pair.b.shape[1] != rank:
        raise AdapterError(source, f"shape {tuple(pair.b.shape)} is not [out, r={rank}]", tensor=pair.b_name)


def _delta_shape(pair: LoraPair, fan_in_fan_out: bool) -> tuple[int, int]:
    out_in = (pair.b.shape[0], pair.a.shape[1])
    return (out_in[1], out_in[0]) if fan_in_fan_out else out_in


def check_fits(adapter: Adapter, shapes: Mapping[str, Iterable[int]]) -> None:
    """Every target is a weight of the base (`shapes`: name -> shape) of B @ A's shape."""
    for name, pair in adapter.pairs.items():
        if name not in shapes:
            raise AdapterError(adapter.source, f"targets {name}, which the base model does not have",
                               tensor=pair.a_name)
        want = tuple(shapes[name])
        if _delta_shape(pair, adapter.fan_in_fan_out) != want:
            raise AdapterError(adapter.source, f"B @ A has shape {_delta_shape(pair, adapter.fan_in_fan_out)}, "
                                               f"the base's {name} is {want}", tensor=pair.a_name)


@torch.no_grad()
def merge_into(weights: Mapping[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """Merge `adapter` into `weights` in place (a model's `state_dict()`, whose tensors share the
    parameters' storage, or a plain dict of tensors). Returns a copy of every weight it changed,
    as it was, for `restore`. Checked first: a refused adapter changes nothing."""
    check_fits(adapter, {name: tuple(t.shape) for name, t in weights.items()})
    originals: dict[str, torch.Tensor] = {}
    for name, pair in adapter.pairs.items():
        weight = weights[name]
        delta = pair.b.to(weight.device, torch.float32) @ pair.a.to(weight.device, torch.float32)
        if adapter.fan_in_fan_out:
            delta = delta.T
        originals[name] = weight.detach().clone()
        weight.copy_((weight.float() + adapter.scale * delta).to(weight.dtype))
    return originals


@torch.no_grad()
def restore(weights: Mapping[str, torch.Tensor], originals: Mapping[str, torch.Tensor]) -> None:
    """Undo `merge_into`: every weight it changed back to its value before (bit for bit)."""
    for name, tensor in originals.items():
        weights[name].copy_(tensor)
