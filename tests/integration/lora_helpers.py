"""LoRA adapters for the engine tests: PEFT adapters on the tiny model, published as a LoRA
run's trainer publishes them (RUN_DIR/weights/vNNNNNNNN/ + COMPLETE), and the transformers
forward of base + adapter that every sampled logprob is checked against."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

TARGETS = ("q_proj", "v_proj")


@functools.lru_cache(maxsize=4)
def _base(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir: str | Path, root: Path, version: int, *, seed: int, rank: int = 8,
                 alpha: float = 16.0, scale: float = 0.2) -> Path:
    """A random adapter (lora_B non-zero, so it changes outputs) published as `version`."""
    import copy

    from peft import LoraConfig, get_peft_model

    from transports.adapters import write_adapter

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(_base(str(model_dir))),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TARGETS), bias="none"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, scale)
    from peft import get_peft_model_state_dict

    tensors = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    config = model.peft_config["default"].to_dict()
    config["base_model_name_or_path"] = str(model_dir)
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    return write_adapter(root, version, tensors, config, keep_last=1000)


@functools.lru_cache(maxsize=32)
def adapted_model(model_dir: str, adapter_dir: str):
    import copy

    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(_base(model_dir)), adapter_dir).eval()


@torch.no_grad()
def reference_logprobs(model_dir: str | Path, adapter_dir: str | Path | None, prompt, completion) -> list[float]:
    """log p(completion | prompt) under base (+ adapter), one plain fp32 forward."""
    model = _base(str(model_dir)) if adapter_dir is None else adapted_model(str(model_dir), str(adapter_dir))
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(list(completion))[:, None])[:, 0].tolist()
