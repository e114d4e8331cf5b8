"""Training a LoRA adapter on the frozen base model (`[trainer.lora]`).

`wrap` puts PEFT's LoRA layers into the loaded transformers model: the base frozen, the
adapter's initial values drawn from `trainer.seed` alone. The optimizer then covers the adapter
only. Checkpoints and published versions hold the adapter alone, under PEFT's names
(`adapter_state`: what `PeftModel.save_pretrained` writes, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), with PEFT's config
(`adapter_config`); `load_adapter_state` puts them back, in one process or on every FSDP2 rank.

The training step needs nothing else: a PeftModel hands `get_decoder()`,
`get_output_embeddings()` and `config` on to the model it wraps, so `loss.completion_logprobs`
runs its chunked head path on it as on the bare model (the decoder it gets holds the LoRA
layers). Under FSDP2 the model is wrapped before it is sharded (`ranks.shard` finds the decoder
layers through the wrapper), and the adapter's DTensors are gathered whole to save them.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

import torch

from orchestrator.config.run import LoraConfig
from orchestrator.errors import ConfigError

# PEFT's name for the one adapter: it appears in the model's parameter names
# (`...q_proj.lora_A.default.weight`), never in the adapter files' (`...q_proj.lora_A.weight`).
ADAPTER = "default"
# Module types PEFT's LoRA can wrap: what a ConfigError about target_modules lists.
_WRAPPABLE = ("Linear", "Embedding", "Conv1D", "Conv1d", "Conv2d", "Conv3d")


def wrap(model: torch.nn.Module, lora: LoraConfig, seed: int) -> torch.nn.Module:
    """The PeftModel training a LoRA adapter (`lora`) on `model`, which is frozen. lora_A's
    initial values come from `seed` alone, whatever drew from the global generator before (and
    that generator is left as it was): a run is reproducible, and every FSDP2 rank starts from
    the same adapter (each keeps its shard of its own copy). A target module the model does not
    have is a ConfigError naming trainer.lora.target_modules."""
    import peft

    _check_targets(model, lora.target_modules)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules), bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            wrapped = peft.get_peft_model(model, config, adapter_name=ADAPTER)
        except ValueError as exc:  # e.g. a target that names a module type LoRA cannot wrap
            raise ConfigError("trainer.lora.target_modules", str(exc)) from None
    # The base stays in eval mode (no dropout of its own); LoRA's dropout, when configured, is
    # active in the training forwards, as PEFT trains it.
    wrapped.eval()
    _set_dropout(wrapped, active=True)
    _check_names(wrapped)
    return wrapped


def is_adapter(model: torch.nn.Module) -> bool:
    """Whether `model` trains a LoRA adapter (is a PeftModel, sharded or not)."""
    peft = sys.modules.get("peft")  # a model can only be a PeftModel once peft is imported
    return peft is not None and isinstance(model, peft.PeftModel)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PeftModel (the model itself otherwise)."""
    return model.get_base_model() if is_adapter(model) else model


def peft_name(name: str) -> str:
    """A model parameter's name as PEFT saves it: the adapter name taken out
    (`...lora_A.default.weight` -> `...lora_A.weight`, `...lora_embedding_A.default` ->
    `...lora_embedding_A`); PEFT's own rule, checked against PEFT at `wrap`."""
    parts = name.split(".")
    if parts[-1] == ADAPTER:
        return ".".join(parts[:-1])
    if len(parts) >= 2 and parts[-2] == ADAPTER:
        return ".".join(parts[:-2] + parts[-1:])
    return name


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """{PEFT name: parameter} of the adapter (the trainable parameters), in model order."""
    return {peft_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's names, whole, on the CPU (copies). Under FSDP2 every
    rank must call it: each DTensor is gathered (`full_tensor`, a collective) in name order,
    the same on every rank. The adapter is small, so each rank holds it whole for a moment."""
    out = {}
    for name, param in sorted(adapter_parameters(model).items()):
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name] = tensor.to("cpu", copy=True)
    return out


def adapter_config(model: torch.nn.Module) -> dict:
    """adapter_config.json as `PeftModel.save_pretrained` writes it: the adapter's PEFT config,
    inference_mode true, base_model_name_or_path the base model's directory, and (no task_type
    given) the auto_mapping of the base model's class. Plain JSON types only."""
    config = model.peft_config[ADAPTER].to_dict()
    base = base_model(model)
    if config.get("base_model_name_or_path") is None:
        config["base_model_name_or_path"] = getattr(base, "name_or_path", None) or None
    config["inference_mode"] = True
    # PEFT writes sets as lists (in set order); sorted lists say the same, reproducibly.
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    if config.get("task_type") is None:
        config["auto_mapping"] = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    return json.loads(json.dumps(config))  # enums (peft_type) as their strings


def load_adapter_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set the adapter's parameters to `tensors` (whole tensors under PEFT's names, as
    `adapter_state` gives). Under FSDP2 every rank passes the whole tensors and keeps its shard
    (no communication). ValueError names what does not fit."""
    params = adapter_parameters(model)
    missing, unexpected = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"adapter tensors do not fit the model's adapter (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    with torch.no_grad():
        for name, param in params.items():
            full = tensors[name]
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"adapter tensor {name!r}: shape {list(full.shape)}, the model's is "
                                 f"{list(param.shape)}")
            full = full.to(device=param.device, dtype=param.dtype)
            if hasattr(param, "device_mesh"):  # a DTensor: this rank's shard of the whole tensor
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)


def settle_logprob_path(model: torch.nn.Module) -> str:
    """Choose the model's logprob path (`loss.logprob_path`) now, with LoRA's dropout off: the
    choice compares two forwards, which random dropout masks would make disagree (and the path
    would fall back to the full forward for nothing). Under FSDP2 every rank calls it."""
    from orchestrator.trainer.loss import logprob_path

    with dropout_off(model):
        return logprob_path(model)


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module) -> Iterator[None]:
    """LoRA's dropout modules in eval mode within the block, back in training mode after."""
    _set_dropout(model, active=False)
    try:
        yield
    finally:
        _set_dropout(model, active=True)


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether the model's forwards are randomised by an active LoRA dropout (p > 0, training)."""
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict):
            if any(isinstance(d, torch.nn.Dropout) and d.p > 0 and d.training for d in dropouts.values()):
                return True
    return False


def _set_dropout(model: torch.nn.Module, active: bool) -> None:
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict):
            for dropout in dropouts.values():
                dropout.train(active)


def _check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Every target names a module, as PEFT matches a list (the module's name, or its last
    dotted parts); else a ConfigError naming the missing ones and what the model has."""
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        wrappable = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                            if n and type(m).__name__ in _WRAPPABLE})
        raise ConfigError("trainer.lora.target_modules",
                          f"{missing} name no module of {type(model).__name__}; the modules LoRA can wrap there "
                          f"are {wrappable}")


def _check_names(model: torch.nn.Module) -> None:
    """The adapter's names (`peft_name` of the trainable parameters) are PEFT's own: what
    `get_peft_model_state_dict` gives and `PeftModel.from_pretrained` loads."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: the embedding is never resized here, and "auto" would read
    # the base model's config again (or ask the Hub) to find out.
    theirs = set(get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False))
    ours = set(adapter_parameters(model))
    if ours != theirs:
        raise RuntimeError(f"the adapter's parameter names do not map onto PEFT's saved names (only ours "
                           f"{sorted(ours - theirs)[:3]}, only PEFT's {sorted(theirs - ours)[:3]}): a PEFT version "
                           "this trainer does not know")
