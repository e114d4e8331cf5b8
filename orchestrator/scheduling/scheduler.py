"""The rollout scheduler: a pure state machine (events in, actions out, no awaits).

It decides which rollouts to dispatch, where, when to hand a batch to the trainer, and what
becomes of every rollout; the loop (`orchestrator.run.loop`) performs its actions and feeds the
outcomes back. Like `activation.ActivationCoordinator`, it never does I/O, so its invariants
are tested over random event sequences (tests/unit/test_scheduler.py):

* every dispatched rollout gets exactly one `Terminal` (completed / dropped(reason) /
  errored(kind)), and nothing else does;
* no sample reaches the trainer beyond `max_off_policy_steps`: a batch for step s only holds
  rollouts dispatched at version v with (s - 1) - v <= max_off_policy_steps (by majority: v is
  the version of more than half of the rollout's tokens);
* admission keeps the rollouts dispatched but not yet consumed (in flight or completed and
  waiting) within (max_off_policy_steps + 1) x batch size; with `admission = "just_in_time"`
  it admits within that bound only what the trainer's next steps need in time
  (`orchestrator.scheduling.pacing`: paced by the `at` times the events carry);
* a completed rollout is consumed at most once, or discarded at most once, never both.

Versions and steps (one convention, docs/architecture.md): the base model is version 0; trainer step s
trains from version s - 1 and produces version s; a sample consumed by step s has staleness
(s - 1) - dispatched_version, so a synchronous run has staleness 0.

Engines come and go (`EngineUp` adds one it does not know, `EngineDown` stops sending to one,
`EngineLeft` forgets one): a rollout goes to the serving engine with the lowest rollouts in
flight / capacity (its max_num_seqs; `orchestrator.scheduling.placement`), and while fewer than
`min_engines` serve no new group is admitted (`admission_paused` says why; refills of admitted
groups go on).

Groups: GRPO samples every prompt `group_size` times. A group is dispatched at once to the
least-loaded serving engines; an errored member is replaced by a new rollout in the same group
(at most `max_retries` times per group, then the group is dropped: its in-flight members are
aborted and its completed ones discarded, reason "group_failed"). A group that can no longer
reach a trainer step within the staleness bound is dropped at once: in-flight members are
aborted (`dropped: stale`), completed ones discarded (`stale`). With `staleness_by = "majority"`
the bound applies to each completed member's majority version (`Finished.majority_version`, the
version of more than half its tokens) instead of the group's dispatched version; a member still
in flight is then never judged (its majority version is not known yet).

Rollout ids are `group_id * ROLLOUT_ID_STRIDE + k` (k counts the group's dispatches), so ids
are unique per run and deterministic: the prompt of a group is the task's prompt number
`group_id`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from orchestrator.config.run import SchedulerConfig
from orchestrator.scheduling.admission import Admission
from orchestrator.scheduling.groups import RestoredGroup, RestoredRollout, _Group, _Member  # noqa: F401 - re-exported
from orchestrator.scheduling.pacing import Pacer
from orchestrator.scheduling.placement import Placement

ROLLOUT_ID_STRIDE = 10_000

# Drop reasons and discard reasons (the strings replay.records stores).
STALE = "stale"
SHUTDOWN = "shutdown"
GROUP_FAILED = "group_failed"
ABORTED = "aborted"  # aborted by something other than the scheduler (an activation's abort policy)
TRAINER_LOST = "trainer_lost"


from orchestrator.scheduling.messages import (  # noqa: F401 - the scheduler's vocabulary, re-exported
    Abort,
    Action,
    Discard,
    Dispatch,
    EngineDown,
    EngineLeft,
    EngineUp,
    Event,
    Finished,
    SchedulerError,
    StepDone,
    Stop,
    SubmitBatch,
    Terminal,
    TrainerLost,
    VersionLive,
    majority_version,
)


class Scheduler(Admission):
    def __init__(self, config: SchedulerConfig, engines: Iterable[str], *, max_steps: int,
                 done_steps: int = 0, live_version: int = 0, published_version: int | None = None,
                 next_group_id: int = 0, max_groups: int | None = None,
                 capacities: Mapping[str, int] | None = None, min_engines: int = 1) -> None:
        """`capacities`: each engine's max_num_seqs (default 1 each: plain least-loaded);
        `min_engines`: no new group is admitted while fewer engines serve."""
        self.config = config.validate()
        # A finite task (a dataset's epochs) has this many prompts: no group id at or past it.
        self.max_groups = max_groups
        self.k = config.max_off_policy_steps
        self.n = config.group_size
        self.batch_size = config.batch_size
        self.max_steps = max_steps
        if min_engines < 1:
            raise SchedulerError(f"min_engines must be >= 1, got {min_engines}")
        self.min_engines = min_engines
        self.placement = Placement(engines, capacities)
        self.engines = self.placement.inflight  # known engine -> rollouts in flight (the same dict)
        if not self.engines:
            raise SchedulerError("no engine")
        self.down = self.placement.down  # known engines that take no new rollout
        # In flight on an engine that left: their end is counted on no engine (a namesake may join).
        self._departed: set[int] = set()
        self.done_steps = done_steps
        self.live = live_version
        self.published = done_steps if published_version is None else published_version
        self.batch_step: int | None = None  # the step whose batch the trainer holds
        self.submitted_steps = done_steps
        self.next_group_id = next_group_id
        self.groups: dict[int, _Group] = {}
        self.rollouts: dict[int, _Member] = {}  # in flight
        self.stopping = False
        self.terminals = 0
        self._batch: tuple[int, ...] = ()
        # Kept incrementally so that every event costs O(its own group), not O(all groups): at
        # thousands of rollouts in flight a scan per event would dominate (inflight bench).
        self._live = 0  # members in flight or completed, over every group (consumed ones too)
        self._waiting = 0  # groups open or complete
        self._complete: dict[int, _Group] = {}
        self._refill_due: set[int] = set()
        self._swept_for: int | None = None
        self._batch_groups: tuple[int, ...] = ()
        self.pacer = Pacer(config.batch_groups)
        self.by_majority = config.staleness_by == "majority"

    # -- queries -----------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return len(self.rollouts)

    @property
    def outstanding(self) -> int:
        """Rollouts dispatched and not yet consumed or ended: in flight, completed and waiting, or
        in the batch the trainer is stepping on (consumed once its step is done). Counting that
        batch is what makes (k + 1) x batch size the bound at which nothing goes stale in steady
        state: a rollout admitted now, at version v >= s - 1 while the trainer steps on s, is
        consumed by step s + k at the latest, with staleness (s + k - 1) - (s - 1) = k."""
        return self._live

    @property
    def admission_bound(self) -> int:
        return (self.k + 1) * self.batch_size

    @property
    def admission_paused(self) -> str | None:
        """Why no new group is admitted, in words, while fewer than `min_engines` engines serve."""
        n = self.placement.n_serving
        if n >= self.min_engines:
            return None
        serve = "engine serves" if n == 1 else "engines serve"
        return f"admission paused: {n} {serve}, fleet.min_engines = {self.min_engines}"

    @property
    def next_step(self) -> int:
        """The earliest step a group not yet handed to the trainer can be consumed by."""
        return (self.batch_step if self.batch_step is not None else self.done_steps) + 1

    def staleness_for(self, step: int, version: int) -> int:
        return (step - 1) - version

    @property
    def exhausted(self) -> bool:
        """The task has no prompt left and what remains can never fill another batch."""
        return (self.max_groups is not None and self.next_group_id >= self.max_groups and self.batch_step is None
                and not self.rollouts and len(self._complete) < self.config.batch_groups)

    @property
    def finished(self) -> bool:
        """Every step done (or stopping) and nothing in flight."""
        return (self.done_steps >= self.max_steps or self.stopping) and not self.rollouts and self.batch_step is None

    # -- set-up ------------------------------------------------------------------------------
    def restore(self, groups: Iterable[RestoredGroup]) -> None:
        """Groups of a crashed run whose completed rollouts no step consumed yet."""
        for r in groups:
            # A group with nothing completed is sampled afresh: at the live version, like a new one.
            version = r.version if r.completed else max(r.version, self.live)
            group = _Group(r.group_id, version, dispatched=r.dispatched, retries=r.retries)
            for rollout in r.completed:
                group.members[rollout.rollout_id] = _Member(rollout.rollout_id, r.group_id, None,
                                                            rollout.version, state="completed",
                                                            bound=rollout.bound_version)
            group.n_live = group.n_completed = len(r.completed)
            self._live += group.n_live
            self._add_group(group)
            if group.n_completed >= self.n:
                self._set_state(group, "complete")
            else:
                self._refill_due.add(group.group_id)
            self.next_group_id = max(self.next_group_id, r.group_id + 1)

    def start(self, at: float | None = None) -> list[Action]:
        self.pacer.observe(at)
        return self._sweep_stale() + self._refill_all() + self._admit_and_submit()

    # -- events ------------------------------------------------------------------------------
    def handle(self, event: Event) -> list[Action]:
        self.pacer.observe(event.at)
        if isinstance(event, Finished):
            actions = self._finished(event)
        elif isinstance(event, EngineDown):
            self.placement.set_down(event.engine)
            actions = []
        elif isinstance(event, EngineUp):
            self.placement.up(event.engine, event.capacity)
            actions = []  # groups waiting for an engine are refilled below
        elif isinstance(event, EngineLeft):
            self._engine_left(event.engine)
            actions = []
        elif isinstance(event, VersionLive):
            if event.version > self.live:
                self.pacer.version_live(event.version)
            self.live = max(self.live, event.version)
            actions = []
        elif isinstance(event, StepDone):
            actions = self._step_done(event)
        elif isinstance(event, TrainerLost):
            actions = self._trainer_lost(event)
        elif isinstance(event, Stop):
            return self._stop()
        else:
            raise SchedulerError(f"unknown event {event!r}")
        if self.stopping:
            return actions
        return actions + self._sweep_stale() + self._refill_all() + self._admit_and_submit()

    def _admit_and_submit(self) -> list[Action]:
        actions = self._admit()
        submitted = self._submit()
        # A batch handed over moves just-in-time admission on by a step (eager: the bound counts
        # that batch until its step is done, so nothing changes).
        return actions + submitted + (self._admit() if submitted else [])

    def _finished(self, event: Finished) -> list[Action]:
        member = self.rollouts.pop(event.rollout_id, None)
        if member is None:
            return []  # not in flight: a duplicate report; its terminal was written already
        if event.rollout_id in self._departed:
            self._departed.discard(event.rollout_id)
        else:
            self.placement.release(member.engine)
        group = self.groups[member.group_id]
        self.terminals += 1
        actions = self._outcome(member, group, event)
        if group.state == "dead" and group.n_live == 0:
            self.groups.pop(group.group_id, None)
        return actions

    def _outcome(self, member: _Member, group: _Group, event: Finished) -> list[Action]:
        if event.outcome == "completed":
            self._member_state(member, group, "completed")
            member.bound = member.version
            if self.by_majority and event.majority_version is not None:
                member.bound = max(member.version, event.majority_version)
            actions: list[Action] = [Terminal(rollout_id=member.rollout_id, status="completed")]
            if group.state == "dead":  # aborted too late: it finished first, nobody will consume it
                self._member_state(member, group, "ended")
                actions.append(Discard(rollout_ids=(member.rollout_id,), reason=group.dead_reason or STALE,
                                       step=self.next_step))
            elif self.by_majority and self.staleness_for(self.next_step, member.bound) > self.k:
                actions += self._kill_group(group, STALE)  # its majority is too old already
            elif group.n_completed == self.n and group.state == "open":
                self._set_state(group, "complete")
                self.pacer.group_complete(group.group_id)
            return actions
        self._member_state(member, group, "ended")
        if event.outcome == "aborted":
            reason = member.abort_reason or ABORTED
            actions = [Terminal(rollout_id=member.rollout_id, status="dropped", reason=reason,
                                message=event.message)]
            if member.abort_reason is None:  # not ours (an activation's abort policy): replace it
                actions += self._retry(group, f"rollout {member.rollout_id} aborted")
            return actions
        actions = [Terminal(rollout_id=member.rollout_id, status="errored", reason=event.kind or "error",
                            message=event.message)]
        return actions + self._retry(group, f"rollout {member.rollout_id} errored ({event.kind})")

    def _engine_left(self, engine: str) -> None:
        if engine in self.engines and self.placement.remove(engine):
            # Rollouts still on it (a drain ends them first; a lost engine's error later).
            self._departed.update(rid for rid, m in self.rollouts.items() if m.engine == engine)

    def _retry(self, group: _Group, why: str) -> list[Action]:
        if group.state != "open" or self.stopping:
            return []
        group.retries += 1
        if group.retries > self.config.max_retries:
            return self._kill_group(group, GROUP_FAILED)
        self._refill_due.add(group.group_id)  # _refill_all dispatches the replacement
        return []

    def _step_done(self, event: StepDone) -> list[Action]:
        if self.batch_step is None or event.step != self.batch_step:
            raise SchedulerError(f"step {event.step} done, but the trainer holds {self.batch_step}")
        self.done_steps = event.step
        self.batch_step = None
        self.pacer.step_done(event.version)
        if event.version is not None:
            self.published = max(self.published, event.version)
        self._drop_consumed()
        self._batch = ()
        return []

    def _drop_consumed(self) -> None:
        for rid in self._batch_groups:
            group = self.groups.pop(rid)
            self._live -= group.n_live
        self._batch_groups = ()

    def _trainer_lost(self, event: TrainerLost) -> list[Action]:
        if self.batch_step is None or event.step != self.batch_step:
            return []
        lost = self._batch
        self.pacer.trainer_lost()
        self._drop_consumed()
        self.batch_step, self._batch = None, ()
        self.submitted_steps = self.done_steps
        return [Discard(rollout_ids=lost, reason=TRAINER_LOST, step=event.step)] if lost else []

    def _stop(self) -> list[Action]:
        if self.stopping:
            return []
        self.stopping = True
        by_engine: dict[str, list[int]] = {}
        for member in self.rollouts.values():
            if member.abort_reason is None:
                member.abort_reason = SHUTDOWN
                by_engine.setdefault(member.engine or "", []).append(member.rollout_id)
        return [Abort(engine=e, rollout_ids=tuple(ids), reason=SHUTDOWN) for e, ids in by_engine.items()]

    # -- policy ------------------------------------------------------------------------------
    def _sweep_stale(self) -> list[Action]:
        """Groups that can no longer reach a step within the bound are dropped now."""
        actions: list[Action] = []
        step = self.next_step
        if step == self._swept_for:  # staleness only changes with the step: nothing new to find
            return actions
        self._swept_for = step
        for group in list(self.groups.values()):
            if group.state not in ("open", "complete"):
                continue
            bound = self._bound_version(group)
            if bound is not None and self.staleness_for(step, bound) > self.k:
                actions += self._kill_group(group, STALE)
        return actions

    def _bound_version(self, group: _Group) -> int | None:
        """The version the staleness bound applies to for `group`: the version it was dispatched
        at; by majority, the oldest majority version among its completed members (None: none
        completed yet, nothing to judge)."""
        if not self.by_majority:
            return group.version
        bounds = [m.bound for m in group.completed() if m.bound is not None]
        return min(bounds) if bounds else None

    def _kill_group(self, group: _Group, reason: str) -> list[Action]:
        self._set_state(group, "dead")
        group.dead_reason = reason
        self._refill_due.discard(group.group_id)
        self.pacer.group_gone(group.group_id)
        actions: list[Action] = []
        done = tuple(m.rollout_id for m in group.completed())
        for m in group.completed():
            self._member_state(m, group, "ended")
        if done:
            actions.append(Discard(rollout_ids=done, reason=reason, step=self.next_step))
        by_engine: dict[str, list[int]] = {}
        for m in group.inflight():
            if m.abort_reason is None:
                m.abort_reason = reason
                by_engine.setdefault(m.engine or "", []).append(m.rollout_id)
        actions += [Abort(engine=e, rollout_ids=tuple(ids), reason=reason) for e, ids in by_engine.items()]
        if group.n_live == 0:
            del self.groups[group.group_id]
        return actions

    # -- bookkeeping -------------------------------------------------------------------------
    def _add_group(self, group: _Group) -> None:
        self.groups[group.group_id] = group
        self._waiting += 1

    def _set_state(self, group: _Group, state: str) -> None:
        waiting = ("open", "complete")
        self._waiting += (state in waiting) - (group.state in waiting)
        if group.state == "complete":
            self._complete.pop(group.group_id, None)
        if state == "complete":
            self._complete[group.group_id] = group
        group.state = state

    def _member_state(self, member: _Member, group: _Group, state: str) -> None:
        live = ("inflight", "completed")
        delta = (state in live) - (member.state in live)
        group.n_live += delta
        self._live += delta
        group.n_completed += (state == "completed") - (member.state == "completed")
        member.state = state

    def _new_group(self) -> list[Action]:
        group = _Group(self.next_group_id, self.live)
        self.next_group_id += 1
        self._add_group(group)
        self.pacer.group_dispatched(group.group_id)
        return self._refill(group)

    def _refill_all(self) -> list[Action]:
        if self.stopping or not self.placement.n_serving:
            return []
        actions: list[Action] = []
        for gid in sorted(self._refill_due):
            group = self.groups.get(gid)
            if group is None or group.state != "open":
                self._refill_due.discard(gid)
                continue
            actions += self._refill(group)
        return actions

    def _refill(self, group: _Group) -> list[Action]:
        """Dispatch members until the group has `group_size` live ones."""
        actions: list[Action] = []
        if not self.placement.n_serving:
            self._refill_due.add(group.group_id)  # when an engine serves again
            return actions
        self._refill_due.discard(group.group_id)
        while group.n_live < self.n:
            if group.dispatched >= ROLLOUT_ID_STRIDE:
                return actions + self._kill_group(group, GROUP_FAILED)
            engine = self.placement.place()
            rid = group.group_id * ROLLOUT_ID_STRIDE + group.dispatched
            group.dispatched += 1
            member = _Member(rid, group.group_id, engine, max(self.live, group.version))
            group.members[rid] = member
            group.n_live += 1
            self._live += 1
            self.rollouts[rid] = member
            actions.append(Dispatch(rollout_id=rid, group_id=group.group_id, engine=engine, version=member.version))
        return actions

    def _submit(self) -> list[Action]:
        if self.batch_step is not None or self.stopping or self.submitted_steps >= self.max_steps:
            return []
        step = self.done_steps + 1
        if len(self._complete) < self.config.batch_groups:
            return []
        ready = sorted((g for g in self._complete.values()
                        if self.staleness_for(step, self._bound_version(g)) <= self.k),
                       key=lambda g: g.group_id)
        if len(ready) < self.config.batch_groups:
            return []
        chosen = ready[: self.config.batch_groups]
        rollout_ids: list[int] = []
        for group in chosen:
            self._set_state(group, "consumed")
            rollout_ids += sorted(m.rollout_id for m in group.completed())
        self._batch_groups = tuple(g.group_id for g in chosen)
        self.batch_step = step
        self.pacer.submitted()
        self.submitted_steps = step
        self._batch = tuple(rollout_ids)
        return [SubmitBatch(step=step, group_ids=tuple(g.group_id for g in chosen), rollout_ids=tuple(rollout_ids))]


def group_of(rollout_id: int) -> int:
    return rollout_id // ROLLOUT_ID_STRIDE
