"""Recomputing the log-probability of sampled tokens with a plain transformers forward.

The one reference implementation of the project: `inflight replay` batches it over a whole log,
and the tests use the single-sequence forms (`sequence_logprobs`, `carried_logprobs`, `fed_logprobs`) as their
reference for what an engine should have produced.

Weights are plain safetensors: a Hugging Face model directory (version 0, or any MODEL_DIR) or a
retained version directory of the run (every `*.safetensors` file in it, merged; tensors named
by their Hugging Face names). Nothing here imports `transports/` or `orchestrator/`.

Batching: sequences are sorted by length and cut into batches of at most `token_budget` padded
tokens, right-padded. Right padding needs no attention mask under causal attention (a real
token only attends to earlier positions, all real), so the forward is the same call a plain
`model(input_ids)` makes. Only the positions that predict a completion token go through the
output projection (the vocabulary-sized matrix), fp32, divided by the sampling temperature when
the recorded logprobs are the processed (temperature-scaled) ones.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache

import numpy as np
import torch

DEFAULT_TOKEN_BUDGET = 16_384  # padded tokens per forward batch


def load_state_dir(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` file in a directory, merged (sorted by file name)."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(os.fspath(path), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def load_model(model_dir: str | os.PathLike[str], device: str | torch.device = "cpu") -> torch.nn.Module:
    """A transformers causal LM from a Hugging Face directory, fp32, in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep stderr for our own progress bar
    model = AutoModelForCausalLM.from_pretrained(os.fspath(model_dir), dtype=torch.float32)
    return model.to(device).eval()


@lru_cache(maxsize=4)
def cached_model(model_dir: str) -> torch.nn.Module:
    """`load_model` on the CPU, cached per directory (tests share one model per directory)."""
    return load_model(model_dir)


def apply_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load `state` (Hugging Face names) into `model` in place. Raises ValueError naming a tensor
    the model does not have or one whose shape differs; parameters `state` does not name (a tied
    output projection) keep their values."""
    own = model.state_dict()
    unexpected = [name for name in state if name not in own]
    if unexpected:
        raise ValueError(f"tensors the model does not have: {', '.join(sorted(unexpected)[:5])}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model's is {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor.to(own[name].dtype))


def _heads(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder body, output projection) when the model exposes them, else None."""
    body = getattr(model, "model", None) or getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if body is None or body is model or head is None:
        return None
    return body, head


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, ids: torch.Tensor, prompt_lengths: Sequence[int],
                   completion_lengths: Sequence[int], temperature: float = 1.0) -> list[torch.Tensor]:
    """One right-padded batch [B, L] of prompt + completion rows: for each row, the logprob of
    each completion token given everything before it (fp32, on the model's device)."""
    rows: list[int] = []
    positions: list[int] = []
    for b, (n_prompt, n_completion) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        rows.extend([b] * n_completion)
        positions.extend(range(n_prompt - 1, n_prompt - 1 + n_completion))
    device = ids.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    pos_index = torch.tensor(positions, dtype=torch.long, device=device)
    heads = _heads(model)
    if heads is not None:
        body, head = heads
        hidden = body(input_ids=ids).last_hidden_state
        logits = head(hidden[row_index, pos_index]).float()
    else:
        logits = model(input_ids=ids).logits[row_index, pos_index].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = ids[row_index, pos_index + 1]
    picked = logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    return list(torch.split(picked, list(completion_lengths)))


