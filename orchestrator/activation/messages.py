"""The activation coordinator's messages: the actions it returns and the events it takes
(see `orchestrator.activation.coordinator`). Frozen, keyword-only dataclasses: every field that describes
what happened or what to do is required (no default stands in for a value nobody passed), so
`Stage(engine="a")` without a version is a type error, not version 0. Only optional flags
(`rollback`, `between_steps`) have defaults. `at` is the performer's monotonic clock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# adapter: each version is a LoRA adapter loaded beside the serving ones (Stage); the instant
# is the fleet's: new requests name the new adapter, requests in flight keep theirs. No pause.
STRATEGIES: tuple[str, ...] = ("pause_swap", "double_buffer", "pause_free", "adapter")
KV_POLICIES: tuple[str, ...] = ("recompute", "keep", "drain", "abort")
Strategy = Literal["pause_swap", "double_buffer", "pause_free", "adapter"]
KvPolicy = Literal["recompute", "keep", "drain", "abort"]

# Outcomes (the same strings as replay.records.ACTIVATED, ROLLED_BACK, ENGINE_FENCED).
ROLLED_BACK = "rolled_back"
ENGINE_FENCED = "engine_fenced"
FAILED = "failed"  # every engine failed during the swap: nobody serves v
ACTIVATED = "activated"  # the same string as replay.records.ACTIVATED

# The coordinator's phases.
IDLE, STAGING, DRAINING, PAUSING, SWAPPING, RESUMING = "idle", "staging", "draining", "pausing", "swapping", "resuming"


# ---------------------------------------------------------------------------------------------
# Actions (what the performer must do)


@dataclass(frozen=True, kw_only=True)
class Action:
    """What the performer must do."""


@dataclass(frozen=True, kw_only=True)
class EngineAction(Action):
    """An action addressed to one engine."""

    engine: str


@dataclass(frozen=True, kw_only=True)
class Stage(EngineAction):
    version: int
    rollback: bool = False  # the engine's other buffer already holds the weights (double buffering)


@dataclass(frozen=True, kw_only=True)
class DropStaged(EngineAction):
    version: int


@dataclass(frozen=True, kw_only=True)
class Drain(EngineAction):
    """Stop admitting new requests to the engine and wait for its in-flight ones to finish."""


@dataclass(frozen=True, kw_only=True)
class AbortInflight(EngineAction):
    """Abort the engine's in-flight requests (they are dispatched again)."""


@dataclass(frozen=True, kw_only=True)
class Pause(EngineAction):
    mode: str
    clear_cache: bool


@dataclass(frozen=True, kw_only=True)
class Swap(EngineAction):
    version: int
    rollback: bool = False
    between_steps: bool = False  # the pause-free flip: no pause around it


@dataclass(frozen=True, kw_only=True)
class FenceCache(EngineAction):
    pass


@dataclass(frozen=True, kw_only=True)
class SetVersion(EngineAction):
    version: int


@dataclass(frozen=True, kw_only=True)
class Resume(EngineAction):
    pass


@dataclass(frozen=True, kw_only=True)
class Fence(EngineAction):
    reason: str


@dataclass(frozen=True, kw_only=True)
class Unfence(EngineAction):
    version: int


@dataclass(frozen=True, kw_only=True)
class StartTimer(Action):
    engine: str | None  # None: a timer of the whole activation, not of one engine
    phase: str
    token: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class EngineOutcome:
    engine: str
    outcome: str  # ACTIVATED, ENGINE_FENCED, ROLLED_BACK
    transfer_s: float
    pause_s: float
    swapped_requests: dict[str, int]  # request id -> tokens at the swap


@dataclass(frozen=True, kw_only=True)
class Record(Action):
    """The activation's outcome (not addressed to an engine: the loop records it)."""

    version: int
    outcome: str
    engines: tuple[EngineOutcome, ...]
    strategy: str
    kv_policy: str
    kv_carried: bool
    message: str
    at: float


# ---------------------------------------------------------------------------------------------
# Events (what happened; `at` is the performer's monotonic clock)


@dataclass(frozen=True, kw_only=True)
class Event:
    engine: str | None  # None: about the whole activation (a timer of it)
    at: float


@dataclass(frozen=True, kw_only=True)
class Staged(Event):
    version: int


@dataclass(frozen=True, kw_only=True)
class StageFailed(Event):
    version: int
    error: str


@dataclass(frozen=True, kw_only=True)
class Drained(Event):
    pass


@dataclass(frozen=True, kw_only=True)
class Paused(Event):
    pass


@dataclass(frozen=True, kw_only=True)
class Swapped(Event):
    version: int
    requests: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class CacheFenced(Event):
    pass


@dataclass(frozen=True, kw_only=True)
class VersionSet(Event):
    version: int
    requests: dict[str, int]  # requests first scheduled after the flip


@dataclass(frozen=True, kw_only=True)
class Resumed(Event):
    pass


@dataclass(frozen=True, kw_only=True)
class StepFailed(Event):
    step: str  # "pause", "swap", "fence_cache", "set_version", "resume", "drain"
    error: str


@dataclass(frozen=True, kw_only=True)
class EngineDied(Event):
    error: str


@dataclass(frozen=True, kw_only=True)
class EngineLeaving(Event):
    """The engine is on its way out (drained, or its server told to stop): see `leave`."""


@dataclass(frozen=True, kw_only=True)
class Timeout(Event):
    phase: str
    token: int


# ---------------------------------------------------------------------------------------------
