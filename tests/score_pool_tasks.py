"""Small picklable tasks for tests/unit/test_score_pool.py, importable by a spawned worker.

`CommandTask.score_sync(prompt, ids)` does what `prompt["do"]` says, so one pool can be made to
score, raise, hang, die or sleep; with `prompt["marker"]` it first writes "<pid>" to that file
(the test then knows which process is busy with its call).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from orchestrator.errors import ConfigError


class CommandTask:
    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def score_sync(self, prompt: dict, ids) -> dict[str, float]:
        if prompt.get("marker"):
            Path(prompt["marker"]).write_text(str(os.getpid()))
        do = prompt.get("do", "sum")
        if do == "sum":
            return {"reward": float(sum(ids)) + self.offset, "count": float(len(ids))}
        if do == "whoami":
            return {"reward": 1.0, "pid": float(os.getpid())}
        if do == "raise":
            raise ValueError("no digits in\n  the completion")
        if do == "nan":
            return {"reward": float("nan")}
        if do == "exit":
            os._exit(7)
        if do == "hang":
            while True:
                time.sleep(1)
        if do == "slow":
            start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine
            time.sleep(prompt["seconds"])
            return {"reward": 1.0, "start": start, "end": time.monotonic(), "pid": float(os.getpid())}
        raise AssertionError(f"unknown command {do!r}")


def config_error_builder():
    raise ConfigError("task.rewards[0].fn", "cannot import 'nope': ModuleNotFoundError")


def crashing_builder():
    raise RuntimeError("the builder\nblew up")


def big_builder(payload: bytes) -> CommandTask:
    """A builder whose pickle is larger than a pipe holds (`payload`): its send to a worker waits."""
    return CommandTask(float(len(payload) > 0))
