"""A user's reward functions: TRL-style keyword arguments, the dataset row's columns by name."""


def digit_share(completion: str, **row) -> float:
    """The share of the completion's non-space characters that are digits (0.0 when empty)."""
    chars = [c for c in completion if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def echoes_answer(completion: str, answer: str, **row) -> float:
    """1.0 when the completion starts with the row's answer digits (spaces ignored)."""
    return float("".join(completion.split()).startswith(str(answer)))
