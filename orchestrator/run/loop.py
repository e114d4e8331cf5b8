"""`inflight run`: one anyio task group that keeps rollouts in flight while the trainer steps.

    engines (Fleet) ──tokens──> rollout tasks ──Finished──> Scheduler ──actions──> perform
    trainer ──StepDone──> consumption record, Scheduler, publish -> activator -> Fleet.activate
    Recorder (writer thread) <── every record;  HTTP /stats /metrics /healthz;  progress

The scheduler and the activation coordinator decide; this module only performs their actions
and feeds back what happened. Every dispatched rollout ends in exactly one terminal record:
the scheduler emits it, `perform` writes it. On SIGINT/SIGTERM (`Run._interrupts` calls
`request_stop`) the run stops admitting, aborts what is in flight, gives every rollout its
record within `run.shutdown_grace_s`, lets the trainer finish the step it holds, flushes the
log, stops trainer and engines and exits 0; a second SIGINT exits 130 at once.
"""

from __future__ import annotations

import time

import anyio

from orchestrator.errors import ActivationError, EngineError
from orchestrator.observe.logging import get_logger
from orchestrator.observe.progress import StepLine
from orchestrator.run.activator import run_activator
from orchestrator.run.dispatch import ReadyQueue
from orchestrator.run.episodes import episode_rollout
from orchestrator.run.eval import run_evaluations
from orchestrator.run.fleet_keeper import FleetKeeper
from orchestrator.run.guard import ProgressGuard
from orchestrator.run.recording import RolloutContext, build_rollout_record
from orchestrator.run.records import InFlight, consumption_record, request_id, reward_components, settled
from orchestrator.run.resume import JournalEntry
from orchestrator.run.watchers import watch_loop_lag, watch_progress
from orchestrator.scheduling import scheduler as sch
from orchestrator.scoring.outcome import ScoreFailed
from orchestrator.trainer.link import Batch, Failed, Sample, StepDone

log = get_logger(__name__)


