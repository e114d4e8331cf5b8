"""The toy verifiers 0.4 environment with faults, for tests/unit/test_verifiers04_task.py: each task
plays one model turn, then its reward ends the driver process ("exit"), never returns ("hang"), or
raises ("raise"), or scores the reply as the toy's does ("fine")."""

import asyncio
import os

import verifiers.v1 as vf
from toy_env04 import DigitsConfig, DigitsData, DigitsTask, last_reply


class FaultyTask(DigitsTask):
    @vf.reward(weight=1.0)
    async def digits(self, trace: vf.Trace) -> float:
        if self.data.name == "exit":
            os._exit(9)  # the driver dies mid-episode, its reply never sent
        if self.data.name == "hang":
            await asyncio.sleep(3600)
        if self.data.name == "raise":
            raise ValueError("no score for this one")
        text = last_reply(trace)
        return sum(c.isdigit() for c in text) / max(len(text), 1)


class FaultyTaskset(vf.Taskset[FaultyTask, DigitsConfig]):
    def load(self) -> list[FaultyTask]:
        return [FaultyTask(DigitsData(prompt="Write digits:", name=name), self.config.task)
                for name in ("exit", "fine", "hang", "raise")]


__all__ = ["FaultyTaskset"]
