"""Crash safety of a run: the dispatch journal, and what `inflight run --resume` rebuilds.

The replay log holds one record per rollout, written when the rollout ends; a rollout in
flight at a crash has none. So before any request reaches an engine, its dispatch is made
durable in RUN_DIR/dispatch.journal (one JSON line per rollout, fsynced per batch of
dispatches). On --resume, every journalled rollout without a terminal record gets one
(`dropped: crashed`, with what the journal knows and nothing invented), completed rollouts
that no step consumed or discarded are restored into their groups (never redone), group and
rollout ids continue after the largest one used, and trainer steps that finished after the
orchestrator died get their consumption record from the trainer's checkpoint.

A torn last journal line (the crash hit the write) is a dispatch that was never sent: it is
ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec

from orchestrator.scheduling.scheduler import ROLLOUT_ID_STRIDE, RestoredGroup, RestoredRollout

JOURNAL = "dispatch.journal"
_encode = msgspec.json.encode
CRASHED = "crashed"  # drop reason of a rollout that was in flight when the orchestrator died


class JournalEntry(msgspec.Struct, frozen=True):
    rollout_id: int
    group_id: int
    engine: str
    version: int
    at: float


class DispatchJournal:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / JOURNAL
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _append(self, entries: list[JournalEntry]) -> None:
        # msgspec: the same JSON array a line (compact), about a tenth of json.dumps's time, which
        # this thread spends holding the GIL the run's loop needs (a batch is every rollout the loop
        # just dispatched).
        data = b"".join(_encode((e.rollout_id, e.group_id, e.engine, e.version, e.at)) + b"\n" for e in entries)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        os.fdatasync(self._fd)

    async def append(self, entries: list[JournalEntry]) -> None:
        """Durable when this returns (shielded: a dispatch is journalled whole or not at all)."""
        if entries:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._append, entries)

    def close(self) -> None:
        os.close(self._fd)


def read_journal(run_dir: Path) -> dict[int, JournalEntry]:
    path = Path(run_dir) / JOURNAL
    if not path.exists():
        return {}
    out: dict[int, JournalEntry] = {}
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            rid, gid, engine, version, at = json.loads(line)
        except ValueError:
            continue  # a torn line: its dispatch was never performed
        out[int(rid)] = JournalEntry(int(rid), int(gid), str(engine), int(version), float(at))
    return out


@dataclass
class ResumeState:
    """What the log, the journal and the trainer's checkpoints say about a crashed run."""

    next_group_id: int = 0
    lost: list[JournalEntry] = field(default_factory=list)  # in flight at the crash: no terminal record
    restored: list[RestoredGroup] = field(default_factory=list)
    records: dict[int, object] = field(default_factory=dict)  # completed, unconsumed: rollout id -> RolloutRecord
    consumed_steps: set[int] = field(default_factory=set)
    newest_activated: int = 0
    errored_per_group: dict[int, int] = field(default_factory=dict)


def load_resume_state(run_dir: Path, records) -> ResumeState:
    """Reconcile the records of the log with the dispatch journal."""
    from replay.records import ActivationRecord, ConsumptionRecord, RolloutRecord

    journal = read_journal(run_dir)
    state = ResumeState()
    terminal: dict[int, RolloutRecord] = {}
    settled: set[int] = set()  # consumed or discarded
    for record in records:
        if isinstance(record, RolloutRecord):
            terminal[record.rollout_id] = record
        elif isinstance(record, ConsumptionRecord):
            settled.update(record.rollout_ids)
            state.consumed_steps.add(record.step)
        elif isinstance(record, ActivationRecord):
            if record.outcome in ("activated", "engine_fenced"):
                state.newest_activated = max(state.newest_activated, record.version)
        elif type(record).__name__ == "DiscardRecord":
            settled.update(record.rollout_ids)
    groups = {e.group_id for e in journal.values()} | {r.group_id for r in terminal.values()}
    state.next_group_id = max(groups) + 1 if groups else 0
    state.lost = sorted((e for rid, e in journal.items() if rid not in terminal), key=lambda e: e.rollout_id)
    dispatched: dict[int, int] = {}
    for rid in set(journal) | set(terminal):
        gid = rid // ROLLOUT_ID_STRIDE
        dispatched[gid] = max(dispatched.get(gid, 0), rid % ROLLOUT_ID_STRIDE + 1)
    by_group: dict[int, list[RolloutRecord]] = {}
    for rid, record in terminal.items():
        if record.status_name == "completed" and rid not in settled:
            by_group.setdefault(record.group_id, []).append(record)
        elif record.status_name == "errored":
            state.errored_per_group[record.group_id] = state.errored_per_group.get(record.group_id, 0) + 1
    for gid, members in sorted(by_group.items()):
        members.sort(key=lambda r: r.rollout_id)
        state.records.update({r.rollout_id: r for r in members})
        state.restored.append(RestoredGroup(
            group_id=gid, version=min(r.dispatched_version for r in members),
            completed=tuple(RestoredRollout(rollout_id=r.rollout_id, version=r.dispatched_version) for r in members),
            dispatched=dispatched.get(gid, 0), retries=state.errored_per_group.get(gid, 0)))
    # A group whose every rollout was in flight at the crash has nothing to keep, but its prompt
    # (a dataset row) was never sampled to the end: it is sampled again, so no row is skipped.
    # (A group with a consumed or discarded member was dealt with: it is not restored.)
    settled_groups = {rid // ROLLOUT_ID_STRIDE for rid in settled}
    untouched = sorted({e.group_id for e in state.lost} - set(by_group) - settled_groups)
    for gid in untouched:
        state.restored.append(RestoredGroup(
            group_id=gid, version=max(e.version for e in state.lost if e.group_id == gid), completed=(),
            dispatched=dispatched.get(gid, 0), retries=state.errored_per_group.get(gid, 0)))
    state.restored.sort(key=lambda g: g.group_id)
    return state
