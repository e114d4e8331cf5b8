"""Where the scheduler sends a rollout: the engines it knows, each one's capacity (its
max_num_seqs) and rollouts in flight, and which of them serve. Plain bookkeeping, no I/O; the
rules (when to dispatch) live in `orchestrator.scheduling.scheduler`.

A rollout goes to the serving engine with the lowest load, rollouts in flight / capacity, ties
to the engine added first: with equal capacities that is the least-loaded engine, and an engine
with twice the capacity takes about twice the rollouts. The choice costs O(log engines), not a
scan of the fleet per dispatch (hundreds of engines, thousands of dispatches a second): a heap
of (load, order, engine) entries, pushed whenever an engine's load changes, where an entry that
no longer matches its engine (its load moved, it went down or left) is skipped when it surfaces.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping

from orchestrator.scheduling.messages import SchedulerError


def mean_capacity(capacities: Iterable[int]) -> int:
    """The capacity an engine of unknown capacity is given: the mean of the known ones (1 if none)."""
    values = list(capacities)
    return max(1, round(sum(values) / len(values))) if values else 1


class Placement:
    def __init__(self, engines: Iterable[str], capacities: Mapping[str, int] | None = None) -> None:
        self.inflight: dict[str, int] = {}  # known engine -> rollouts in flight on it
        self.capacity: dict[str, int] = {}  # known engine -> the rollouts it runs at once
        self.down: set[str] = set()  # known engines that take no new rollout
        self._order: dict[str, int] = {}  # known engine -> when it was added (ties go to the first)
        self._added = itertools.count()
        self._heap: list[tuple[float, int, str]] = []
        engines, capacities = list(engines), dict(capacities or {})
        for engine in set(capacities) - set(engines):
            raise SchedulerError(f"a capacity for {engine!r}, which is not one of the engines")
        # An engine missing from `capacities` gets the mean of those given (1 when none is).
        default = mean_capacity(capacities.values())
        for engine in engines:
            self.up(engine, capacities.get(engine, default))

    @property
    def n_serving(self) -> int:
        return len(self.inflight) - len(self.down)  # `down` holds known engines only

    def up(self, engine: str, capacity: int | None = None) -> None:
        """The engine serves: a known one again (its capacity updated when given), an unknown
        one joins with `capacity`, or the mean of the known ones when None."""
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise SchedulerError(f"engine {engine!r}: capacity must be an int >= 1, got {capacity!r}")
        if engine not in self.inflight:
            self.capacity[engine] = capacity if capacity is not None else mean_capacity(self.capacity.values())
            self.inflight[engine] = 0
            self._order[engine] = next(self._added)
        elif capacity is not None:
            self.capacity[engine] = capacity
        self.down.discard(engine)
        self._push(engine)

    def set_down(self, engine: str) -> None:
        if engine in self.inflight:
            self.down.add(engine)  # its heap entries are skipped from now on

    def remove(self, engine: str) -> int:
        """Forget the engine; returns the rollouts still counted on it."""
        self.down.discard(engine)
        self.capacity.pop(engine, None)
        self._order.pop(engine, None)
        return self.inflight.pop(engine, 0)

    def place(self) -> str:
        """The serving engine with the lowest load, now counting one more rollout."""
        heap = self._heap
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        if not heap:
            raise LookupError("no engine serves")
        engine = heap[0][2]
        self.inflight[engine] += 1
        heapq.heapreplace(heap, self._entry(engine))
        return engine

    def release(self, engine: str) -> None:
        """A rollout counted on `engine` ended."""
        if engine in self.inflight:
            self.inflight[engine] -= 1
            self._push(engine)

    def _entry(self, engine: str) -> tuple[float, int, str]:
        return self.inflight[engine] / self.capacity[engine], self._order[engine], engine

    def _current(self, entry: tuple[float, int, str]) -> bool:
        load, order, engine = entry
        return (self._order.get(engine) == order and engine not in self.down
                and load == self.inflight[engine] / self.capacity[engine])

    def _push(self, engine: str) -> None:
        if engine in self.down:
            return
        heapq.heappush(self._heap, self._entry(engine))
        # Skipped entries pile up where nothing pops them (loads that only grew): rebuilt from
        # the engines once they outnumber them, O(engines) every O(engines) pushes.
        if len(self._heap) > 2 * len(self.inflight) + 32:
            self._heap = [self._entry(e) for e in self.inflight if e not in self.down]
            heapq.heapify(self._heap)
