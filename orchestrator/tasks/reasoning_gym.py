"""reasoning-gym's procedural datasets as a task: `[task] entrypoint = "orchestrator.tasks.reasoning_gym:make"`.

    [task]
    entrypoint = "orchestrator.tasks.reasoning_gym:make"
    args = {dataset = "basic_arithmetic", size = 500, seed = 0}   # + the generator's own options

Rows come from the library's own generator (`reasoning_gym.create_dataset`, offline, deterministic
in seed and index); completions are scored by the library's own scorer (`score_answer`) on the
answer its own helper (`reasoning_gym.utils.extract_answer`) takes out of the <answer></answer>
tags. The prompt leads with one of the library's own answer-format instructions
(`reasoning_gym.utils.SYSTEM_PROMPTS`, `instruction = "default"`; "none" for the bare question),
which asks for exactly those tags.
"""

from __future__ import annotations

import dataclasses
import difflib
from functools import lru_cache
from typing import Any

from orchestrator.errors import ConfigError

_FIELD = "task.args"
_NO_INSTRUCTION = "none"


class ReasoningGymTask:
    """One reasoning-gym dataset: `row(i)` for i in [0, size), scored by the library itself."""

    def __init__(self, dataset_name: str, dataset: Any, instruction: str | None) -> None:
        from reasoning_gym.utils import extract_answer

        self.name = f"reasoning_gym.{dataset_name}"
        self.dataset_name = dataset_name
        self.dataset = dataset
        self.instruction = instruction
        self._extract_answer = extract_answer
        # Scoring a group calls score() once per sample of one row: generate each entry once.
        self._entry = lru_cache(maxsize=8192)(dataset.__getitem__)

    def __len__(self) -> int:
        return len(self.dataset)

    def entry(self, index: int) -> dict[str, Any]:
        """The library's own entry (question, answer, metadata) at `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: row {index} out of range [0, {len(self)})")
        return self._entry(index)

    def row(self, index: int) -> dict[str, Any]:
        entry = self.entry(index)
        question = entry["question"]
        prompt = f"{self.instruction}\n\n{question}" if self.instruction else question
        return {"prompt": prompt, "answer": entry["answer"], "index": index}

    def score(self, completion: str, completion_ids: list[int], row: dict) -> float:
        """The library's score of the answer inside the completion's last <answer></answer> tags."""
        if "index" not in row:
            raise ValueError(f"{self.name}: the row has no 'index' (a row of this task has one)")
        answer = self._extract_answer(completion)  # None when there are no tags: scored as such
        return float(self.dataset.score_answer(answer=answer, entry=self.entry(int(row["index"]))))


def make(dataset: str | None = None, size: int = 1000, seed: int = 0, instruction: str = "default",
         **kwargs: Any) -> ReasoningGymTask:
    """The reasoning-gym dataset `dataset` with `size` rows from `seed`; kwargs go to its generator."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    config_cls = _config_class(dataset, DATASETS)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(f"{_FIELD}.size", f"must be a positive integer, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{_FIELD}.seed", f"must be an integer, got {seed!r}")
    if instruction != _NO_INSTRUCTION and instruction not in SYSTEM_PROMPTS:
        choices = ", ".join([*SYSTEM_PROMPTS, _NO_INSTRUCTION])
        raise ConfigError(f"{_FIELD}.instruction", f"unknown {instruction!r}; one of reasoning-gym's: {choices}")
    options = {f.name for f in dataclasses.fields(config_cls)}
    for key in kwargs:
        if key not in options:
            takes = ", ".join(sorted(options - {"seed", "size"}))
            raise ConfigError(f"{_FIELD}.{key}",
                              f"reasoning-gym {dataset!r} takes no option {key!r} (it takes: {takes})")
    try:
        generator = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **kwargs)
    except (AssertionError, TypeError, ValueError) as exc:  # the config's own validate() uses assert
        reason = f"reasoning-gym {dataset!r} refused the options: {type(exc).__name__}: {exc}"
        raise ConfigError(_FIELD, reason) from exc
    text = None if instruction == _NO_INSTRUCTION else SYSTEM_PROMPTS[instruction].strip()
    return ReasoningGymTask(dataset, generator, text)


def _config_class(dataset: object, registry: dict) -> type:
    if not isinstance(dataset, str) or not dataset:
        raise ConfigError(f"{_FIELD}.dataset", f"required: a reasoning-gym dataset name, got {dataset!r}; "
                                               f"e.g. {', '.join(sorted(registry)[:5])}")
    if dataset not in registry:
        near = difflib.get_close_matches(dataset, list(registry), n=5, cutoff=0.5)
        some = near or ["basic_arithmetic", "chain_sum", "countdown", "gsm_symbolic", "leg_counting"]
        raise ConfigError(f"{_FIELD}.dataset", f"unknown reasoning-gym dataset {dataset!r}; e.g. {', '.join(some)} "
                                               f"({len(registry)} in all)")
    return registry[dataset][1]