def plan_batches(lengths: Sequence[int], token_budget: int = DEFAULT_TOKEN_BUDGET) -> list[list[int]]:
    """Indices of sequences grouped into batches: sorted by length (longest first), each batch
    at most `token_budget` padded tokens (a longer sequence gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        new_width = max(width, lengths[i])
        if current and new_width * (len(current) + 1) > token_budget:
            batches.append(current)
            current, new_width = [], lengths[i]
        current.append(i)
        width = new_width
    if current:
        batches.append(current)
    return batches


def recompute_logprobs(model: torch.nn.Module, sequences: Sequence[tuple[np.ndarray, np.ndarray]],
                       *, temperatures: Sequence[float] | float = 1.0,
                       token_budget: int = DEFAULT_TOKEN_BUDGET, pad_id: int = 0,
                       on_tokens: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """The logprob of every completion token of every (prompt ids, completion ids) pair under
    `model` (float64 arrays, aligned with `sequences`). Sequences with different temperatures
    are batched apart; `on_tokens(n)` is called after each batch with its completion tokens."""
    out: list[np.ndarray | None] = [None] * len(sequences)
    if isinstance(temperatures, int | float):
        temperatures = [float(temperatures)] * len(sequences)
    device = next(model.parameters()).device
    by_temperature: dict[float, list[int]] = {}
    for i, (_, completion) in enumerate(sequences):
        if len(completion) == 0:
            out[i] = np.zeros(0, np.float64)
        else:
            by_temperature.setdefault(float(temperatures[i]), []).append(i)
    for temperature, members in by_temperature.items():
        lengths = [len(sequences[i][0]) + len(sequences[i][1]) for i in members]
        for batch in plan_batches(lengths, token_budget):
            indices = [members[j] for j in batch]
            width = max(lengths[j] for j in batch)
            ids = np.full((len(indices), width), pad_id, dtype=np.int64)
            for row, i in enumerate(indices):
                prompt, completion = sequences[i]
                ids[row, :len(prompt)] = prompt
                ids[row, len(prompt):len(prompt) + len(completion)] = completion
            tensor = torch.from_numpy(ids).to(device)
            results = batch_logprobs(model, tensor, [len(sequences[i][0]) for i in indices],
                                     [len(sequences[i][1]) for i in indices], temperature)
            for i, values in zip(indices, results, strict=True):
                out[i] = values.double().cpu().numpy()
            if on_tokens is not None:
                on_tokens(sum(len(sequences[i][1]) for i in indices))
    return out  # type: ignore[return-value]


# --- single-sequence references (the tests' ground truth) -------------------------------------


def _as_model(model_or_dir) -> torch.nn.Module:
    if isinstance(model_or_dir, str | bytes) or hasattr(model_or_dir, "__fspath__"):
        return cached_model(os.fspath(model_or_dir))
    return model_or_dir


@torch.no_grad()
def sequence_logprobs(model_or_dir, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                      temperature: float = 1.0) -> list[float]:
    """log p(completion_ids[i] | prompt, completion[:i]) under one plain full forward, fp32."""
    model = _as_model(model_or_dir)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.long, device=device)
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = torch.tensor(list(completion_ids), dtype=torch.long, device=device)
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0].tolist()


def carried_logprobs(models: Mapping[int, torch.nn.Module], prompt: Sequence[int],
                     tokens: Sequence[int], versions: Sequence[int]) -> list[float]:
    """Keys/values kept across a switch of weights: each position is fed (and its keys/values
    computed) under the version of the token it produces; prompt positions under that of
    token 0. `models[v]` is the model of version v."""
    n_prompt = len(prompt)
    feed = [versions[max(0, p - n_prompt + 1)] for p in range(n_prompt + len(tokens) - 1)]
    return fed_logprobs(models, prompt, tokens, feed)


@torch.no_grad()
def fed_logprobs(models: Mapping[int, torch.nn.Module], prompt: Sequence[int],
                 tokens: Sequence[int], feed: Sequence[int]) -> list[float]:
    """Logprobs of `tokens` when position p (of prompt + tokens, all but the last) was fed,
    and its keys/values computed, under `models[feed[p]]`: any mix a carried KV or a prefix
    cache can produce."""
    from transformers import DynamicCache

    seq = list(prompt) + list(tokens)
    n = len(seq) - 1
    if len(feed) != n:
        raise ValueError(f"feed names {len(feed)} positions, prompt + tokens have {n}")
    cache = DynamicCache()
    logits_all = []
    start = 0
    while start < n:
        end = start
        while end < n and feed[end] == feed[start]:
            end += 1
        out = models[feed[start]](torch.tensor([seq[start:end]]), past_key_values=cache, use_cache=True,
                                  position_ids=torch.arange(start, end)[None])
        cache = out.past_key_values
        logits_all.append(out.logits[0].float())
        start = end
    logits = torch.cat(logits_all)[len(prompt) - 1:]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(list(tokens))[:, None])[:, 0].tolist()
