"""The scheduler's messages: the events it takes and the actions it returns (see
`orchestrator.scheduling.scheduler`). Frozen msgspec structs, keyword-only: a message without its
required fields is a TypeError. (Structs, not frozen dataclasses: a frozen dataclass sets each
field through `object.__setattr__`, ~1 us a message against ~0.1, and three of them are built
for every rollout.)

Every event may carry `at`: when it was observed, in monotonic seconds (`time.monotonic()`).
The scheduler never reads a clock: the times it paces just-in-time admission by arrive here, so
its decisions are a function of the events alone. An event without `at` tells it nothing of time.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class SchedulerError(RuntimeError):
    """An event the scheduler's state does not allow (a bug in the caller)."""


# ---------------------------------------------------------------------------------------------
# Actions


class Dispatch(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: int
    group_id: int
    engine: str
    version: int  # the live version as the scheduler knows it (the fleet records the true one, >= this)


class Abort(msgspec.Struct, frozen=True, kw_only=True):
    """Abort these rollouts on `engine`; each comes back as `Finished` (aborted or, if it
    finished first, completed: an abort that arrives late is harmless)."""

    engine: str
    rollout_ids: tuple[int, ...]
    reason: str


class Terminal(msgspec.Struct, frozen=True, kw_only=True):
    """Write the rollout's one terminal record."""

    rollout_id: int
    status: Literal["completed", "dropped", "errored"]
    reason: str | None = None  # drop reason or error kind
    message: str = ""


class SubmitBatch(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    group_ids: tuple[int, ...]
    rollout_ids: tuple[int, ...]


class Discard(msgspec.Struct, frozen=True, kw_only=True):
    """Completed rollouts that no trainer step will consume."""

    rollout_ids: tuple[int, ...]
    reason: str
    step: int | None = None


Action = Dispatch | Abort | Terminal | SubmitBatch | Discard


# ---------------------------------------------------------------------------------------------
# Events


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: int
    outcome: Literal["completed", "aborted", "errored"]
    kind: str = ""  # error kind (snake_case) when errored
    message: str = ""
    at: float | None = None
    # Completed: the newest version under which more than half of its tokens were sampled
    # (`majority_version`); what `scheduler.staleness_by = "majority"` bounds. None: not known.
    majority_version: int | None = None


class EngineDown(msgspec.Struct, frozen=True, kw_only=True):
    engine: str
    at: float | None = None


class EngineUp(msgspec.Struct, frozen=True, kw_only=True):
    """An engine serves (again). One the scheduler does not know joins the fleet: with
    `capacity` (its max_num_seqs), or, when None, the mean capacity of the engines it knows."""

    engine: str
    at: float | None = None
    capacity: int | None = None


class EngineLeft(msgspec.Struct, frozen=True, kw_only=True):
    """The engine left the fleet (drained, or lost for good): the scheduler forgets it. Its
    rollouts still in flight keep their records: their `Finished` still comes."""

    engine: str
    at: float | None = None


class VersionLive(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    at: float | None = None


class StepDone(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    version: int | None  # the version the step published (None: publish cadence skipped it)
    at: float | None = None


class TrainerLost(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    at: float | None = None


class Stop(msgspec.Struct, frozen=True, kw_only=True):
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
