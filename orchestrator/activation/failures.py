"""The failure paths of the activation coordinator (`orchestrator.activation.coordinator`): an
engine that fails a step or dies, and a phase whose timer fires. A mixin of
`ActivationCoordinator`, pure like it (events in, actions out), sharing its state (`runs`,
`phase`, `fenced`, `messages`, ...) and its phase steps (`_after_drain`, `_finish`, ...)."""

from __future__ import annotations

from orchestrator.activation.messages import (
    DRAINING,
    IDLE,
    PAUSING,
    RESUMING,
    ROLLED_BACK,
    STAGING,
    SWAPPING,
    Action,
    DropStaged,
    Fence,
    Resume,
    Timeout,
)


class FailureSteps:
    """`_engine_failed`, `_mark_failed`, `_abort_staging`, `_on_timeout`, `_progress`."""

    def _engine_failed(self, engine: str, step: str, error: str, at: float) -> list[Action]:
        dead = step == "died"
        if self.phase == STAGING and self.runs[engine].joining:
            return self._drop_joiner(engine, f"{step}: {error}", at, dead=dead)
        if self.phase == STAGING:
            actions = self._abort_staging(at, f"{engine} {step} while staging: {error}", dead=engine if dead else None)
            if step == "died" and engine not in self.fenced:
                self.fenced.add(engine)
                actions.insert(0, Fence(engine=engine, reason=f"died: {error}"))
            return actions
        return self._mark_failed(engine, step, error) + self._progress(at)

    def _mark_failed(self, engine: str, step: str, error: str) -> list[Action]:
        run = self.runs[engine]
        run.failed = True
        actions: list[Action] = []
        if run.joining:  # fenced already: it stays so
            self.joining.discard(engine)
            self.messages.append(f"{engine} did not join ({step}: {error})")
        else:
            self.messages.append(f"{engine} fenced ({step}: {error})")
            self.fenced.add(engine)
            actions.append(Fence(engine=engine, reason=f"{step}: {error}"))
        if step == "died":
            run.resumed = True  # nothing left to resume
        elif run.paused and not run.resumed and self.phase != RESUMING:
            actions.append(Resume(engine=engine))  # best effort: never leave an engine paused
        if step == "resume":
            run.resumed = True
        return actions

    def _progress(self, at: float) -> list[Action]:
        """After an engine dropped out: the phase may be complete now."""
        if self.phase == DRAINING and self._all("drained"):
            return self._after_drain(at)
        if self.phase == PAUSING and self._all("paused"):
            return self._after_pause(at)
        if self.phase == SWAPPING:
            return self._check_applied(at)
        if self.phase == RESUMING:
            return self._check_resumed(at)
        return []

    def _abort_staging(self, at: float, message: str, dead: str | None = None) -> list[Action]:
        self.messages.append(message)
        # An engine that died gets no drop: nothing answers it (over a cut link the call waits out
        # its limit, and the rollback with it: the next version waited 50 s in the cluster test),
        # and it is fenced, so its rejoin re-syncs whatever it holds (`rejoin`: stage, swap).
        actions: list[Action] = [DropStaged(engine=e, version=self.version) for e in self.runs if e != dead]
        return actions + self._finish(at, ROLLED_BACK, "; ".join(self.messages))

    def _on_timeout(self, event: Timeout) -> list[Action]:
        if event.token != self._token or event.phase != self.phase or self.phase == IDLE:
            return []  # the timer of a finished phase
        at = event.at
        if self.phase == STAGING:
            late = [e for e, r in self.runs.items() if r.step == "stage" and not r.failed]
            if all(self.runs[e].joining for e in late):
                actions: list[Action] = []
                for e in late:  # a late joiner stays fenced; the version goes on without it
                    self.runs[e].failed = True
                    self.joining.discard(e)
                    self.messages.append(f"{e} did not join (staging timed out after {self.timeouts.stage_s}s)")
                    actions.append(DropStaged(engine=e, version=self.version))
                return actions + self._staging_done(at)
            return self._abort_staging(at, f"staging timed out after {self.timeouts.stage_s}s on {', '.join(late)}")
        if self.phase == DRAINING:
            if self.pauses:
                self.messages.append("drain timed out: the rest were recomputed during the pause")
            else:
                # The pause-free flip has no pause to recompute in: the requests still running
                # keep the keys/values of the old weights.
                self.messages.append("drain timed out: the rest kept old keys/values (no pause to recompute in)")
                self._kv_kept = True
            for r in self.runs.values():
                if not r.failed:
                    r.step = "drained"
            return self._after_drain(at)
        if self.phase == RESUMING:
            actions = []
            for e, r in self.runs.items():
                if r.paused and not r.resumed:
                    r.resumed = True
                    if not r.failed:
                        actions += self._mark_failed(e, "resume", "timed out")
            return actions + self._conclude(at)
        # PAUSING or SWAPPING: engines that have not answered are fenced; the rest go on.
        want = {PAUSING: ("pause",), SWAPPING: ("swap", "fence_cache", "set_version")}[self.phase]
        late = [e for e, r in self.runs.items() if not r.failed and r.step in want]
        actions = []
        for e in late:
            actions += self._mark_failed(e, self.phase + "_timeout", "timed out")
        return actions + self._progress(at)
