"""The task interface: prompts deterministic in (seed, index), and a score per completion.

A task is what the orchestrator asks for "prompt number i" and "how good is this completion".
Prompts depend only on the configuration and the index, so a resumed run that continues at the
next index draws exactly the prompts the uninterrupted run would have drawn.

Both calls do their work in `*_sync` methods that the run performs in worker threads
(`orchestrator.scoring.scorer`): a task's code, the user's included, never runs on the event loop.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence

import anyio
import msgspec

from orchestrator.config.run import TaskConfig


class Prompt(msgspec.Struct, frozen=True):
    prompt_id: str  # stable: "<task>-s<seed>-<index, 6 digits>" (toys), "<task>-<row, 6 digits>" (rows)
    index: int
    text: str
    token_ids: tuple[int, ...]  # the chat-templated prompt, tokenized (add_generation_prompt=True)
    target: int | None = None  # length task: the number of tokens asked for
    row: dict | None = None  # a dataset or user task's row: every column, given to its rewards


class TaskExhausted(Exception):
    """The task has no prompt at this index (its dataset's epochs are used up)."""


_ROWS = None  # the runner of prompt_sync calls (user_code.UserCode), made at the first


class Task(abc.ABC):
    name: str = "abstract"

    def __init__(self, tokenizer, config: TaskConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config

    async def prompt(self, index: int) -> Prompt:
        """`prompt_sync` in a daemon worker thread (a user's `row()` may block: it never holds the
        loop, nor the process at its exit), bounded by `task.row_timeout_s` (UserCodeTimeout)."""
        from orchestrator.tasks.user_code import UserCode

        global _ROWS
        if _ROWS is None:
            _ROWS = UserCode(threads=8, name="rows")
        return await _ROWS.call(self.prompt_sync, index, timeout_s=self.config.row_timeout_s,
                                what=f"row {index} of task {self.name!r}")

    async def score(self, prompt: Prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        """`score_sync` in a worker thread (the run bounds it with `orchestrator.scoring.scorer.Scorer`)."""
        return await anyio.to_thread.run_sync(self.score_sync, prompt, completion_token_ids)

    def prompt_sync(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        text, target = self._draw(self._rng(index))
        return Prompt(prompt_id=f"{self.name}-s{self.config.seed}-{index:06d}", index=index, text=text,
                      token_ids=self.encode(text), target=target)

    @abc.abstractmethod
    def score_sync(self, prompt: Prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        """Scores of one completion; always has the key "reward"."""

    def _draw(self, rng: random.Random) -> tuple[str, int | None]:
        """The prompt text (and target, if any) from a generator seeded for one index."""
        raise NotImplementedError

    def _rng(self, index: int) -> random.Random:
        # A string seed is hashed with SHA-512 by `random`: the same in every process and
        # Python version (unlike hash()), and independent between neighbouring indices.
        return random.Random(f"{self.name}:{self.config.seed}:{index}")

    def encode(self, text: str) -> tuple[int, ...]:
        if not self.config.chat_template:  # a model without a chat template: the text as it is
            return tuple(int(t) for t in self.tokenizer.encode(text, add_special_tokens=False))
        return self.encode_messages([{"role": "user", "content": text}])

    def encode_messages(self, messages: list[dict]) -> tuple[int, ...]:
        """The chat-templated prompt's ids; a template that raises is a TemplateError naming
        `<where>.chat_template` with its own message (rows are encoded at start: the run stops
        there, one line)."""
        from orchestrator.tasks.templates import template_errors, template_source

        field = f"{getattr(self, 'where', 'task')}.chat_template"
        with template_errors(field, template_source(self.config.chat_template), messages):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        return tuple(int(t) for t in ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def __len__(self) -> int:  # pragma: no cover - procedural toys are endless
        raise TypeError(f"task {self.name!r} is endless")

    @property
    def rows(self) -> int | None:
        """Rows in one epoch, or None for an endless (procedural) task."""
        return None
