"""Where `inflight run`'s start-up time goes: each phase's seconds, from the command's start.

Phases that run side by side (the trainer, every engine, the scoring workers) are each timed on
their own; `to_first_rollout_s` and `to_first_batch_s` are from the command's start (the
process's creation, so Python's imports count) to the first dispatch and to the first batch
handed to the trainer. What was not observed is absent (a resumed run that restores nothing
has no `restore_s`; a process whose start time cannot be read times from `Run`'s creation).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


def process_age_s() -> float | None:
    """Seconds since this process was created (Linux /proc), or None where that is unknown."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # Field 22 (starttime, clock ticks after boot); the command name (field 2) may hold spaces.
            fields = f.read().rsplit(b")", 1)[1].split()
        started_ticks = int(fields[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    def __init__(self) -> None:
        now = time.monotonic()
        age = process_age_s()
        self.origin = now - age if age is not None else now
        self.phases: dict[str, float] = {}
        if age is not None:
            self.phases["process_s"] = age  # interpreter start and imports, before `Run` existed
        self.to_first_rollout_s: float | None = None
        self.to_first_batch_s: float | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[f"{name}_s"] = time.monotonic() - started

    def first_rollout(self) -> None:
        if self.to_first_rollout_s is None:
            self.to_first_rollout_s = time.monotonic() - self.origin

    def first_batch(self) -> bool:
        """Note the first batch handed to the trainer; True the first time only."""
        if self.to_first_batch_s is not None:
            return False
        self.to_first_batch_s = time.monotonic() - self.origin
        return True

    def as_dict(self) -> dict:
        out: dict = {k: round(v, 3) for k, v in self.phases.items()}
        if self.to_first_rollout_s is not None:
            out["to_first_rollout_s"] = round(self.to_first_rollout_s, 3)
        if self.to_first_batch_s is not None:
            out["to_first_batch_s"] = round(self.to_first_batch_s, 3)
        return out

    def line(self) -> str:
        """One line for the summary: the path to the first batch, phase by phase."""
        p = self.phases

        def part(label: str, key: str) -> str | None:
            return f"{label} {p[key]:.1f}" if key in p else None

        # The trainer starts first and loads beside the task's build; the engines and the scoring
        # workers start once the task is built (`Run._setup`).
        after_task = " | ".join(x for x in (part("engines", "engines_s"), part("scoring", "scoring_s")) if x)
        task = ", then ".join(x for x in (part("task", "task_s"), after_task) if x)
        side_by_side = " | ".join(x for x in (part("trainer", "trainer_s"), task) if x)
        parts = [x for x in (part("process", "process_s"), part("model", "model_s"),
                             f"[{side_by_side}]" if side_by_side else None, part("fleet", "fleet_s"),
                             part("restore", "restore_s")) if x]
        head = (f"first rollout at {self.to_first_rollout_s:.1f}s" if self.to_first_rollout_s is not None
                else "no rollout dispatched")
        tail = f", first batch at {self.to_first_batch_s:.1f}s" if self.to_first_batch_s is not None else ""
        return f"{head}{tail}  ({', '.join(parts)})"
