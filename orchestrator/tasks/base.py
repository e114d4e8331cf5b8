"""The task interface: prompts deterministic in (seed, index), and a score per completion.

A task is what the orchestrator asks for "prompt number i" and "how good is this completion".
Prompts depend only on `(config.seed, index)`, so a resumed run that continues at the next
index draws exactly the prompts the uninterrupted run would have drawn.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence

import msgspec

from orchestrator.config import TaskConfig


class Prompt(msgspec.Struct, frozen=True):
    prompt_id: str  # stable: "<task>-s<seed>-<index, 6 digits>"
    index: int
    text: str
    token_ids: tuple[int, ...]  # the chat-templated prompt, tokenized (add_generation_prompt=True)
    target: int | None = None  # length task: the number of tokens asked for


class Task(abc.ABC):
    name: str = "abstract"

    def __init__(self, tokenizer, config: TaskConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config

    async def prompt(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        text, target = self._draw(self._rng(index))
        return Prompt(prompt_id=f"{self.name}-s{self.config.seed}-{index:06d}", index=index, text=text,
                      token_ids=self.encode(text), target=target)

    @abc.abstractmethod
    async def score(self, prompt: Prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        """Scores of one completion; always has the key "reward"."""

    @abc.abstractmethod
    def _draw(self, rng: random.Random) -> tuple[str, int | None]:
        """The prompt text (and target, if any) from a generator seeded for one index."""

    def _rng(self, index: int) -> random.Random:
        # A string seed is hashed with SHA-512 by `random`: the same in every process and
        # Python version (unlike hash()), and independent between neighbouring indices.
        return random.Random(f"{self.name}:{self.config.seed}:{index}")

    def encode(self, text: str) -> tuple[int, ...]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return tuple(int(t) for t in ids)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id
