"""Whether a run can still make progress (`ProgressGuard`): events in, a verdict out, no I/O.

A run that cannot progress must stop and say why, not admit new groups forever: a reward that
raises on every rollout, a tool whose schema fails at every reset, an environment whose reset
raises. The guard sees every terminal rollout and every trainer step. Once no step has come for
`run.stall_s` while the trainer holds no batch (a step in progress is bounded by
`trainer.step_timeout_s` instead), its verdict is the reason to stop: when one error kind holds
at least `run.max_error_share` of the last `run.error_window` rollouts that ended completed or
errored, that kind with one example message (which names the function or tool at fault);
otherwise what the run was waiting on.
"""

from __future__ import annotations

from collections import Counter, deque


class ProgressGuard:
    def __init__(self, *, stall_s: float, max_error_share: float, window: int, started_at: float) -> None:
        self.stall_s, self.max_error_share = stall_s, max_error_share
        self.outcomes: deque[tuple[str, str]] = deque(maxlen=window)  # (status, error kind or "")
        self.examples: dict[str, str] = {}  # error kind -> its latest message
        self.last_progress = started_at

    def terminal(self, status: str, kind: str = "", message: str = "") -> None:
        """A rollout ended. Dropped ones (stale, a group given up, a stop) say nothing of the code."""
        if status == "completed":
            self.outcomes.append((status, ""))
        elif status == "errored":
            self.outcomes.append((status, kind))
            self.examples[kind] = message

    def step(self, at: float) -> None:
        self.last_progress = at

    def failing(self) -> tuple[str, float, int] | None:
        """(error kind, its share, rollouts counted) when one kind dominates the window."""
        if not self.outcomes:
            return None
        kinds = Counter(kind for status, kind in self.outcomes if status == "errored")
        if not kinds:
            return None
        kind, count = kinds.most_common(1)[0]
        share = count / len(self.outcomes)
        return (kind, share, len(self.outcomes)) if share >= self.max_error_share else None

    def verdict(self, now: float, *, trainer_busy: bool, waiting_on: str) -> str | None:
        """Why the run must stop now, or None."""
        stalled = now - self.last_progress
        if trainer_busy or stalled < self.stall_s:
            return None
        failing = self.failing()
        if failing is not None:
            kind, share, counted = failing
            return (f"no trainer step for {stalled:.0f}s (run.stall_s = {self.stall_s:g}): {share:.0%} of the last "
                    f"{counted} rollouts ended errored({kind}), e.g. {self.examples.get(kind, '')}")
        return f"no trainer step for {stalled:.0f}s (run.stall_s = {self.stall_s:g}), waiting on {waiting_on}"

    def note(self) -> str | None:
        """What /healthz and the display say while one error kind dominates (before any stop)."""
        failing = self.failing()
        if failing is None:
            return None
        kind, share, counted = failing
        return f"{share:.0%} of the last {counted} rollouts errored({kind}): {self.examples.get(kind, '')}"
