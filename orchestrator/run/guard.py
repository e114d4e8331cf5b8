"""Whether a run can still make progress (`ProgressGuard`): events in, a verdict out, no I/O.

A run that cannot progress must stop and say why, not admit new groups forever: a reward that
raises on every rollout, a tool whose schema fails at every reset, an environment whose reset
raises. The guard sees every terminal rollout and every trainer step. Once no step has come for
`run.stall_s` while the trainer holds no batch (a step in progress is bounded by
`trainer.step_timeout_s` instead), its verdict is the reason to stop: when one error kind holds
at least `run.max_error_share` of the last `run.error_window` rollouts that ended completed or
errored, that kind with one example message (which names the function or tool at fault);
otherwise what the run was waiting on. When the last rollouts errored, every one, by the user's
code, and there are a batch's worth of them or a full window, whichever is fewer (no batch can
fill: a reward that always raises or hangs, a broken tool), the wait is the shorter
`run.all_errored_s`, counted from the last step or completion; errors of the engines' side are
the fleet's to bound (`fleet.min_engines_wait_s`), not this.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque

from orchestrator.run.episodes import ENVIRONMENT_ERROR, ENVIRONMENT_TIMEOUT, NO_REWARD
from orchestrator.scoring.outcome import REWARD_ERROR, REWARD_TIMEOUT

# The error kinds of the user's code. Any other is the engines' or the run's (an engine that died
# or timed out, a fenced one, a missing logprob): a run of those is the fleet's to bound
# (`fleet.min_engines_wait_s`), not this.
USER_CODE_KINDS = frozenset({REWARD_ERROR, REWARD_TIMEOUT, ENVIRONMENT_ERROR, ENVIRONMENT_TIMEOUT, NO_REWARD})


class ProgressGuard:
    def __init__(self, *, stall_s: float, max_error_share: float, window: int, started_at: float,
                 all_errored_s: float | None = None, batch_rollouts: int | None = None) -> None:
        self.stall_s, self.max_error_share = stall_s, max_error_share
        self.all_errored_s = stall_s if all_errored_s is None else min(stall_s, all_errored_s)
        # How many rollouts in a row, all errored, make the run hopeless: a batch's worth (a reward
        # that hangs to its timeout fills a window of 256 only in minutes), at most the window.
        self.hopeless_after = window if batch_rollouts is None else max(1, min(window, batch_rollouts))
        self.outcomes: deque[tuple[str, str]] = deque(maxlen=window)  # (status, error kind or "")
        self.examples: dict[str, str] = {}  # error kind -> its latest message
        self.last_progress = started_at
        self.last_completed = started_at  # a completion restarts the all-errored clock

    def terminal(self, status: str, kind: str = "", message: str = "", at: float | None = None) -> None:
        """A rollout ended (at `at`, monotonic, where the caller says). Dropped ones (stale, a group
        given up, a stop) say nothing of the code."""
        if status == "completed":
            self.outcomes.append((status, ""))
            if at is not None:
                self.last_completed = at
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

    def nothing_completes(self) -> bool:
        """The last `hopeless_after` rollouts errored, every one, by the user's code: no batch can fill."""
        if len(self.outcomes) < self.hopeless_after:
            return False
        last = itertools.islice(reversed(self.outcomes), self.hopeless_after)
        return all(status == "errored" and kind in USER_CODE_KINDS for status, kind in last)

    def verdict(self, now: float, *, trainer_busy: bool, waiting_on: str) -> str | None:
        """Why the run must stop now, or None."""
        stalled = now - self.last_progress
        if trainer_busy:
            return None
        if self.nothing_completes():
            # Counted from the last step or completion, whichever is later: a short outage of a
            # judge in a run whose trainer waits long for its batches does not stop it at once.
            if now - max(self.last_progress, self.last_completed) < self.all_errored_s:
                return None
            # Each kind of the rollouts that made it hopeless, most frequent first, with an example.
            last = itertools.islice(reversed(self.outcomes), self.hopeless_after)
            kinds = Counter(kind for _status, kind in last).most_common()
            counts = ", ".join(f"errored({kind}) {count}" for kind, count in kinds)
            return (f"no trainer step for {stalled:.0f}s (run.all_errored_s = {self.all_errored_s:g}): the last "
                    f"{self.hopeless_after} rollouts all errored: {counts}, e.g. {self.examples.get(kinds[0][0], '')}")
        if stalled < self.stall_s:
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
