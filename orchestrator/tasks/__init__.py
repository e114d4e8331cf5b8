"""Tasks: prompts and rewards. `make_task(config, model_dir)` builds the configured one."""

from __future__ import annotations

from orchestrator.config import TaskConfig
from orchestrator.errors import ConfigError
from orchestrator.tasks.base import Prompt, Task
from orchestrator.tasks.toy import DigitsTask, LengthTask

TASKS: dict[str, type[Task]] = {"digits": DigitsTask, "length": LengthTask}


def make_task(config: TaskConfig, model_dir: str) -> Task:
    """The task named by config.name, with the tokenizer of the model the engines serve."""
    if config.name not in TASKS:
        raise ConfigError("task.name", f"unknown task {config.name!r}; choose one of {sorted(TASKS)}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return TASKS[config.name](tokenizer, config)


__all__ = ["TASKS", "DigitsTask", "LengthTask", "Prompt", "Task", "make_task"]