class RunLoop:
    """The running part of a run; `orchestrator.run.run.Run` sets it up and tears it down."""

    def __init__(self, run) -> None:
        self.run = run  # orchestrator.run.run.Run: config, fleet, scheduler, recorder, trainer, task, ...
        self.inflight: dict[int, InFlight] = {}  # rollout id -> its one record while the loop holds it
        self.prompts: dict[int, object] = {}  # group id -> its prompt, while the scheduler holds the group
        self.batch: tuple[int, tuple[int, ...], float] | None = None
        self.stop_requested = anyio.Event()
        self.stop_reason = ""
        self.failure: str | None = None
        self.wanted_version = 0
        self._version_wanted = anyio.Event()
        self._tg = None
        self._rollout_scope: anyio.CancelScope | None = None
        self._pending_dispatch: list[sch.Dispatch] = []
        self._dispatch_wakeup = anyio.Event()
        # Held by an activation and by a fenced engine's rejoin (never by an evaluation, which
        # runs beside activations: orchestrator/run/eval.py).
        self.activation_lock = anyio.Lock()
        self.eval_wanted = anyio.Event()
        self.lost_batches: list[sch.Discard] = []  # batches of a lost trainer, settled at teardown
        self.aborting: set[int] = set()  # rollouts the scheduler asked to abort, until they end
        rc = run.config.run
        self.keeper = FleetKeeper(self)
        self._asking_leaving: set[str] = set()  # engines whose server is being asked if it leaves
        self.guard = ProgressGuard(stall_s=rc.stall_s, max_error_share=rc.max_error_share, window=rc.error_window,
                                   started_at=time.monotonic(), all_errored_s=rc.all_errored_s,
                                   batch_rollouts=run.config.scheduler.batch_size)

    def restore_completed(self, records: dict) -> None:
        """Completed, unconsumed rollouts of a crashed run (resume.py): their groups are
        restored in the scheduler, so their samples must be ready for a batch."""
        from orchestrator.fleet.rollouts import FleetCompletion

        for rid, r in records.items():
            ctx = RolloutContext(rid, r.group_id, r.prompt_id, tuple(r.prompt_tokens().tolist()),
                                 r.timings.dispatched_at, r.dispatched_version, r.engine_id)
            completion = FleetCompletion(
                str(rid), r.engine_id, list(ctx.prompt_token_ids), r.completion_tokens().tolist(),
                r.logprobs().tolist(), r.change_points(), r.dispatched_version, r.kv_carried_across_versions,
                "completed")
            self.inflight[rid] = InFlight(None, r.timings.dispatched_at, ctx, completion, dict(r.rewards), r)

    # -- the task group ----------------------------------------------------------------------
    async def main(self, restored_actions: list) -> None:
        self.guard.step(time.monotonic())  # the stall is counted from the first rollout, not the start-up
        # Read when /metrics is scraped: set on every rollout's start and end it took a lock each time.
        self.run.metrics.inflight.set_function(lambda: self.run.scheduler.inflight)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._trainer_messages)
            tg.start_soon(run_activator, self)
            tg.start_soon(watch_loop_lag, self.run.metrics)
            tg.start_soon(self._dispatcher)
            tg.start_soon(watch_progress, self)
            tg.start_soon(self.keeper.main)
            if getattr(self.run, "evaluator", None) is not None:
                tg.start_soon(run_evaluations, self)
            if getattr(self.run, "cluster", None) is not None:
                from orchestrator.run.cluster import watch_engines

                tg.start_soon(watch_engines, self)
            self.perform(restored_actions)
            await self.stop_requested.wait()
            await self._shutdown()
            tg.cancel_scope.cancel()

    def request_stop(self, reason: str, failure: str | None = None) -> None:
        if failure and not self.failure:
            self.failure = failure
        if not self.stop_requested.is_set():
            self.stop_reason = reason
            log.info("run.stopping", reason=reason, failure=failure)
            self.run.progress.state.status = f"stopping ({reason})"
            self.run.progress.refresh()
            self.stop_requested.set()

    # -- performing the scheduler's actions -------------------------------------------------
    def perform(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, sch.Dispatch):
                self.inflight[a.rollout_id] = InFlight(a, time.time())
                self._pending_dispatch.append(a)
                self._dispatch_wakeup.set()
            elif isinstance(a, sch.Terminal):
                self._write_terminal(a)
            elif isinstance(a, sch.Discard):
                self._discard(a)
            elif isinstance(a, sch.Abort):
                # Queued rollouts (not started) end when their worker takes them; started ones
                # (streaming, or waiting at a drain gate) are aborted in the fleet, one call per engine.
                self.aborting.update(rid for rid in a.rollout_ids if rid in self.inflight)
                ids = [request_id(rid) for rid in a.rollout_ids]
                self._tg.start_soon(self.run.fleet.abort_many, ids)
            elif isinstance(a, sch.SubmitBatch):
                self._submit(a)
        self.run.progress.state.inflight = self.run.scheduler.inflight
        if self.run.scheduler.exhausted:
            self.request_stop("task exhausted")

    def handle(self, event) -> None:
        self.perform(self.run.scheduler.handle(event))

    async def _dispatcher(self) -> None:
        """Journals each batch of dispatches durably, then hands them to the rollout workers
        (long-lived tasks, one per rollout that may be in flight: a task per rollout cost
        about a third of the throughput in `inflight bench orchestrator`)."""
        ready = ReadyQueue()
        workers = 0
        async with anyio.create_task_group() as rollouts:
            self._rollout_scope = rollouts.cancel_scope
            while True:
                await self._dispatch_wakeup.wait()
                self._dispatch_wakeup = anyio.Event()
                batch, self._pending_dispatch = self._pending_dispatch, []
                await self._fetch_prompts(batch)
                entries, started = [], []
                for d in batch:
                    # Its prompt fetched above (most): no coroutine a rollout.
                    ctx = self._known_context(d.rollout_id) or await self._context(d.rollout_id)
                    if d.rollout_id in self.run.scheduler.rollouts:  # not ended meanwhile (a stop)
                        entries.append(JournalEntry(d.rollout_id, d.group_id, d.engine, d.version, ctx.dispatched_at))
                        started.append(d)
                await self.run.journal.append(entries)
                while workers < min(self.run.scheduler.inflight, self.run.config.scheduler.max_inflight):
                    rollouts.start_soon(self._worker, ready)
                    workers += 1
                for d in started:
                    ready.put(d)

    async def _worker(self, ready: ReadyQueue) -> None:
        while True:
            await self._rollout(await ready.take())

    async def _context(self, rollout_id: int) -> RolloutContext:
        ctx = self._known_context(rollout_id)
        if ctx is None:  # its group's prompt is not here yet: the task's code gives it
            group_id = self.inflight[rollout_id].dispatch.group_id
            self.prompts[group_id] = await self.run.task.prompt(group_id)
            ctx = self._known_context(rollout_id)
        return ctx

    def _known_context(self, rollout_id: int) -> RolloutContext | None:
        """The rollout's context where nothing must be awaited for it (its prompt is here), else None."""
        entry = self.inflight[rollout_id]
        if entry.ctx is None and (prompt := self.prompts.get(entry.dispatch.group_id)) is not None:
            d = entry.dispatch
            entry.ctx = RolloutContext(rollout_id, d.group_id, prompt.prompt_id, tuple(prompt.token_ids),
                                       entry.dispatched_at, d.version, d.engine)
        return entry.ctx

    async def _fetch_prompts(self, batch: list) -> None:
        """The prompts of a batch's new groups, fetched together: each is a call into the task's
        code on a thread, and one after another a wave of new groups waited a round trip each.
        A failure is raised here, the first in the batch's order, as reading them one by one did;
        nothing of it stays behind (a stop's later reads ask the task again)."""
        groups = {d.group_id for d in batch if d.group_id not in self.prompts}
        if len(groups) < 2:
            return
        failed: dict[int, Exception] = {}
        async with anyio.create_task_group() as tg:
            for group_id in groups:
                tg.start_soon(self._prefetch, group_id, failed)
        for d in batch:  # the first failure in the batch's order, as reading them one by one raised it
            if d.group_id in failed:
                raise failed[d.group_id]

    async def _prefetch(self, group_id: int, failed: dict[int, Exception]) -> None:
        try:
            self.prompts[group_id] = await self.run.task.prompt(group_id)
        except Exception as exc:  # noqa: BLE001 - raised by _fetch_prompts in the batch's order
            failed[group_id] = exc

    async def _rollout(self, d: sch.Dispatch) -> None:
        entry = self.inflight[d.rollout_id]
        ctx = entry.ctx
        completion = None
        try:
            if self.run.scheduler.rollouts.get(d.rollout_id) is None:
                return  # ended before it started (the run stopped): its record is written
            if d.rollout_id in self.aborting:  # aborted while queued: no engine ever sees it
                self._finished(d, None, "aborted", message="aborted before it was sent")
                return
            if getattr(self.run.task, "episodic", False):  # a multi-turn episode: loop_episodes.py
                await episode_rollout(self, d)
                return
            try:
                completion = await self.run.fleet.generate(
                    ctx.prompt_token_ids, self.run.sampling, engine_id=d.engine,
                    request_id=request_id(d.rollout_id), redispatch=False, final_only=True)
            except (EngineError, ActivationError) as exc:  # fenced before it started, or no engine left
                if self.left_before_start(d, exc):
                    return
                # Tell the scheduler first: its retry of this group must not choose the fenced
                # engine again (least loaded, it would be chosen at once: a hot loop of errors).
                self._engines_fenced()
                self._finished(d, None, "errored", "engine_fenced", str(exc))
                return
            if completion.status == "completed":
                try:
                    rewards = await self.run.scorer.score(self.prompts[d.group_id], completion.token_ids)
                except ScoreFailed as exc:  # the task's code failed on this one: it errors, the run goes on
                    log.warning("task.score_failed", rollout=d.rollout_id, kind=exc.kind, error=exc.message)
                    self._finished(d, completion, "errored", exc.kind, exc.message)
                    return
                entry.rewards = rewards
                self._finished(d, completion, "completed")
            elif completion.status == "dropped":
                if completion.refused:  # down first: its replacement must go elsewhere
                    self.keeper.engine_refused(completion.engine_id)
                self._finished(d, completion, "aborted", message=completion.message)
            else:
                if completion.reason == "engine_died":
                    # Down first: the retry that the errored rollout's group gets must not go to it.
                    self.handle(sch.EngineDown(engine=completion.engine_id))
                self._finished(d, completion, "errored", completion.reason, completion.message)
                if completion.reason == "engine_died":
                    await self.engine_dead(completion.engine_id, completion.message)
        except BaseException:
            # Cancelled (shutdown past its grace): the scheduler already chose the drop reason.
            self._finished(d, completion, "aborted")
            raise

    async def engine_lost(self, engine_id: str, message: str) -> None:
        """An engine is gone by a signal outside its requests (Ray: its actor or node died): down
        for the scheduler, fenced in the fleet (its rollouts end errored and their groups are
        retried elsewhere); with none left serving, the run stops."""
        log.warning("engine.lost", engine=engine_id, error=message)
        await self.engine_dead(engine_id, message, ask_leaving=False)

    async def engine_dead(self, engine_id: str, message: str, ask_leaving: bool = True) -> None:
        """Down for the scheduler, fenced in the fleet; replaced where `fleet.replace` says so.
        A server told to stop (SIGTERM) may fail a request as it closes: that one leaves (its
        drain), it is not fenced. An engine its watch reports lost (`ask_leaving=False`: its
        actor or server is dead, or it answered nothing for `unreachable_s`) is not asked: a
        draining server answers its health check, and over a cut link the question only waits
        out its limits (15 s) while the activation it holds up waits too."""
        self.handle(sch.EngineDown(engine=engine_id))
        if engine_id in self._asking_leaving:
            return  # every rollout of a failing engine ends at once: the first asks, and acts, for all
        engine = self.run.fleet.engines.get(engine_id)
        if ask_leaving and engine is not None and engine_id in self.run.fleet.coordinator.serving:
            self._asking_leaving.add(engine_id)
            try:
                leaving = await engine.leaving()
            finally:
                self._asking_leaving.discard(engine_id)
            if leaving:
                self.keeper.engine_refused(engine_id)
                return
        await self.run.fleet.engine_died(engine_id, message)
        self.keeper.engine_lost(engine_id, message)
        self.check_serving()

    def check_serving(self) -> None:
        """With no engine serving and none on its way (a join, a replacement), the run stops."""
        if not self.run.fleet.coordinator.serving and not self.keeper.may_recover():
            self.request_stop("no engine serves", failure="every engine died or was fenced")

    def _engines_fenced(self) -> None:
        """Every engine the fleet fenced is down for the scheduler (an engine can be fenced
        by an activation that was rolled back, or by a death seen during staging); with none
        left serving, the run stops."""
        coordinator = self.run.fleet.coordinator
        for engine in coordinator.fenced:
            self.handle(sch.EngineDown(engine=engine))
        self.check_serving()

    def left_before_start(self, d: sch.Dispatch, exc: BaseException) -> bool:
        """A rollout dispatched to an engine that then left (drained, or told to stop) before its
        request started: never sent, so nothing failed; it ends dropped and is sampled again
        elsewhere, as those the drain aborts are (not `errored(engine_fenced)`)."""
        from orchestrator.errors import FencedEngineError

        if not isinstance(exc, FencedEngineError) or not self.run.fleet.leaving_or_gone(d.engine):
            return False
        self._finished(d, None, "aborted", message=f"{d.engine} left the fleet before this rollout started: "
                                                    "sampled again elsewhere")
        return True

    def _finished(self, d: sch.Dispatch, completion, outcome: str, kind: str = "", message: str = "") -> None:
        if d.rollout_id not in self.run.scheduler.rollouts:
            return
        if completion is not None:
            self.inflight[d.rollout_id].completion = completion
        majority = None if completion is None else sch.majority_version(completion.changes, len(completion.token_ids))
        self.handle(sch.Finished(rollout_id=d.rollout_id, outcome=outcome, kind=kind, message=message,
                                 at=time.monotonic(), majority_version=majority))

    def _write_terminal(self, t: sch.Terminal) -> None:
        entry = self.inflight[t.rollout_id]  # every rollout that can end has its context (see _shutdown)
        rewards = entry.rewards if t.status == "completed" else None
        record = build_rollout_record(entry.ctx, t, entry.completion, rewards,
                                      identity=self.run.identity, sampling=self.run.sampling)
        self.run.recorder.submit(record)
        self.guard.terminal(t.status, t.reason or "", t.message, time.monotonic())
        if t.status == "completed":
            entry.record = record  # its packed blobs become the trainer's sample
            entry.completion = settled(entry.completion)
        else:
            self._forget(t.rollout_id)

    def _forget(self, rollout_id: int) -> None:
        """The one place a rollout's in-flight record is dropped; its group's prompt goes with the
        group's last rollout (the scheduler no longer holds the group)."""
        self.inflight.pop(rollout_id, None)
        self.aborting.discard(rollout_id)
        group = rollout_id // sch.ROLLOUT_ID_STRIDE
        if group not in self.run.scheduler.groups:
            self.prompts.pop(group, None)

    def _forget_ended_groups(self) -> None:
        """Prompts of groups the scheduler let go (consumed, dropped with no sample left)."""
        groups = self.run.scheduler.groups
        for group in [g for g in self.prompts if g not in groups]:
            del self.prompts[group]

    def _discard(self, a: sch.Discard) -> None:
        from replay.records import DiscardRecord

        if a.reason == sch.TRAINER_LOST:
            # The lost trainer may have checkpointed this step before it went (then --resume
            # recovers the step's consumption from the checkpoint): what the batch became is
            # decided once the trainer process is gone (`settle_lost_batches`), never both.
            self.lost_batches.append(a)
        else:
            self.run.recorder.submit(DiscardRecord(rollout_ids=list(a.rollout_ids), reason=a.reason, step=a.step,
                                                   at=time.time()))
        for rid in a.rollout_ids:
            self._forget(rid)
        self._forget_ended_groups()

    # -- the trainer ---------------------------------------------------------------------------
    def _sample(self, rid: int) -> Sample:
        r = self.inflight[rid].record
        return Sample(rollout_id=rid, group_id=r.group_id, prompt_token_ids=r.prompt_token_ids,
                      completion_token_ids=r.completion_token_ids, logprobs=r.completion_logprobs,
                      reward=float(r.rewards["reward"]), dispatched_version=r.dispatched_version,
                      environment_spans=r.environment_spans)

    def _submit(self, a: sch.SubmitBatch) -> None:
        batch = Batch(step=a.step, samples=[self._sample(rid) for rid in a.rollout_ids])
        self.batch = (a.step, a.rollout_ids, time.monotonic())
        if self.run.startup.first_batch():
            log.info("run.first_batch", step=a.step, seconds=round(self.run.startup.to_first_batch_s, 3))
        self._tg.start_soon(self._send_batch, batch)

    async def _send_batch(self, batch: Batch) -> None:
        try:
            # Exactly once: the trainer sees a sample only after its rollout record is durable (a
            # crash between the two would otherwise leave a trained-on rollout with no record).
            await self.run.recorder.flush()
            await self.run.trainer.link.send(batch)
        except Exception as exc:  # noqa: BLE001 - the trainer is gone or stuck: the run stops
            self.trainer_lost(f"sending step {batch.step} to the trainer failed: {exc}")

    async def _trainer_messages(self) -> None:
        trainer = self.run.trainer
        while True:
            try:
                message = await trainer.link.recv(1.0)
            except TimeoutError:
                if not trainer.alive:
                    self.trainer_lost(f"the trainer process exited (code {trainer.process.returncode}); "
                                       f"see {self.run.run_dir / 'trainer.log'}")
                    return
                if self.batch and time.monotonic() - self.batch[2] > self.run.config.trainer.step_timeout_s:
                    self.trainer_lost(f"step {self.batch[0]} took longer than trainer.step_timeout_s")
                    return
                continue
            if isinstance(message, StepDone):
                self._step_done(message)
            elif isinstance(message, Failed):
                self.trainer_lost(f"the trainer failed at step {message.step}: {message.error}")
                return

    def trainer_lost(self, why: str) -> None:
        log.error("trainer.lost", reason=why)
        if self.batch is not None:
            self.handle(sch.TrainerLost(step=self.batch[0]))
            self.batch = None
        self.request_stop("trainer lost", failure=why)

    def _step_done(self, m: StepDone) -> None:
        if self.batch is None or self.batch[0] != m.step:
            log.error("trainer.unexpected_step", step=m.step, holding=self.batch and self.batch[0])
            return
        _, rollout_ids, started = self.batch
        self.batch = None
        self.guard.step(time.monotonic())
        log.info("trainer.step_done", step=m.step, version=m.version, reward=m.reward_mean, loss=m.loss)
        staleness, in_flight = [], []
        for rid in rollout_ids:
            c = self.inflight[rid].completion
            staleness.append((m.step - 1) - c.dispatched_version)
            changes = c.changes or [(0, c.dispatched_version)]
            in_flight.append(changes[-1][1] - changes[0][1])
        components = reward_components([self.inflight[rid].rewards for rid in rollout_ids])
        self.run.recorder.submit(consumption_record(m, components))
        self.run.metrics.on_step(m.step, staleness, in_flight, m.reward_mean, components)
        self.run.tensorboard_step(m, staleness, components)
        for rid in rollout_ids:
            self._forget(rid)
        self.handle(sch.StepDone(step=m.step, version=m.version, at=time.monotonic()))
        self._forget_ended_groups()
        self.run.progress.step(StepLine(m.step, m.reward_mean, sum(staleness) / len(staleness), int(max(staleness)),
                                        self.run.metrics.tokens_per_second, self.run.fleet.live_version,
                                        m.loss, time.monotonic() - started))
        if m.version is not None:
            self.wanted_version = max(self.wanted_version, m.version)
            self._version_wanted.set()
        if self.run.scheduler.done_steps >= self.run.max_steps:
            self.request_stop("done")

    def settle_lost_batches(self) -> None:
        """Once the trainer process is gone: each batch it held is consumed if the trainer
        checkpointed that step (its own account, from the checkpoint), else discarded
        (trainer_lost): a checkpoint can no longer appear, so the two never both happen."""
        from orchestrator.trainer.step_journal import consumption_of
        from replay.records import DiscardRecord

        for a in self.lost_batches:
            message = consumption_of(self.run.run_dir, a.step) if a.step is not None else None
            if message is not None and set(message.rollout_ids) == set(a.rollout_ids):
                log.info("trainer.lost_step_checkpointed", step=a.step)
                self.run.recorder.submit(consumption_record(message))
            else:
                self.run.recorder.submit(DiscardRecord(rollout_ids=list(a.rollout_ids), reason=a.reason,
                                                       step=a.step, at=time.time()))
        self.lost_batches.clear()

    # -- stopping ------------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        scheduler = self.run.scheduler
        self.handle(sch.Stop())
        grace = self.run.config.run.shutdown_grace_s
        with anyio.move_on_after(grace):
            while scheduler.rollouts:
                await anyio.sleep(0.02)
        if self._rollout_scope is not None:
            self._rollout_scope.cancel()  # each cancelled rollout writes its record on the way out
        await anyio.sleep(0)
        for rid in list(scheduler.rollouts):  # dispatched, never started: no engine saw them
            await self._context(rid)
            self.handle(sch.Finished(rollout_id=rid, outcome="aborted"))
        # The trainer finishes the step it holds (its consumption is recorded), then stops.
        with anyio.move_on_after(self.run.config.trainer.step_timeout_s if self.stop_reason != "trainer lost" else 0):
            while self.batch is not None and self.run.trainer.alive:
                await anyio.sleep(0.05)
        if self.batch is not None:
            self.handle(sch.TrainerLost(step=self.batch[0]))
            self.batch = None
        # An activation under way ends on its own (bounded; none begins once the run stops:
        # `run_activator`): cancelled mid-swap it would fence engines for the stop itself, and the
        # log would not say which version they serve.
        with anyio.move_on_after(self.run.config.run.shutdown_grace_s):
            async with self.activation_lock:
                pass
