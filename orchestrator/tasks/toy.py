"""Two toy tasks a tiny random model learns on a CPU in minutes.

digits  "Write digits: 4 7 1" -> reward = share of completion tokens that decode to ASCII digits
        (an empty completion scores 0.0; the EOS token counts as a non-digit token).
length  "Write exactly 7 tokens." -> reward = 1 - |len - N| / N, len counting completion tokens
        without a final EOS (it goes below 0 for completions longer than 2N).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from orchestrator.tasks.base import Prompt, Task


def is_digit_token(tokenizer, token_id: int, known: dict[int, bool]) -> bool:
    """Whether a token decodes to ASCII digits; `known` caches the answers (the vocabulary is fixed)."""
    answer = known.get(token_id)
    if answer is None:
        text = tokenizer.decode([token_id])
        answer = known[token_id] = bool(text) and text.isascii() and text.isdigit()
    return answer


class DigitsTask(Task):
    name = "digits"
    prompt_digits = 3

    def __init__(self, tokenizer, config) -> None:
        super().__init__(tokenizer, config)
        self._is_digit: dict[int, bool] = {}  # token id -> decodes to ASCII digits (cached: vocab is fixed)

    def _draw(self, rng: random.Random) -> tuple[str, int | None]:
        digits = " ".join(str(rng.randrange(10)) for _ in range(self.prompt_digits))
        return f"Write digits: {digits}", None

    def is_digit_token(self, token_id: int) -> bool:
        return is_digit_token(self.tokenizer, token_id, self._is_digit)

    def score_sync(self, prompt: Prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        n = len(completion_token_ids)
        if n == 0:
            return {"reward": 0.0, "digit_tokens": 0.0, "tokens": 0.0}
        digits = sum(self.is_digit_token(int(t)) for t in completion_token_ids)
        return {"reward": digits / n, "digit_tokens": float(digits), "tokens": float(n)}


class LengthTask(Task):
    name = "length"

    def _draw(self, rng: random.Random) -> tuple[str, int | None]:
        n = rng.randint(self.config.length_min, self.config.length_max)
        return f"Write exactly {n} tokens.", n

    def score_sync(self, prompt: Prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        if prompt.target is None:
            raise ValueError(f"prompt {prompt.prompt_id} has no target length")
        ids = list(completion_token_ids)
        if ids and self.eos_token_id is not None and ids[-1] == self.eos_token_id:
            ids.pop()  # the EOS ends the answer; it is not one of the tokens asked for
        n = prompt.target
        return {"reward": 1.0 - abs(len(ids) - n) / n, "tokens": float(len(ids)), "target": float(n)}
