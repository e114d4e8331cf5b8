"""The task sections of the configuration: `[task]` (the user's seam: docs/tasks.md) and `[eval]`
(the held-out evaluation, whose task fields default to `[task]`'s). `orchestrator.config.run` holds
the rest and re-exports both."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import msgspec

from orchestrator.errors import ConfigError


class TaskConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The task that supplies prompts and scores completions (docs/tasks.md).

    Three ways in, checked in this order: `entrypoint` (the user's factory, by import path),
    `dataset` (a file or a `save_to_disk` directory, scored by `rewards`), or `name` (a built-in toy).
    """

    # Built-in toys: digits: reward = share of completion tokens that decode to ASCII digits;
    # length: the prompt asks for exactly N tokens, reward 1 - |len - N| / N.
    name: Literal["digits", "length"] = "digits"
    seed: int = 0
    length_min: int = 4
    length_max: int = 12
    # "package.module:factory": called with `args` as keyword arguments (and `tokenizer=` when it
    # takes one); returns a task object (row(index), optional __len__ and score) or a dataset.
    entrypoint: str | None = None
    args: dict[str, object] = {}
    # JSONL, Parquet, CSV, or a `datasets.Dataset.save_to_disk` directory (read offline).
    dataset: str | None = None
    prompt_field: str = "prompt"  # a text column: the user message
    messages_field: str | None = None  # or a column of chat messages [{role, content}, ...]
    answer_field: str = "answer"  # what the built-in rewards compare against
    system_prompt: str | None = None
    # Rows in a fixed order per epoch, shuffled by `seed` (false: file order).
    shuffle: bool = True
    # Passes over the dataset; None: as many as the run needs.
    epochs: int | None = None
    # Rows whose prompt is longer (in tokens) are skipped and counted at start.
    max_prompt_tokens: int | None = None
    # [{fn = "exact"|"math"|"regex"|"package.module:function", weight = 1.0, ...}], summed by weight.
    rewards: list[dict[str, object]] = []
    # true: the model's chat template; false: the prompt text is tokenized as is (a model without a
    # chat template); a path: the Jinja template in that file renders every prompt and turn (e.g.
    # a prefix-preserving variant of a thinking template, for a multi-turn task).
    chat_template: bool | str = True
    # Each scoring call (every reward function of one completion) is bounded by this.
    score_timeout_s: float = 30.0
    # Scoring runs off the event loop, in this many worker processes or threads (score_pool).
    score_workers: int = 2
    # The task's name in prompt ids, metrics and eval keys; default from entrypoint/dataset/name.
    id: str | None = None
    # process: scoring in `score_workers` processes, each building the task once at start; a hung
    # reward function is killed and replaced, and no GIL contention with the event loop.
    # thread: in-process threads, cheaper to start; a hung function keeps its thread.
    # auto: process for your code (entrypoint, dataset), thread for the built-in toys.
    score_pool: Literal["auto", "process", "thread"] = "auto"
    # A multi-turn agent (docs/agents.md): "package.module:run", `async def run(client, row) ->
    # reward` against the run's OpenAI-compatible endpoint; rows from `dataset` or `entrypoint`.
    agent: str | None = None
    agent_timeout_s: float = 600.0  # one whole episode of the agent
    # The reward of a multi-turn episode cut at max_episode_tokens (issue #30) that no step gave
    # one, where the environment's score does not take `truncated` (docs/multi-turn.md); an
    # agent's, when it raised on the endpoint's context-length refusal.
    truncation_reward: float = 0.0
    # Building the task at start (the factory of `entrypoint`, reading and scanning `dataset`), in
    # a worker thread: past it the run stops, naming the factory (it cannot hang the start).
    build_timeout_s: float = 600.0
    # One row (`row(index)` of a task object) and its prompt's rendering, in a worker thread: past
    # it the run stops naming the row, instead of waiting on it with every admission behind it.
    row_timeout_s: float = 60.0
    # score_pool = "process": one more scoring process kept built, so that a worker killed for
    # score_timeout_s (or dead) is replaced at once instead of after its build (seconds: Python,
    # the task's imports, the tokenizer); false saves its memory.
    score_spare_worker: bool = True

    @property
    def scoring_pool(self) -> str:
        """The pool `score_pool` resolves to."""
        if self.score_pool != "auto":
            return self.score_pool
        return "process" if self.entrypoint or self.dataset else "thread"

    def validate(self) -> TaskConfig:
        if not 1 <= self.length_min <= self.length_max:
            raise ConfigError("task.length_min", f"must be in [1, length_max={self.length_max}], got {self.length_min}")
        if self.entrypoint is not None and ":" not in self.entrypoint:
            raise ConfigError("task.entrypoint", f"must be 'package.module:factory', got {self.entrypoint!r}")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError("task.epochs", f"must be >= 1, got {self.epochs}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError("task.max_prompt_tokens", f"must be >= 1, got {self.max_prompt_tokens}")
        if not self.score_timeout_s > 0:
            raise ConfigError("task.score_timeout_s", f"must be > 0, got {self.score_timeout_s}")
        if self.agent is not None and ":" not in self.agent:
            raise ConfigError("task.agent", f"must be 'package.module:function', got {self.agent!r}")
        if not self.agent_timeout_s > 0:
            raise ConfigError("task.agent_timeout_s", f"must be > 0, got {self.agent_timeout_s}")
        for name in ("build_timeout_s", "row_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"task.{name}", f"must be > 0, got {getattr(self, name)}")
        if not math.isfinite(self.truncation_reward):
            raise ConfigError("task.truncation_reward", f"must be a finite number, got {self.truncation_reward}")
        if isinstance(self.chat_template, str) and not self.chat_template.strip():
            raise ConfigError("task.chat_template", "true (the model's template), false (none) or the path of a "
                                                    "Jinja template file, got an empty string")
        if self.score_workers < 1:
            raise ConfigError("task.score_workers", f"must be >= 1, got {self.score_workers}")
        for i, spec in enumerate(self.rewards):
            if not isinstance(spec.get("fn"), str):
                raise ConfigError(f"task.rewards[{i}].fn", "required: \"exact\", \"math\", \"regex\" or "
                                                           "\"package.module:function\"")
        return self

    @property
    def task_id(self) -> str:
        """The task's name in prompt ids, metrics and eval keys."""
        if self.id:
            return self.id
        if self.agent and not self.entrypoint and not self.dataset:
            return self.agent.split(":", 1)[0].rsplit(".", 1)[-1]
        if self.entrypoint:  # "my_pkg.tasks:make" -> "tasks" (a task object's own `name` wins at run time)
            return self.entrypoint.split(":", 1)[0].rsplit(".", 1)[-1]
        if self.dataset:
            return Path(self.dataset).stem or "dataset"
        return self.name


class EvalConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Held-out evaluation on the live fleet while training goes on (docs/tasks.md#evaluation).

    Every `every_steps` trainer steps (and before the first, with `at_start`) the first
    `max_prompts` prompts of the eval task are sampled `samples_per_prompt` (k) times, at most
    `max_inflight` requests at once, beside the training rollouts. Activations go on meanwhile:
    the eval record names the versions its tokens came from (orchestrator/run/eval.py). mean@k is
    the mean reward of the samples, pass@k the share of prompts with a sample whose reward is at
    least `pass_threshold`. Eval rollouts never reach the trainer.
    The task fields below default to [task]'s: set `dataset` (or `entrypoint`) to a held-out set.
    """

    every_steps: int = 0  # 0: no evaluation during the run
    at_start: bool = True  # also evaluate the base model (version 0) before the first step
    samples_per_prompt: int = 4
    max_prompts: int = 32
    temperature: float | None = None  # None: sampling.temperature
    max_tokens: int | None = None  # None: sampling.max_tokens
    pass_threshold: float = 1.0
    timeout_s: float = 600.0  # one whole evaluation
    # The eval task; each None is [task]'s value.
    name: Literal["digits", "length"] | None = None
    entrypoint: str | None = None
    args: dict[str, object] | None = None
    dataset: str | None = None
    prompt_field: str | None = None
    messages_field: str | None = None
    answer_field: str | None = None
    system_prompt: str | None = None
    rewards: list[dict[str, object]] | None = None
    id: str | None = None
    # Eval requests in flight at once during a run: the share of the engines an evaluation may
    # take from the training rollouts (`inflight eval`, with nothing else to serve, sends 64).
    max_inflight: int = 16

    def validate(self) -> EvalConfig:
        for name in ("every_steps",):
            if getattr(self, name) < 0:
                raise ConfigError(f"eval.{name}", f"must be >= 0, got {getattr(self, name)}")
        for name in ("samples_per_prompt", "max_prompts", "max_inflight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"eval.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.temperature is not None and not self.temperature > 0:
            raise ConfigError("eval.temperature", f"must be > 0, got {self.temperature}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError("eval.max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not self.timeout_s > 0:
            raise ConfigError("eval.timeout_s", f"must be > 0, got {self.timeout_s}")
        return self

    def task_config(self, task: TaskConfig) -> TaskConfig:
        """[task] with this section's task fields over it: the eval task, in file order."""
        changes = {name: getattr(self, name) for name in (
            "name", "entrypoint", "args", "dataset", "prompt_field", "messages_field", "answer_field",
            "system_prompt", "rewards", "id") if getattr(self, name) is not None}
        if "dataset" in changes and "entrypoint" not in changes:
            changes["entrypoint"] = None
        if "entrypoint" in changes and "dataset" not in changes:
            changes["dataset"] = None
        if "name" in changes:
            changes.setdefault("entrypoint", None)
            changes.setdefault("dataset", None)
            changes.setdefault("rewards", [])
        if "dataset" in changes or "entrypoint" in changes or "name" in changes:
            changes["agent"] = None  # [eval]'s own task: [task]'s agent is not its
        if not self.id and ("dataset" in changes or "entrypoint" in changes or "name" in changes):
            changes["id"] = None  # named after the eval's own source
        changes.update(shuffle=False, epochs=None)
        return msgspec.structs.replace(task, **changes).validate()
