"""A verifiers 0.4 environment for the tests (tests/integration/test_verifiers04_run.py): the
shape `vf-init` scaffolds, in one module (0.4 finds an environment by its taskset id: the module of
that name, exporting its `Taskset` subclass in `__all__`). Each task asks for digits; the reward is
the share of digits in the model's last reply, with a quarter credit for the separators a list of
digits uses (spaces, commas), so the tiny model can learn it in a few steps and two replies with no
digit yet still score apart (a batch of equal rewards gives the trainer no signal). It plays with
any harness; the tests use `null` (verifiers' tool-less chat program, run as a `uv` script in the
runtime)."""

import verifiers.v1 as vf


class DigitsData(vf.TaskData):
    pass


class DigitsTask(vf.Task[DigitsData]):
    @vf.reward(weight=1.0)
    async def digits(self, trace: vf.Trace) -> float:
        text = last_reply(trace)
        return (sum(c.isdigit() for c in text) + 0.25 * sum(c in " ," for c in text)) / max(len(text), 1)


class DigitsConfig(vf.TasksetConfig):
    num_tasks: int = 8
    """How many tasks (each a different opening)."""


class DigitsTaskset(vf.Taskset[DigitsTask, DigitsConfig]):
    def load(self) -> list[DigitsTask]:
        return [DigitsTask(DigitsData(prompt=f"Write digits ({i}):"), self.config.task)
                for i in range(self.config.num_tasks)]


def last_reply(trace: vf.Trace) -> str:
    """The text of the trace's last assistant message ("" when it has none)."""
    for message in reversed(trace.messages or []):
        if getattr(message, "role", None) == "assistant":
            return vf.types.content_text(message.content) or ""
    return ""


__all__ = ["DigitsTaskset"]
