"""A task made of rows: a dataset file, or the user's task object (`row(index)`), scored by the
user's `score()` or by `task.rewards`.

Prompt index i (the scheduler's group id) names epoch i // n and position i % n of that epoch's
order (the eligible rows, shuffled by (task, seed, epoch)); so a run resumed at index i draws
exactly the row the uninterrupted run would have drawn next: none skipped, none repeated
within an epoch. Rows whose prompt is longer than `max_prompt_tokens` are left out at start and
counted (`skipped`), so every index still names one row.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from orchestrator.config.run import TaskConfig
from orchestrator.errors import ConfigError
from orchestrator.observe.logging import get_logger
from orchestrator.tasks.base import Prompt, Task, TaskExhausted
from orchestrator.tasks.templates import TemplateError
from orchestrator.tasks.user_code import call_in_thread

log = get_logger(__name__)


class RowTask(Task):
    def __init__(self, tokenizer, config: TaskConfig, *, name: str, rows: list[dict] | None = None,
                 source=None, rewards=None, where: str = "task", scan: bool = True) -> None:
        """`rows` (a dataset) or `source` (a user's task object with row(), optional __len__ and
        score()); `rewards` an `orchestrator.tasks.rewards.RewardSet` or None. `scan=False`: a
        scoring worker's copy, which never draws prompts (each comes with its row)."""
        super().__init__(tokenizer, config)
        self.name = name
        self.where = where
        self.source = source
        self.rewards = rewards
        self._check_scoring()
        self._check_template()
        self._rows = rows
        self._encoded: list[tuple[int, ...]] = []
        self.eligible: list[int] = []
        self.skipped = 0
        self._order_cache: tuple[int, list[int]] | None = None
        if not scan:
            return
        if rows is None and source is not None and hasattr(source, "__len__"):
            rows = [self._source_row(i) for i in range(len(source))]
        self._rows = rows
        if rows is not None:
            self._scan(rows)
        elif config.max_prompt_tokens is not None:
            raise ConfigError(f"{where}.max_prompt_tokens", "an endless task (no __len__) cannot skip rows")
        else:
            self._source_row(0)  # a task that cannot give its first row fails now, named

    def _check_scoring(self) -> None:
        if self.rewards is None and (self.source is None or not callable(getattr(self.source, "score", None))):
            raise ConfigError(f"{self.where}.rewards", "nothing scores this task: give rewards = [{fn = ...}] "
                                                       "(or a task object with a score() method)")

    # -- rows ------------------------------------------------------------------------------------
    @property
    def rows(self) -> int | None:
        return len(self.eligible) if self._rows is not None else None

    def _source_row(self, index: int) -> dict:
        try:
            row = self.source.row(index)
        except Exception as exc:  # noqa: BLE001 - the user's code: name it
            raise ConfigError(f"{self.where}.entrypoint", f"row({index}) failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{self.where}.entrypoint", f"row({index}) returned a {type(row).__name__}, not a dict")
        return row

    def _scan(self, rows: list[dict]) -> None:
        limit = self.config.max_prompt_tokens
        for i, row in enumerate(rows):
            ids = self._encode_row(row, i)
            if limit is not None and len(ids) > limit:
                self.skipped += 1
                self._encoded.append(())
                continue
            self._encoded.append(ids)
            self.eligible.append(i)
        needed = sorted(self.rewards.columns) if self.rewards is not None else []
        for i, row in enumerate(rows):  # after every prompt is known good: a bad prompt is named first
            self._check_columns(row, i, needed)
        if not self.eligible:
            raise ConfigError(f"{self.where}.max_prompt_tokens",
                              f"every one of the {len(rows)} rows is longer than {limit} tokens")
        if self.skipped:
            log.warning("task.rows_skipped", task=self.name, skipped=self.skipped, kept=len(self.eligible),
                        max_prompt_tokens=limit)

    def _check_columns(self, row: dict, number: int, needed: list[str]) -> None:
        """A column the rewards take by name and a row lacks would error every rollout of that
        row (a typo in `answer_field` errors them all, and the run never steps): named now."""
        missing = [c for c in needed if c not in row]
        if missing:
            field = "answer_field" if missing[0] == self.config.answer_field else "rewards"
            raise ConfigError(f"{self.where}.{field}", f"row {number} has no column {missing[0]!r}, which the rewards "
                                                       f"take (columns: {sorted(row)})")

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = list(self.eligible)
            if self.config.shuffle:
                random.Random(f"{self.name}:{self.config.seed}:{epoch}").shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def row_at(self, index: int) -> tuple[int, dict]:
        """(row number, row) for prompt index `index`."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        if self._rows is None:
            return index, self._source_row(index)
        epoch, position = divmod(index, len(self.eligible))
        if self.config.epochs is not None and epoch >= self.config.epochs:
            raise TaskExhausted(f"{self.name}: {self.config.epochs} epoch(s) of {len(self.eligible)} rows used")
        number = self._order(epoch)[position]
        return number, self._rows[number]

    def prompt_sync(self, index: int) -> Prompt:
        number, row = self.row_at(index)
        ids = self._encoded[number] if self._rows is not None else self._encode_row(row, number)
        return Prompt(prompt_id=f"{self.name}-{number:06d}", index=index, text=self._prompt_text(row),
                      token_ids=ids, row=row)

    # -- prompts ---------------------------------------------------------------------------------
    def _check_template(self) -> None:
        c = self.config
        if c.chat_template and getattr(self.tokenizer, "chat_template", None) is None:
            raise ConfigError(f"{self.where}.chat_template", "the model's tokenizer has no chat template: set "
                                                             "chat_template = false to tokenize prompts as they are")
        if not c.chat_template and (c.messages_field or c.system_prompt):
            field = "messages_field" if c.messages_field else "system_prompt"
            raise ConfigError(f"{self.where}.{field}", "needs the chat template (chat_template = false)")

    def _messages(self, row: dict, number: int) -> list[dict]:
        c = self.config
        if c.messages_field:
            messages = row.get(c.messages_field)
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise ConfigError(f"{self.where}.messages_field",
                                  f"row {number}: column {c.messages_field!r} must be a list of {{role, content}} "
                                  f"messages, got {_shown(messages)} (columns: {sorted(row)})")
        else:
            messages = [{"role": "user", "content": self._prompt_field(row, number)}]
        if c.system_prompt and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": c.system_prompt}, *messages]
        return messages

    def _prompt_field(self, row: dict, number: int) -> str:
        field = self.config.prompt_field
        text = row.get(field)
        if not isinstance(text, str):
            found = "has no column" if field not in row else f"has a {type(text).__name__} in column"
            raise ConfigError(f"{self.where}.prompt_field",
                              f"row {number} {found} {field!r} (text expected; columns: {sorted(row)})")
        return text

    def _encode_row(self, row: dict, number: int) -> tuple[int, ...]:
        if not self.config.chat_template:
            return tuple(int(t) for t in self.tokenizer.encode(self._prompt_field(row, number),
                                                               add_special_tokens=False))
        try:
            return self.encode_messages(self._messages(row, number))
        except TemplateError as exc:  # which row the template refused, for a row-dependent refusal
            raise type(exc)(exc.field, f"row {number}: {exc.reason}") from None

    def _prompt_text(self, row: dict) -> str:
        c = self.config
        if c.messages_field:
            messages = row[c.messages_field]
            return str(messages[-1].get("content", "")) if messages else ""
        return row[c.prompt_field]

    # -- scores ----------------------------------------------------------------------------------
    def score_sync(self, prompt: Prompt, completion_token_ids: Sequence[int]) -> dict[str, float]:
        ids = [int(t) for t in completion_token_ids]
        completion = self.decode(ids)
        row = prompt.row or {}
        if self.rewards is not None:
            return self.rewards.score(completion, ids, row)
        result = call_in_thread(self.source.score, completion, ids, row)
        if isinstance(result, dict):
            if "reward" not in result:
                raise ValueError(f"score() returned {sorted(result)} without a 'reward' key")
            return {str(k): float(v) for k, v in result.items()}
        if isinstance(result, bool) or not isinstance(result, (int, float)):
            raise ValueError(f"score() returned a {type(result).__name__}, not a number")
        return {"reward": float(result)}


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
