"""Pacing for just-in-time admission (`scheduler.admission = "just_in_time"`): what the scheduler
has observed of time, and whether a group admitted now is needed now.

Pure, like the scheduler: times arrive as event fields (`at`, monotonic seconds) and nothing
here reads a clock, so a decision is a function of the events alone.

The rule. A sample's staleness is set by the version live when it is dispatched, and a newer
version only appears when a trainer step ends (and its activation lands). So there is no gain in
admitting a group later unless a newer version goes live first: a group for trainer step `turn`
is admitted now exactly when waiting for the next version would make it late, i.e. when

    (when the next version goes live) + (a generation round)  >  (when the trainer asks for `turn`)

The estimates lean towards the trainer never waiting: the step time is the shortest of the last
few steps, the generation round the longest dispatch-to-complete time of the last few groups,
the activation lag the longest of the last few. In steady state with the trainer the bottleneck
this keeps the batch the trainer steps on plus the next one (staleness 1); when generation is the
bottleneck the condition holds for every turn and the admission bound of eager mode is reached.
Until a step time and a round have been observed (events without `at` tell nothing of time), it
admits only the batch the trainer needs next: the scheduler admits again as soon as it hands a
batch over, so generation runs one batch ahead of the trainer.
"""

from __future__ import annotations

from collections import deque

STEP_WINDOW = 3  # trainer steps remembered
ACTIVATION_WINDOW = 4  # activations remembered


class Pacer:
    def __init__(self, batch_groups: int) -> None:
        self.now: float | None = None
        self._started: dict[int, float] = {}  # open group id -> when its first member was dispatched
        # A batch is ready when its slowest group is: remember at least two batches' worth.
        self._rounds: deque[float] = deque(maxlen=max(4, 2 * batch_groups))
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._activations: deque[float] = deque(maxlen=ACTIVATION_WINDOW)
        self._submitted_at: float | None = None  # when the batch the trainer holds was handed to it
        self._published_at: dict[int, float] = {}  # published version -> when, until it goes live
        self._published: list[int] = []  # the last two published versions (the publish cadence)

    # -- observations --------------------------------------------------------------------------
    def observe(self, at: float | None) -> None:
        if at is not None:
            self.now = at if self.now is None else max(self.now, at)

    def group_dispatched(self, group_id: int) -> None:
        if self.now is not None:
            self._started[group_id] = self.now

    def group_complete(self, group_id: int) -> None:
        started = self._started.pop(group_id, None)
        if started is not None and self.now is not None:
            self._rounds.append(self.now - started)

    def group_gone(self, group_id: int) -> None:
        self._started.pop(group_id, None)

    def submitted(self) -> None:
        self._submitted_at = self.now

    def step_done(self, version: int | None) -> None:
        if self._submitted_at is not None and self.now is not None:
            self._steps.append(self.now - self._submitted_at)
        self._submitted_at = None
        if version is not None:
            self._published = [*self._published[-1:], version]
            if self.now is not None:
                self._published_at[version] = self.now

    def trainer_lost(self) -> None:
        self._submitted_at = None

    def version_live(self, version: int) -> None:
        published_at = self._published_at.get(version)
        if published_at is not None and self.now is not None:
            self._activations.append(self.now - published_at)
        for v in [v for v in self._published_at if v <= version]:
            del self._published_at[v]

    # -- estimates -----------------------------------------------------------------------------
    @property
    def step_time(self) -> float | None:
        return min(self._steps) if self._steps else None

    @property
    def round_time(self) -> float | None:
        return max(self._rounds) if self._rounds else None

    @property
    def activation_lag(self) -> float:
        # Planning only (never recorded): before any activation was seen, assume it is prompt.
        return max(self._activations) if self._activations else 0.0

    @property
    def publish_every(self) -> int:
        return self._published[1] - self._published[0] if len(self._published) == 2 else 1

    # -- the decision --------------------------------------------------------------------------
    def needed_now(self, turn: int, *, holding: bool, base: int, live: int, published: int) -> bool:
        """Is a group that trainer step `turn` will consume needed now? `base` is the step the
        trainer holds a batch for (`holding`), else the last step done (it needs base + 1 now)."""
        step, round_ = self.step_time, self.round_time
        if self.now is None or step is None or round_ is None:
            # Not yet paced: the batch the trainer needs next, one batch at a time (at start-up
            # every sample is of version 0 anyway; a lone batch also shows the true round).
            return turn <= base + 1
        now = self.now
        # When the trainer ends the step it holds (now, if it holds none or is late).
        end = max(now, self._submitted_at + step) if holding and self._submitted_at is not None else now
        asked_at = end + (turn - base - 1) * step
        return self._next_version_at(end, base, holding, live, published) + round_ > asked_at

    def _next_version_at(self, end: float, base: int, holding: bool, live: int, published: int) -> float:
        now, lag = self.now, self.activation_lag
        if published > live:  # published, its activation under way (the newest published goes live)
            at = self._published_at.get(published)
            return max(now, (at if at is not None else now) + lag)
        produced_by = published + self.publish_every  # the step that publishes the next version
        steps_away = max(produced_by - base, 0 if holding else 1)
        return end + steps_away * self.step_time + lag
