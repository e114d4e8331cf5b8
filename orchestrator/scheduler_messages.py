"""The scheduler's messages: the events it takes and the actions it returns (see
`orchestrator.scheduler`). Plain frozen dataclasses, keyword-only: a message without its
required fields does not type-check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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


@dataclass(frozen=True, kw_only=True)
class EngineDown:
    engine: str


@dataclass(frozen=True, kw_only=True)
class EngineUp:
    engine: str


@dataclass(frozen=True, kw_only=True)
class VersionLive:
    version: int


@dataclass(frozen=True, kw_only=True)
class StepDone:
    step: int
    version: int | None  # the version the step published (None: publish cadence skipped it)


@dataclass(frozen=True, kw_only=True)
class TrainerLost:
    step: int


@dataclass(frozen=True, kw_only=True)
class Stop:
    pass


Event = Finished | EngineDown | EngineUp | VersionLive | StepDone | TrainerLost | Stop


# ---------------------------------------------------------------------------------------------
