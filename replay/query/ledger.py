"""What happened to a rollout after generation: the one rule, used by statistics and export.

A completed rollout is *claimed* by a trainer step that consumed it (a `ConsumptionRecord`
naming it, or the rollout record's own `consumed_step`, which counts at the rollout record's
place in the log) or by a discard (a `DiscardRecord` naming it). It can be claimed once:

    the first claim in log order wins; every later claim on the same rollout id is an invalid
    consumption, counted (`invalid_consumptions`) and never merged.

So a rollout consumed twice keeps its first step, and a rollout both consumed and discarded is
whichever came first. Claims may come before the rollout record they name (they wait in
`pending`); claims naming a rollout that never appears are unmatched.

The owner of the decisions (ColumnBuilder keeps them in columns, export in a dict) tells the
ledger whether a rollout is already decided; the ledger applies the rule and counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final, NamedTuple

from replay.records import ConsumptionRecord, DiscardRecord

CONSUMED: Final = "consumed"
DISCARDED: Final = "discarded"


class Claim(NamedTuple):
    """One claim on a rollout: consumed by trainer step `step`, or discarded for `reason`."""

    kind: str  # CONSUMED or DISCARDED
    step: int | None  # the consuming step; for a discard, the step it was too stale for / lost with
    reason: str | None = None  # the discard reason
    record: ConsumptionRecord | DiscardRecord | None = None  # None: the rollout's own consumed_step
    index: int = -1  # position of the rollout id in record.rollout_ids


def claims_of(record: ConsumptionRecord | DiscardRecord) -> Iterator[tuple[int, Claim]]:
    """(rollout id, claim) for every rollout a consumption or discard record names, in order."""
    if isinstance(record, ConsumptionRecord):
        for index, rollout_id in enumerate(record.rollout_ids):
            yield rollout_id, Claim(CONSUMED, record.step, None, record, index)
    else:
        for index, rollout_id in enumerate(record.rollout_ids):
            yield rollout_id, Claim(DISCARDED, record.step, record.reason, record, index)


class Ledger:
    """Applies the rule (see the module doc) to claims fed in log order."""

    def __init__(self) -> None:
        self.pending: dict[int, Claim] = {}  # first claims on rollouts not seen yet
        self.invalid = 0

    def claim(self, rollout_id: int, claim: Claim, decided: bool | None) -> bool:
        """A claim by a consumption or discard record. `decided`: None if no record of the
        rollout has been seen yet, else whether an earlier claim already decided it. True when
        this claim decides the rollout now (the owner records it)."""
        if decided is None:
            if rollout_id in self.pending:
                self.invalid += 1
            else:
                self.pending[rollout_id] = claim
            return False
        if decided:
            self.invalid += 1
            return False
        return True

    def arrive(self, rollout_id: int, consumed_step: int | None) -> Claim | None:
        """A rollout record arrives, with its own `consumed_step` (a claim at its place in the
        log): the claim that decides it so far, if any."""
        pending = self.pending.pop(rollout_id, None) if self.pending else None
        if pending is not None:
            if consumed_step is not None:
                self.invalid += 1  # the earlier claim wins
            return pending
        return None if consumed_step is None else Claim(CONSUMED, consumed_step)

    def unmatched(self, kind: str) -> int:
        """Rollout ids claimed (first claim of this kind) by records that name no rollout seen."""
        return sum(1 for claim in self.pending.values() if claim.kind == kind)
