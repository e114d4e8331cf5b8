"""Multi-turn toys the tiny model runs as it is (examples/multi-turn.toml, docs/multi-turn.md).

digits_dialogue  "Write digits." -> the model answers; the environment says "More digits." until
                 the model has answered `turns` times; the reward, given after the last turn, is
                 the share of the model's sampled tokens (every turn, the stop token counted)
                 that decode to ASCII digits: the digits task spread over a conversation.
calculator       "What is 3 + 4? Use the add tool." with an `add(a, b)` tool (Hermes/Qwen
                 `<tool_call>` JSON); reward 1.0 when the model's final answer (a turn without a
                 tool call) holds the sum, 0.0 otherwise; a call that does not parse ends the
                 episode `malformed_tool_call`, scored 0.

    [task]
    entrypoint = "orchestrator.tasks.toy_env:digits_dialogue"
    args = {turns = 3}
"""

from __future__ import annotations

import random

from orchestrator.tasks.env import Environment, Episode, ToolEnvironment
from orchestrator.tasks.toy import is_digit_token


class DigitsDialogue(Environment):
    name = "digits_dialogue"

    def __init__(self, tokenizer, turns: int = 3, max_episode_tokens: int = 1024, step_timeout_s: float = 30.0):
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"turns must be an integer >= 1, got {turns!r}")
        self.tokenizer = tokenizer
        self.max_turns = turns
        self.max_episode_tokens = max_episode_tokens
        self.step_timeout_s = step_timeout_s
        self._is_digit: dict[int, bool] = {}

    def row(self, index: int) -> dict:
        return {"index": index}

    async def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": "Write digits."}]

    async def step(self, episode: Episode) -> tuple[list[dict], float | None, bool]:
        if episode.turns < self.max_turns:
            return [{"role": "user", "content": "More digits."}], None, False
        sampled = [t for t, s in zip(episode.tokens, episode.sampled) if s]
        digits = sum(is_digit_token(self.tokenizer, t, self._is_digit) for t in sampled)
        return [], digits / len(sampled) if sampled else 0.0, True


def digits_dialogue(tokenizer, turns: int = 3, max_episode_tokens: int = 1024) -> DigitsDialogue:
    return DigitsDialogue(tokenizer, turns=turns, max_episode_tokens=max_episode_tokens)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


class Calculator(ToolEnvironment):
    name = "calculator"
    tools = (add,)

    def __init__(self, seed: int = 0, max_turns: int = 3, max_episode_tokens: int = 1024):
        self.seed = seed
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens

    def row(self, index: int) -> dict:
        rng = random.Random(f"calculator:{self.seed}:{index}")
        return {"a": rng.randrange(100), "b": rng.randrange(100)}

    def prompt(self, row: dict) -> str:
        return f"What is {row['a']} + {row['b']}? Use the add tool."

    def score(self, episode: Episode, row: dict) -> float:
        return 1.0 if str(row["a"] + row["b"]) in episode.last_reply() else 0.0


def calculator(seed: int = 0, max_turns: int = 3, max_episode_tokens: int = 1024) -> Calculator:
    return Calculator(seed=seed, max_turns=max_turns, max_episode_tokens=max_episode_tokens)
