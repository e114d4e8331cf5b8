"""The activation coordinator's messages: the actions it returns and the events it takes
(see `orchestrator.activation`). Frozen dataclasses; `at` is the performer's monotonic clock."""

from __future__ import annotations

from dataclasses import dataclass, field

ACTIVATED = "activated"  # the same string as replay.records.ACTIVATED


# ---------------------------------------------------------------------------------------------
# Actions (what the performer must do)


@dataclass(frozen=True)
class Action:
    engine: str | None = None


@dataclass(frozen=True)
class Stage(Action):
    version: int = 0
    rollback: bool = False  # the engine's other buffer already holds the weights (double buffering)


@dataclass(frozen=True)
class DropStaged(Action):
    version: int = 0


@dataclass(frozen=True)
class Drain(Action):
    """Stop admitting new requests to the engine and wait for its in-flight ones to finish."""


@dataclass(frozen=True)
class AbortInflight(Action):
    """Abort the engine's in-flight requests (they are dispatched again)."""


@dataclass(frozen=True)
class Pause(Action):
    mode: str = "keep"
    clear_cache: bool = True


@dataclass(frozen=True)
class Swap(Action):
    version: int = 0
    rollback: bool = False
    between_steps: bool = False  # the pause-free flip: no pause around it


@dataclass(frozen=True)
class FenceCache(Action):
    pass


@dataclass(frozen=True)
class SetVersion(Action):
    version: int = 0


@dataclass(frozen=True)
class Resume(Action):
    pass


@dataclass(frozen=True)
class Fence(Action):
    reason: str = ""


@dataclass(frozen=True)
class Unfence(Action):
    version: int = 0


@dataclass(frozen=True)
class StartTimer(Action):
    phase: str = ""
    token: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class EngineOutcome:
    engine: str
    outcome: str  # ACTIVATED, ENGINE_FENCED, ROLLED_BACK
    transfer_s: float = 0.0
    pause_s: float = 0.0
    swapped_requests: dict[str, int] = field(default_factory=dict)  # request id -> tokens at the swap


@dataclass(frozen=True)
class Record(Action):
    version: int = 0
    outcome: str = ACTIVATED
    engines: tuple[EngineOutcome, ...] = ()
    strategy: str = ""
    kv_policy: str = ""
    kv_carried: bool = False
    message: str = ""
    at: float = 0.0


# ---------------------------------------------------------------------------------------------
# Events (what happened; `at` is the performer's monotonic clock)


@dataclass(frozen=True)
class Event:
    engine: str | None = None
    at: float = 0.0


@dataclass(frozen=True)
class Staged(Event):
    version: int = 0


@dataclass(frozen=True)
class StageFailed(Event):
    version: int = 0
    error: str = ""


@dataclass(frozen=True)
class Drained(Event):
    pass


@dataclass(frozen=True)
class Paused(Event):
    pass


@dataclass(frozen=True)
class Swapped(Event):
    version: int = 0
    requests: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheFenced(Event):
    pass


@dataclass(frozen=True)
class VersionSet(Event):
    version: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # requests first scheduled after the flip


@dataclass(frozen=True)
class Resumed(Event):
    pass


@dataclass(frozen=True)
class StepFailed(Event):
    step: str = ""  # "pause", "swap", "fence_cache", "set_version", "resume", "drain"
    error: str = ""


@dataclass(frozen=True)
class EngineDied(Event):
    error: str = ""


@dataclass(frozen=True)
class Timeout(Event):
    phase: str = ""
    token: int = 0


# ---------------------------------------------------------------------------------------------
