"""What a scoring call ends in, for both scorers (threads: `orchestrator.scoring.scorer`; processes:
`orchestrator.scoring.pool` and its workers): the scores checked, or `ScoreFailed` with a stable
kind. A leaf: the scorers import it, it imports none of them."""

from __future__ import annotations

import math

REWARD_ERROR = "reward_error"
REWARD_TIMEOUT = "reward_timeout"


class ScoreFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        self.message = message
        super().__init__(f"{kind}: {message}")


def checked(rewards) -> dict[str, float]:
    """The scores as floats; a missing or non-finite "reward" is a reward_error."""
    if not isinstance(rewards, dict):
        raise ScoreFailed(REWARD_ERROR, f"the task's score is a {type(rewards).__name__}, not a dict")
    out = {}
    for name, value in rewards.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ScoreFailed(REWARD_ERROR, f"score {name!r} is {value!r}, not a finite number")
        out[str(name)] = float(value)
    if "reward" not in out:
        raise ScoreFailed(REWARD_ERROR, f"the task's score has no 'reward': {sorted(out)}")
    return out


def one_line(exc: BaseException) -> str:
    text = str(exc) if type(exc).__name__ in str(exc) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:500]


__all__ = ["REWARD_ERROR", "REWARD_TIMEOUT", "ScoreFailed", "checked", "one_line"]
