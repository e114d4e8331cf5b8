"""The scheduler's bookkeeping types: a group of rollouts (one prompt, GRPO) and its members, and
what a resumed run restores of them. Plain data; the rules live in `orchestrator.scheduling.scheduler`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Member:
    rollout_id: int
    group_id: int
    engine: str | None
    version: int
    state: str = "inflight"  # inflight, completed, ended (dropped or errored)
    abort_reason: str | None = None
    bound: int | None = None  # the version the staleness bound applies to, once completed


@dataclass
class _Group:
    group_id: int
    version: int  # the version its first member was dispatched at (<= every member's)
    members: dict[int, _Member] = field(default_factory=dict)
    dispatched: int = 0  # dispatches so far (the next rollout id's suffix)
    retries: int = 0
    state: str = "open"  # open, complete, consumed, dead
    dead_reason: str | None = None
    n_live: int = 0  # members in flight or completed (not ended)
    n_completed: int = 0

    def live_members(self) -> list[_Member]:
        return [m for m in self.members.values() if m.state in ("inflight", "completed")]

    def completed(self) -> list[_Member]:
        return [m for m in self.members.values() if m.state == "completed"]

    def inflight(self) -> list[_Member]:
        return [m for m in self.members.values() if m.state == "inflight"]


@dataclass(frozen=True, kw_only=True)
class RestoredRollout:
    rollout_id: int
    version: int
    majority: int | None = None  # its majority version (`scheduler_messages.majority_version`), if known

    @property
    def bound_version(self) -> int:
        return self.version if self.majority is None else max(self.version, self.majority)


@dataclass(frozen=True, kw_only=True)
class RestoredGroup:
    """A group found in the log on --resume: its completed, unconsumed rollouts."""

    group_id: int
    version: int
    completed: tuple[RestoredRollout, ...]
    dispatched: int  # rollouts the group already dispatched (ids are never reused)
    retries: int = 0
