"""The fleet's hand on one engine: `FleetActions._perform` does one of the activation
coordinator's actions (stage, pause, swap, fence the cache, label, resume, ...) against its
`Engine`, each remote call under a timeout, and returns the engine's answer as the event the
coordinator takes (a failure included: `StageFailed`, `StepFailed`, `EngineDied`, or
`EngineLeaving` for a server told to stop). A mixin of `Fleet`; `ActionRun` calls it."""

from __future__ import annotations

import json
import time

import anyio

from orchestrator.activation import coordinator as act
from orchestrator.engines.base import Engine
from orchestrator.errors import EngineDeadError, EngineError, EngineTimeoutError
from orchestrator.fleet.rollouts import SwitchReport, fleet_request_id
from orchestrator.observe.logging import get_logger

log = get_logger(__name__)
SHUTTING_DOWN = "server shutting down"  # what a vLLM server told to stop answers every control call
# The step a failed action names in its StepFailed (a Stage fails as StageFailed).
STEP_OF = {act.Pause: "pause", act.Swap: "swap", act.FenceCache: "fence_cache",
           act.SetVersion: "set_version", act.Resume: "resume", act.Drain: "drain"}


class FleetActions:
    """Mixed into `Fleet`: requires `engines`, `coordinator`, `ft`, `strategy`, `_rpc`,
    `_drop_staged`, `_stage_adapter`, `staged_before`, `_stage_source`, `_gates`,
    `_tracks_by_engine`, `tracks_on`, `_paused`, `_died`, `_pauses_due`, `_reports_due`,
    `_salt_unsettled`, `_salt_version`, `_note_switch`, `_note_prompt_cache`,
    `_release_reports`, `_deferred_aborts`, `_abort_on`, `_fence`, `set_state`."""

    async def _perform(self, a: act.EngineAction) -> act.Event | None:
        engine = self.engines[a.engine]
        try:
            # By the action's type: one look-up, where a chain of isinstance checks cost more
            # than the action itself with hundreds of engines that answer at once.
            return await _PERFORMERS[type(a)](self, a, engine)
        except EngineDeadError as exc:
            if await self._told_to_stop(engine, exc):
                return self._leaving(a.engine)
            return act.EngineDied(engine=a.engine, at=time.monotonic(), error=str(exc))
        except (EngineError, RuntimeError, ValueError, OSError) as exc:
            if await self._told_to_stop(engine, exc):
                return self._leaving(a.engine)
            if isinstance(a, act.Stage):
                return act.StageFailed(engine=a.engine, at=time.monotonic(), version=a.version, error=str(exc))
            return act.StepFailed(engine=a.engine, at=time.monotonic(), step=STEP_OF.get(type(a), "stage"),
                                  error=f"{type(exc).__name__}: {exc}")

    # -- one method per action -------------------------------------------------------------
    async def _do_stage(self, a: act.Stage, engine: Engine) -> act.Event:
        if self.strategy == "adapter":
            return await self._stage_adapter(engine, a)
        if a.rollback:
            state = await self._rpc(engine, "swap_live_version")
            if state.get("shadow") is None:
                return act.StageFailed(engine=a.engine, at=time.monotonic(), version=a.version,
                                       error="no previous version to roll back to")
            return act.Staged(engine=a.engine, at=time.monotonic(), version=a.version)
        if a.engine in self.coordinator.rejoining and await self.staged_before(engine, a.version):
            return act.Staged(engine=a.engine, at=time.monotonic(), version=a.version)
        source = self._stage_source if a.engine not in self.coordinator.rejoining else {}
        # No attempt: the worker stages the committed version (its COMPLETE marker and the attempt
        # written there), whichever try of the trainer's synchronizer committed it.
        await self._rpc(engine, "swap_stage", json.dumps({**source, "version": a.version}))
        while True:
            status = await self._rpc(engine, "swap_status")
            if status.get("version") == a.version and status.get("state") == "staged":
                return act.Staged(engine=a.engine, at=time.monotonic(), version=a.version)
            if status.get("state") == "failed":
                return act.StageFailed(engine=a.engine, at=time.monotonic(), version=a.version,
                                       error=str(status.get("error")))
            await anyio.sleep(self.ft.poll_s)

    async def _do_drop_staged(self, a: act.DropStaged, engine: Engine) -> None:
        # Shielded like resume: the activation ends (and cancels its task group) in the
        # same breath as it asks for the drops; an unsent drop leaves a version that
        # never went live in the engine's shadow, where a later rollback would flip it in.
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.ft.rpc_s):
            await self._drop_staged(a)

    async def _do_drain(self, a: act.Drain, engine: Engine) -> act.Event:
        self._gates.setdefault(a.engine, anyio.Event())
        while self._tracks_by_engine.get(a.engine):
            await anyio.sleep(self.ft.poll_s)
        return act.Drained(engine=a.engine, at=time.monotonic())

    async def _do_abort_inflight(self, a: act.AbortInflight, engine: Engine) -> None:
        for t in self.tracks_on(a.engine):
            t.aborted_by_activation = True
            await engine.abort(t.request_id)

    async def _do_pause(self, a: act.Pause, engine: Engine) -> act.Event:
        e = a.engine
        try:
            self._paused.add(e)
            self._salt_unsettled.add(e)
            for t in self.tracks_on(e):
                t.aborted_by_activation = a.mode == "abort"
            await engine.pause(a.mode, a.clear_cache)
        finally:
            self._pauses_due[e] = max(0, self._pauses_due.get(e, 0) - 1)
        return act.Paused(engine=e, at=time.monotonic())

    async def _do_swap(self, a: act.Swap, engine: Engine) -> act.Event:
        e = a.engine
        # From here until the fleet holds this swap's report, a rollout on this engine
        # that ends waits for it: the worker may swap, and the rollout finish (its stream
        # ended), before the report comes back; its later tokens carry the old label.
        self._reports_due.setdefault(e, SwitchReport(between_steps=a.between_steps))
        self._salt_unsettled.add(e)
        arg = json.dumps({"watch": a.between_steps})
        result = await self._rpc(engine, "swap_rollback" if a.rollback else "swap_apply", arg)
        requests = {fleet_request_id(k): int(v) for k, v in (result.get("requests") or {}).items()}
        self._note_switch(e, a.version, requests)
        if not a.between_steps:
            self._release_reports(e, reported=True)
        return act.Swapped(engine=e, at=time.monotonic(), version=a.version, requests=requests)

    async def _do_fence_cache(self, a: act.FenceCache, engine: Engine) -> act.Event:
        await engine.reset_prefix_cache()
        return act.CacheFenced(engine=a.engine, at=time.monotonic())

    async def _do_set_version(self, a: act.SetVersion, engine: Engine) -> act.Event:
        e = a.engine
        await engine.set_weight_version(a.version)
        self._salt_version[e] = a.version
        self._salt_unsettled.discard(e)
        requests: dict[str, int] = {}
        if self.strategy == "pause_free":
            # The confirm names the requests first scheduled between the flip and the
            # label (on the new weights, labelled old): the second half of the report.
            result = await self._rpc(engine, "swap_confirm")
            requests = {fleet_request_id(k): int(v) for k, v in (result.get("requests") or {}).items()}
            self._note_switch(e, a.version, requests)
            self._note_prompt_cache(e, a.version, result.get("cached") or {})
            self._release_reports(e, reported=True)
        return act.VersionSet(engine=e, at=time.monotonic(), version=a.version, requests=requests)

    async def _do_resume(self, a: act.Resume, engine: Engine) -> act.Event:
        # Each batch of actions runs as its own job, concurrently: a Resume owed to an engine
        # that left while its Pause was on the way must not overtake that Pause (the engine
        # would then be paused after it, and stay so). Bounded: a Pause that never ran is not
        # waited for.
        if self._pauses_due.get(a.engine):
            with anyio.move_on_after(self.ft.rpc_s):
                while self._pauses_due.get(a.engine, 0):
                    await anyio.sleep(self.ft.poll_s)
        await self._resume(engine)
        return act.Resumed(engine=a.engine, at=time.monotonic())

    async def _do_fence(self, a: act.Fence, engine: Engine) -> None:
        self._fence(a.engine, a.reason)

    async def _do_unfence(self, a: act.Unfence, engine: Engine) -> None:
        log.info("fleet.unfenced", engine=a.engine, version=a.version)
        self.set_state(a.engine, "serving", f"serves version {a.version}")

    # -- helpers ---------------------------------------------------------------------------
    async def _resume(self, engine: Engine) -> None:
        """Shielded, with its own limit: a cancelled activation still resumes the engine."""
        limit = self.ft.resume_limit_s
        # One scope (what `fail_after(limit, shield=True)` makes, less its two wrappers).
        with anyio.CancelScope(shield=True, deadline=anyio.current_time() + limit) as scope:
            await engine.resume()
        if scope.cancelled_caught:
            raise TimeoutError(f"{engine.engine_id} did not resume within {limit}s")
        self._paused.discard(engine.engine_id)
        self._died.discard(engine.engine_id)  # it answered: alive again
        await self._flush_deferred_aborts(engine.engine_id)

    async def _flush_deferred_aborts(self, engine_id: str) -> None:
        rids = self._deferred_aborts.pop(engine_id, set())
        if rids and engine_id not in self._paused:
            with anyio.CancelScope(shield=True):
                await self._abort_on(engine_id, sorted(rids))

    @staticmethod
    async def _told_to_stop(engine: Engine, exc: BaseException) -> bool:
        """A server told to stop (SIGTERM) answers every control call "Server shutting down" while
        it drains what it holds; a call caught at the moment the signal lands may fail otherwise
        (a reset connection, a dead engine core's error), so any failure short of a timeout asks
        the server itself before the engine is taken for failed."""
        if SHUTTING_DOWN in str(exc).lower():
            return True
        if isinstance(exc, EngineTimeoutError):  # not answering: asking again would only wait
            return False
        return await engine.leaving()

    def _leaving(self, engine_id: str) -> act.EngineLeaving:
        """Leaving, not failed: the version goes on without it."""
        self.set_state(engine_id, "draining", "its server was told to stop (SIGTERM)")
        return act.EngineLeaving(engine=engine_id, at=time.monotonic())


_PERFORMERS = {
    act.Stage: FleetActions._do_stage, act.DropStaged: FleetActions._do_drop_staged,
    act.Drain: FleetActions._do_drain, act.AbortInflight: FleetActions._do_abort_inflight,
    act.Pause: FleetActions._do_pause, act.Swap: FleetActions._do_swap,
    act.FenceCache: FleetActions._do_fence_cache, act.SetVersion: FleetActions._do_set_version,
    act.Resume: FleetActions._do_resume, act.Fence: FleetActions._do_fence, act.Unfence: FleetActions._do_unfence,
}
