"""Reference computations for tests: a plain transformers forward of the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch


@lru_cache(maxsize=4)
def load_reference_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def reference_logprobs(model_or_dir, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
    """log p(completion_ids[i] | prompt, completion[:i]) under a transformers forward, fp32."""
    model = load_reference_model(str(model_or_dir)) if isinstance(model_or_dir, (str, bytes)) or hasattr(model_or_dir, "__fspath__") else model_or_dir
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.long)
    logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    n_prompt = len(prompt_ids)
    positions = torch.arange(n_prompt - 1, n_prompt - 1 + len(completion_ids))
    targets = torch.tensor(list(completion_ids), dtype=torch.long)
    return logprobs[positions, targets].tolist()
