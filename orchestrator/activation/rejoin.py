"""The fenced-engine return path of the activation coordinator (`orchestrator.activation.coordinator`): `rejoin`
re-syncs a fenced engine to the live version (stage, pause, swap, fence the cache, label,
resume, unfence), `join_next` brings it back with the next version instead (push transports),
`abandon_rejoin` ends a rejoin its performer gave up. A mixin of `ActivationCoordinator`: pure
like it (events in, actions out), sharing its state (`fenced`, `live_version`, `phase`, ...)."""

from __future__ import annotations

from orchestrator.activation.messages import (
    IDLE,
    STAGING,
    Action,
    CacheFenced,
    DropStaged,
    EngineDied,
    Event,
    FenceCache,
    Pause,
    Paused,
    Resume,
    Resumed,
    SetVersion,
    Stage,
    Staged,
    StageFailed,
    StartTimer,
    StepFailed,
    Swap,
    Swapped,
    Timeout,
    Unfence,
    VersionSet,
)


class CoordinatorError(RuntimeError):
    """A call that the coordinator's state does not allow (a bug in the caller)."""


class RejoinSteps:
    """`rejoin`, `join_next`, `abandon_rejoin` and the rejoin's event handling; the fleet's
    membership: `add_engine`, `leave`, `remove_engine`."""

    # -- membership --------------------------------------------------------------------------
    def add_engine(self, engine: str) -> None:
        """A new engine enters the fleet fenced: it serves only once `rejoin` has brought it to
        the live version (its weights are whatever it started with)."""
        if engine in self.engines:
            raise CoordinatorError(f"{engine} is already in the fleet")
        self.engines = (*self.engines, engine)
        self.fenced.add(engine)

    def leave(self, engine: str, at: float = 0.0) -> list[Action]:
        """An engine is on its way out (drained, or its server was told to stop): no new request
        and no later activation includes it; what it holds finishes under the weights it has; a
        rejoin is given up. In an activation under way it drops out without failing the
        version: while staging, like a joiner that failed (its staged copy dropped); after, like
        an engine whose step failed (fenced, resumed if it was paused). The performer treats
        the fence of a leaving engine as no more than that: its rollouts go on."""
        if engine not in self.engines:
            raise CoordinatorError(f"{engine} is not in the fleet")
        if engine in self.leaving:
            return []
        self.leaving.add(engine)
        self.joining.discard(engine)
        actions = self.abandon_rejoin(engine)
        run = self.runs.get(engine) if self.phase != IDLE else None
        if run is None or run.failed:
            return actions
        if self.phase == STAGING:
            run.failed = True
            self.messages.append(f"{engine} left the fleet while the version staged")
            actions.append(DropStaged(engine=engine, version=self.version))
            return actions + (self._staging_done(at) if self._all("staged") else [])
        return actions + self._mark_failed(engine, "leave", "leaving the fleet") + self._progress(at)

    def remove_engine(self, engine: str) -> None:
        """The engine has left: forgotten. Only between activations (the performer holds its
        activation lock), so no activation's state refers to it."""
        if self.phase != IDLE and engine in self.runs:
            raise CoordinatorError(f"{engine} takes part in the activation of {self.version}")
        self.engines = tuple(e for e in self.engines if e != engine)
        for state in (self.fenced, self.joining, self.leaving):
            state.discard(engine)
        self.rejoining.pop(engine, None)

    def rejoin(self, engine: str, at: float) -> list[Action]:
        """Bring a fenced engine back: re-sync it to the live version, then unfence it."""
        if engine not in self.fenced:
            raise CoordinatorError(f"{engine} is not fenced")
        if engine in self.leaving:
            raise CoordinatorError(f"{engine} is leaving the fleet")
        if engine in self.rejoining:
            return []
        self.joining.discard(engine)  # re-synced to the live version instead
        self.rejoining[engine] = "stage"
        self._rejoin_counter += 1
        self._rejoin_tokens[engine] = self._rejoin_counter
        return [Stage(engine=engine, version=self.live_version),
                StartTimer(engine=engine, phase="rejoin", token=self._rejoin_counter, seconds=self.timeouts.rejoin_s)]

    def join_next(self, engine: str) -> list[Action]:
        """Bring a fenced engine back with the next version that goes live, rather than the
        live one: a push transport's trainer sends each version once, to the engines it
        includes, so the live version never comes again (`rejoin` stages the live version and
        suits the filesystem). The engine takes every step of the next activation with the
        others and is unfenced when that version goes live; if it fails, it alone stays fenced
        (and no longer joins), and the version goes on without it."""
        if engine not in self.fenced:
            raise CoordinatorError(f"{engine} is not fenced")
        if engine in self.rejoining:
            raise CoordinatorError(f"{engine} is already rejoining at the live version")
        self.joining.add(engine)
        return []

    def abandon_rejoin(self, engine: str) -> list[Action]:
        """The performer gave up on a rejoin (cancelled): the engine stays fenced (whatever it
        holds now, the next rejoin re-syncs it) and what it staged is dropped."""
        if engine not in self.rejoining:
            return []
        del self.rejoining[engine]
        return [DropStaged(engine=engine, version=self.live_version)]

    def _handle_rejoin(self, event: Event) -> list[Action]:
        e = event.engine
        step = self.rejoining[e]
        if isinstance(event, Timeout):
            if event.phase != "rejoin" or event.token != self._rejoin_tokens.get(e):
                return []
            del self.rejoining[e]
            return [DropStaged(engine=e, version=self.live_version), Resume(engine=e)]
        if isinstance(event, (StageFailed, StepFailed, EngineDied)):
            del self.rejoining[e]
            return [DropStaged(engine=e, version=self.live_version), Resume(engine=e)]
        if step == "stage" and isinstance(event, Staged):
            if event.version != self.live_version:  # the fleet moved on meanwhile: stage again
                return [Stage(engine=e, version=self.live_version)]
            if self.strategy == "adapter":  # the live adapter is loaded: new requests may come
                del self.rejoining[e]
                if self.phase != IDLE:
                    return self._join_the_activation_under_way(e)
                self.fenced.discard(e)
                return [Unfence(engine=e, version=self.live_version)]
            self.rejoining[e] = "pause"
            return [Pause(engine=e, mode="abort", clear_cache=True)]
        if step == "pause" and isinstance(event, Paused):
            self.rejoining[e] = "swap"
            self._rejoin_version[e] = self.live_version
            return [Swap(engine=e, version=self.live_version)]
        if step == "swap" and isinstance(event, Swapped):
            self.rejoining[e] = "fence_cache"
            return [FenceCache(engine=e)]
        if step == "fence_cache" and isinstance(event, CacheFenced):
            self.rejoining[e] = "set_version"
            return [SetVersion(engine=e, version=self._rejoin_version[e])]
        if step == "set_version" and isinstance(event, VersionSet):
            self.rejoining[e] = "resume"
            return [Resume(engine=e)]
        if step == "resume" and isinstance(event, Resumed):
            if self._rejoin_version[e] != self.live_version:  # the fleet moved on meanwhile
                self.rejoining[e] = "stage"
                return [Stage(engine=e, version=self.live_version)]
            del self.rejoining[e]
            if self.phase != IDLE:
                return self._join_the_activation_under_way(e)
            self.fenced.discard(e)
            return [Unfence(engine=e, version=self.live_version)]
        return []
