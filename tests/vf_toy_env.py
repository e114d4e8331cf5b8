"""A tiny verifiers environment for the tests (not part of the package): `load_environment(kind=)`

    "multi"   a MultiTurnEnv: the environment answers "again" twice (three model turns)
    "single"  a SingleTurnEnv
    "tool"    a ToolEnv with one tool, add(a, b)
    "group"   a SingleTurnEnv whose rubric has a group-level reward function (refused)

The rubric: the share of the model's reply characters (non-space) that are digits; the tool
environment's adds 1 when its last reply holds the sum the tool returned.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def digit_share(completion, **kwargs) -> float:
    text = "".join(m["content"] or "" for m in completion if m["role"] == "assistant").replace(" ", "")
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def found_sum(completion, **kwargs) -> float:
    tool_results = [m["content"] for m in completion if m["role"] == "tool"]
    last = completion[-1]["content"] or "" if completion and completion[-1]["role"] == "assistant" else ""
    return 1.0 if tool_results and tool_results[-1] in last else 0.0


def digit_rank(completions, **kwargs) -> list[float]:  # a group-level reward function
    return [0.0 for _ in completions]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class AgainEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}]


def load_environment(kind: str = "multi", rows: int = 4) -> vf.Environment:
    dataset = Dataset.from_list([{"question": f"Write digits: {i} {i + 1}", "answer": f"{i}{i + 1}"}
                                 for i in range(rows)])
    if kind == "multi":
        return AgainEnv(dataset=dataset, rubric=vf.Rubric(funcs=[digit_share]), max_turns=3)
    if kind == "single":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[digit_share]))
    if kind == "tool":
        return vf.ToolEnv(dataset=dataset, tools=[add], rubric=vf.Rubric(funcs=[found_sum]), max_turns=3)
    if kind == "group":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[digit_rank]))
    raise ValueError(f"kind {kind!r}")
