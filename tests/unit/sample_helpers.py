"""Sampling a few tokens with transformers, for tests that write logs as an engine would."""

from __future__ import annotations

import torch


@torch.no_grad()
def sample_tokens(model, ids: list[int], n: int, gen: torch.Generator) -> tuple[list[int], list[float]]:
    """`n` tokens sampled after `ids` (temperature 1) and the logprob of each."""
    ids, tokens, logprobs = list(ids), [], []
    for _ in range(n):
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
        token = int(torch.multinomial(lp.exp(), 1, generator=gen))
        tokens.append(token)
        logprobs.append(float(lp[token]))
        ids.append(token)
    return tokens, logprobs
