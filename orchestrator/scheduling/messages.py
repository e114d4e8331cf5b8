"""The scheduler's messages: the events it takes and the actions it returns (see
`orchestrator.scheduling.scheduler`). Plain frozen dataclasses, keyword-only: a message without its
required fields does not type-check.

Every event may carry `at`: when it was observed, in monotonic seconds (`time.monotonic()`).
The scheduler never reads a clock: the times it paces just-in-time admission by arrive here, so
its decisions are a function of the events alone. An event without `at` tells it nothing of time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

class SchedulerError(RuntimeError):
    """An event the scheduler's state does not allow (a bug in the caller)."""


# ---------------------------------------------------------------------------------------------
# Actions


@dataclass(frozen=True, kw_only=True)
class Dispatch:
    rollout_id: int
    group_id: int
    engine: str
    version: int  # the live version as the scheduler knows it (the fleet records the true one, >= this)


@dataclass(frozen=True, kw_only=True)
class Abort:
    """Abort these rollouts on `engine`; each comes back as `Finished` (aborted or, if it
    finished first, completed: an abort that arrives late is harmless)."""

    engine: str
    rollout_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, kw_only=True)
class Terminal:
    """Write the rollout's one terminal record."""

    rollout_id: int
    status: Literal["completed", "dropped", "errored"]
    reason: str | None = None  # drop reason or error kind
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class SubmitBatch:
    step: int
    group_ids: tuple[int, ...]
    rollout_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Discard:
    """Completed rollouts that no trainer step will consume."""

    rollout_ids: tuple[int, ...]
    reason: str
    step: int | None = None


Action = Dispatch | Abort | Terminal | SubmitBatch | Discard


# ---------------------------------------------------------------------------------------------
# Events


@dataclass(frozen=True, kw_only=True)
class Finished:
    rollout_id: int
    outcome: Literal["completed", "aborted", "errored"]
    kind: str = ""  # error kind (snake_case) when errored
    message: str = ""
    at: float | None = None
    # Completed: the newest version under which more than half of its tokens were sampled
    # (`majority_version`); what `scheduler.staleness_by = "majority"` bounds. None: not known.
    majority_version: int | None = None


@dataclass(frozen=True, kw_only=True)
class EngineDown:
    engine: str
    at: float | None = None


@dataclass(frozen=True, kw_only=True)
class EngineUp:
    """An engine serves (again). One the scheduler does not know joins the fleet: with
    `capacity` (its max_num_seqs), or, when None, the mean capacity of the engines it knows."""

    engine: str
    at: float | None = None
    capacity: int | None = None


@dataclass(frozen=True, kw_only=True)
class EngineLeft:
    """The engine left the fleet (drained, or lost for good): the scheduler forgets it. Its
    rollouts still in flight keep their records: their `Finished` still comes."""

    engine: str
    at: float | None = None


@dataclass(frozen=True, kw_only=True)
class VersionLive:
    version: int
    at: float | None = None


@dataclass(frozen=True, kw_only=True)
class StepDone:
    step: int
    version: int | None  # the version the step published (None: publish cadence skipped it)
    at: float | None = None


@dataclass(frozen=True, kw_only=True)
class TrainerLost:
    step: int
    at: float | None = None


@dataclass(frozen=True, kw_only=True)
class Stop:
    at: float | None = None


Event = Finished | EngineDown | EngineUp | EngineLeft | VersionLive | StepDone | TrainerLost | Stop


def majority_version(changes: list[tuple[int, int]] | None, n_tokens: int) -> int | None:
    """The newest version under which more than half of a completion's `n_tokens` tokens were
    sampled, from its change points [(first token index, version), ...] (versions never
    decrease along a completion, so it is the version of token (n - 1) // 2). None when there is
    no token or no change point to tell."""
    if n_tokens <= 0 or not changes:
        return None
    middle = (n_tokens - 1) // 2
    version = changes[0][1]
    for start, v in changes:
        if start > middle:
            break
        version = v
    return version
