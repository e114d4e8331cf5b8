"""The activation coordinator: a pure state machine (events in, actions out, no awaits).

It drives N engines from the live version to a staged one at one instant:

    begin(v)            Stage(e, v) on every serving engine; they keep generating
    all Staged          [Drain(e) first under the `drain` KV policy]
                        Pause(e, mode, clear_cache)          (not with the pause-free flip)
    all Paused          Swap(e, v)   staged -> live: a copy, or a pointer flip
    Swapped(e)          FenceCache(e)   no new request reuses keys/values of older weights
    CacheFenced(e)      SetVersion(e, v)
    all VersionSet      the live version becomes v (only now: every engine applied it)
                        Resume(e) for every engine that was paused    (not with pause-free)
    all Resumed         Record(...)   and back to idle

With the `adapter` strategy (LoRA) every engine loads the version's adapter beside the serving
ones (Stage); once all have, the live version becomes v: no pause, swap or label.

Every phase starts a timer (`StartTimer`); the performer answers with `Timeout(phase=..., token=...)`
and the coordinator ignores timers of finished phases. Failures:

* staging (`StageFailed`, `EngineDied`, or the staging timer): no engine activates;
  `DropStaged` everywhere, the attempt is recorded as rolled back, the live version stays,
  the next version tries again. An engine that died is also fenced, and sent no drop (nothing
  answers it; its rejoin re-syncs whatever it holds).
* pause / swap / fence / set-version / resume (`StepFailed`, `EngineDied`, the phase's
  timer): that engine is fenced (`Fence`: no new requests, its in-flight rollouts end
  `errored`), the others go on at v. Every engine that was sent `Pause` is sent `Resume`,
  fenced or not, so no engine is left paused. A fenced engine serves again only after
  `rejoin(e)`: it re-syncs to the live version (Stage, Swap, FenceCache, SetVersion, Resume)
  and then `Unfence(e)`; or, after `join_next(e)` (push transports, whose trainer never
  resends the live version), it takes every step of the next activation with the others and
  is unfenced when that version is live. A joiner's failure fails only the joiner.

`serving` (the engines that may receive new work) never contains a fenced engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.activation.messages import (  # noqa: F401 - the coordinator's vocabulary, re-exported
    ENGINE_FENCED, FAILED, KV_POLICIES, ROLLED_BACK, STRATEGIES, KvPolicy, Strategy, DRAINING,
    IDLE, PAUSING, RESUMING, STAGING, SWAPPING, ACTIVATED, AbortInflight, Action, CacheFenced,
    Drain, Drained, DropStaged, EngineAction, EngineDied, EngineLeaving, EngineOutcome, Event, Fence, FenceCache,
    Pause, Paused, Record, Resume, Resumed, SetVersion, Stage, Staged, StageFailed, StartTimer,
    StepFailed, Swap, Swapped, Timeout, Unfence, VersionSet,
)
from orchestrator.activation.failures import FailureSteps
from orchestrator.activation.rejoin import CoordinatorError, RejoinSteps  # noqa: F401 - re-exported
from orchestrator.config.run import PhaseTimeouts  # noqa: F401 - re-exported (activation.PhaseTimeouts)

HISTORY_KEPT = 64


@dataclass
class _EngineRun:
    """One engine's progress through the current activation."""

    staged_at: float | None = None
    paused: bool = False  # Pause was sent (so Resume is owed)
    paused_at: float | None = None
    step: str = "stage"  # stage, staged, drain, pause, swap, fence_cache, set_version, applied, resume, done
    failed: bool = False
    resumed: bool = False
    resumed_at: float | None = None
    requests: dict[str, int] = field(default_factory=dict)
    # A fenced engine coming back with this version (`join_next`): it takes every step with
    # the others, but its failure fails only itself (it stays fenced) and never the version.
    joining: bool = False


class ActivationCoordinator(FailureSteps, RejoinSteps):
    def __init__(self, engines: Sequence[str], *, strategy: Strategy = "pause_swap",
                 kv_policy: KvPolicy = "recompute", timeouts: PhaseTimeouts | None = None,
                 live_version: int = 0) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")
        if strategy == "pause_free" and kv_policy == "recompute":
            raise ValueError("kv_policy 'recompute' needs a pause (it re-prefills under the new weights); "
                             "the pause-free flip supports keep, drain and abort")
        if len(set(engines)) != len(engines) or not engines:
            raise ValueError("engines must be non-empty and unique")
        self.engines = tuple(engines)
        self.strategy = strategy
        self.kv_policy = kv_policy
        self.timeouts = timeouts or PhaseTimeouts()
        self.live_version = live_version
        self.fenced: set[str] = set()
        self.phase = IDLE
        self.version: int | None = None
        self.rollback = False
        self.runs: dict[str, _EngineRun] = {}
        self.started_at = 0.0
        self._applied = False
        self._kv_kept = False
        self.messages: list[str] = []
        self._token = 0
        # The last activations' records, for a debugger's eye; bounded: a run activates every step
        # for days (the replay log keeps them all).
        self.history: deque[Record] = deque(maxlen=HISTORY_KEPT)
        # rejoining engines: engine -> step ("stage", "swap", "fence_cache", "set_version", "resume")
        self.rejoining: dict[str, str] = {}
        self._rejoin_tokens: dict[str, int] = {}
        self._rejoin_counter = 0
        self._rejoin_version: dict[str, int] = {}
        # fenced engines that come back with the next version that goes live (`join_next`)
        self.joining: set[str] = set()
        # engines on their way out of the fleet (drained, or told to stop): they finish what
        # they hold, take no new request and no activation waits on them (`leave`)
        self.leaving: set[str] = set()
        # `_none_pending`: the runs scanned, and where each scan stopped
        self._scan_of: dict[str, _EngineRun] | None = None
        self._scan_runs: list[_EngineRun] = []
        self._scan_at: dict[str, int] = {}

    # -- queries -----------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return self.phase == IDLE

    @property
    def serving(self) -> tuple[str, ...]:
        """Engines that may receive new requests."""
        return tuple(e for e in self.engines if e not in self.fenced and e not in self.leaving)

    def may_dispatch(self, engine: str) -> bool:
        return engine in self.engines and engine not in self.fenced and engine not in self.leaving

    @property
    def pauses(self) -> bool:
        return self.strategy not in ("pause_free", "adapter")

    # -- inputs ------------------------------------------------------------------------------
    def begin(self, version: int, at: float, *, rollback: bool = False) -> list[Action]:
        """Start activating `version`. With `rollback`, the engines' other buffer (double
        buffering) already holds the weights to return to, and `version` names them anew."""
        if self.phase != IDLE:
            raise CoordinatorError(f"activation of {self.version} still in phase {self.phase}")
        if version <= self.live_version:
            raise CoordinatorError(f"version {version} is not newer than the live {self.live_version}")
        if rollback and self.strategy == "pause_swap":
            raise CoordinatorError("rollback is a flip back: it needs double buffering")
        participants = [e for e in self.engines
                        if e not in self.fenced and e not in self.rejoining and e not in self.leaving]
        # A rollback flips back to what the serving engines' other buffer holds; a joiner's
        # other buffer holds nothing of it.
        joiners = [] if rollback else [e for e in self.engines
                                       if e in self.joining and e not in self.rejoining and e not in self.leaving]
        self.version, self.rollback, self.started_at, self.messages = version, rollback, at, []
        self._applied = False
        self._kv_kept = False
        if not participants and not joiners:
            return self._finish(at, FAILED, "no engine serves: all are fenced")
        self.runs = {e: _EngineRun() for e in participants}
        self.runs.update({e: _EngineRun(joining=True) for e in joiners})
        self.phase = STAGING
        actions: list[Action] = [Stage(engine=e, version=version, rollback=rollback) for e in self.runs]
        actions.append(self._timer(STAGING, self.timeouts.stage_s))
        return actions

    def abandon(self, at: float, why: str = "cancelled") -> list[Action]:
        """End the activation in progress now, with what is known: its performer gave up on it
        (cancelled). Before any swap was asked for no weights changed: the staged copies are
        dropped and the attempt is rolled back. Once swaps were asked for, an engine that did
        not confirm every step (swap, cache fence, label) may hold either version, or the new
        one labelled old: it is fenced (a rejoin re-syncs it); if the others applied v, v is
        live, as after a swap-phase timeout. Resumes owed are the performer's (it resumes
        whatever it paused); nothing waits for them here."""
        if self.phase == IDLE:
            return []
        self.messages.append(f"{why} in phase {self.phase}")
        if self.phase in (STAGING, DRAINING, PAUSING):
            return [DropStaged(engine=e, version=self.version) for e in self.runs] + \
                self._finish(at, ROLLED_BACK, "; ".join(self.messages))
        actions: list[Action] = []
        if self.phase == SWAPPING:
            for e, r in self.runs.items():
                if not r.failed and r.step != "applied":
                    actions += [a for a in self._mark_failed(e, "swap", why) if not isinstance(a, Resume)]
            if any(not r.failed for r in self.runs.values()):
                self.live_version = self.version  # every engine still in the fleet applied it
                self._applied = True
        return actions + self._conclude(at)

    def handle(self, event: Event) -> list[Action]:
        if isinstance(event, EngineLeaving):
            return self.leave(event.engine, event.at)
        if event.engine is not None and event.engine in self.rejoining:
            return self._handle_rejoin(event)
        if isinstance(event, Timeout):
            return self._on_timeout(event)
        if self.phase == IDLE or event.engine not in self.runs:
            if isinstance(event, EngineDied) and event.engine in self.engines and event.engine not in self.fenced:
                self.fenced.add(event.engine)
                return [Fence(engine=event.engine, reason=f"died: {event.error}")]
            return []  # late answer of a finished activation
        run = self.runs[event.engine]
        if run.failed:
            if isinstance(event, (Resumed, StepFailed)) and run.paused and not run.resumed:
                run.resumed = True  # the best-effort resume of a fenced engine answered
                return self._check_resumed(event.at)
            return []
        if isinstance(event, EngineDied):
            return self._engine_failed(event.engine, "died", event.error, event.at)
        if self.phase == STAGING:
            return self._on_staging(event, run)
        if isinstance(event, StepFailed):
            return self._engine_failed(event.engine, event.step, event.error, event.at)
        if self.phase == DRAINING and isinstance(event, Drained) and run.step == "drain":
            run.step = "drained"
            return self._after_drain(event.at) if self._all("drained") else []
        if self.phase == PAUSING and isinstance(event, Paused) and run.step == "pause":
            run.step, run.paused_at = "paused", event.at
            return self._after_pause(event.at) if self._all("paused") else []
        if self.phase == SWAPPING:
            return self._on_swapping(event, run)
        if self.phase == RESUMING and isinstance(event, Resumed) and run.paused and not run.resumed:
            run.resumed, run.resumed_at = True, event.at
            return self._check_resumed(event.at)
        return []

    # -- phases ------------------------------------------------------------------------------
    def _on_staging(self, event: Event, run: _EngineRun) -> list[Action]:
        if isinstance(event, Staged) and event.version == self.version and run.step == "stage":
            run.step, run.staged_at = "staged", event.at
            if not self._all("staged"):
                return []
            return self._after_staging(event.at)
        if isinstance(event, StageFailed) and event.version == self.version:
            if run.joining:
                return self._drop_joiner(event.engine, f"failed to stage: {event.error}", event.at)
            return self._abort_staging(event.at, f"{event.engine} failed to stage: {event.error}")
        return []

    def _drop_joiner(self, engine: str, why: str, at: float, dead: bool = False) -> list[Action]:
        """A joiner failed while the version stages: it stays fenced, the others go on."""
        self.runs[engine].failed = True
        self.joining.discard(engine)
        self.messages.append(f"{engine} did not join ({why})")
        actions: list[Action] = [] if dead else [DropStaged(engine=engine, version=self.version)]
        if self._all("staged"):
            actions += self._staging_done(at)
        return actions

    def _staging_done(self, at: float) -> list[Action]:
        # Nobody left (every participant was a joiner that failed): nothing to drain or pause.
        return self._after_staging(at) if self._live_runs() else self._start_resume(at)

    def _after_staging(self, at: float) -> list[Action]:
        if self.strategy == "adapter":  # loaded everywhere: the next request names it
            for e in self._live_runs():
                self.runs[e].step = "applied"
            return self._check_applied(at)
        if self.kv_policy == "drain":
            self.phase = DRAINING
            for run in self.runs.values():
                run.step = "drain"
            return [Drain(engine=e) for e in self._live_runs()] + [self._timer(DRAINING, self.timeouts.drain_s)]
        return self._after_drain(at)

    def _after_drain(self, at: float) -> list[Action]:
        actions: list[Action] = []
        if self.kv_policy == "abort":
            actions += [AbortInflight(engine=e) for e in self._live_runs()]
        if not self._live_runs():
            return actions + self._start_resume(at)
        if not self.pauses:
            return actions + self._start_swap(at)
        self.phase = PAUSING
        mode = "abort" if self.kv_policy == "abort" else "keep"
        clear = self.kv_policy != "keep"
        for e in self._live_runs():
            self.runs[e].step, self.runs[e].paused = "pause", True
            actions.append(Pause(engine=e, mode=mode, clear_cache=clear))
        actions.append(self._timer(PAUSING, self.timeouts.pause_s))
        return actions

    def _after_pause(self, at: float) -> list[Action]:
        return self._start_swap(at)

    def _start_swap(self, at: float) -> list[Action]:
        self.phase = SWAPPING
        if not self._live_runs():
            return self._check_applied(at)
        actions: list[Action] = []
        for e in self._live_runs():
            self.runs[e].step = "swap"
            actions.append(Swap(engine=e, version=self.version, rollback=self.rollback, between_steps=not self.pauses))
        actions.append(self._timer(SWAPPING, self.timeouts.swap_s))
        return actions

    def _on_swapping(self, event: Event, run: _EngineRun) -> list[Action]:
        e = event.engine
        if isinstance(event, Swapped) and run.step == "swap" and event.version == self.version:
            run.step, run.requests = "fence_cache", dict(event.requests)
            return [FenceCache(engine=e)]
        if isinstance(event, CacheFenced) and run.step == "fence_cache":
            run.step = "set_version"
            return [SetVersion(engine=e, version=self.version)]
        if isinstance(event, VersionSet) and run.step == "set_version" and event.version == self.version:
            run.step = "applied"
            for rid, n in event.requests.items():
                run.requests.setdefault(rid, n)
            return self._check_applied(event.at)
        return []

    def _check_applied(self, at: float) -> list[Action]:
        if not self._all("applied"):
            return []
        applied = [e for e, r in self.runs.items() if not r.failed and r.step == "applied"]
        if applied:
            self.live_version = self.version  # every engine still in the fleet applied it
            self._applied = True
        return self._start_resume(at)

    def _start_resume(self, at: float) -> list[Action]:
        self.phase = RESUMING
        owed = [e for e, r in self.runs.items() if r.paused and not r.resumed]
        if not owed:
            return self._conclude(at)
        for e in owed:
            if not self.runs[e].failed:
                self.runs[e].step = "resume"
        return [Resume(engine=e) for e in owed] + [self._timer(RESUMING, self.timeouts.resume_s)]

    def _check_resumed(self, at: float) -> list[Action]:
        if self.phase != RESUMING:
            return []
        if not self._none_pending("resumed", lambda r: r.paused and not r.resumed):
            return []
        return self._conclude(at)

    def _conclude(self, at: float) -> list[Action]:
        failed = [e for e, r in self.runs.items() if r.failed and not r.joining]
        if not self._applied:
            outcome = FAILED
        elif failed:
            outcome = ENGINE_FENCED
        else:
            outcome = ACTIVATED
        joined: list[Action] = []
        for e, r in self.runs.items():
            if r.joining and not r.failed and self._applied:
                self.fenced.discard(e)
                self.joining.discard(e)
                joined.append(Unfence(engine=e, version=self.version))
        return joined + self._finish(at, outcome, "; ".join(self.messages))

    def _join_the_activation_under_way(self, engine: str) -> list[Action]:
        """A rejoin that ends while an activation (begun without it) is under way: unfenced
        now, the engine would keep the old version when that activation makes its version
        live. It joins that activation instead while it still stages, else the next one."""
        self.joining.add(engine)
        if self.phase == STAGING and not self.rollback and engine not in self.runs:
            self.runs[engine] = _EngineRun(joining=True)
            return [Stage(engine=engine, version=self.version)]
        return []

    # -- helpers -----------------------------------------------------------------------------
    def _live_runs(self) -> list[str]:
        return [e for e, r in self.runs.items() if not r.failed]

    def _all(self, step: str) -> bool:
        """Every run failed or at `step`."""
        return self._none_pending(step, lambda r: not r.failed and r.step != step)

    def _none_pending(self, key: str, pending) -> bool:
        """No run is `pending`. Asked on every answer of a phase: a full scan each time made an
        activation of N engines O(N^2) (inflight bench orchestrator --fleet-scale). Within one
        activation a run that stopped being pending for `key` stays so (steps only move forward,
        failed and resumed are final, runs are only added at the end), so each scan resumes
        where the last one stopped: O(N) per phase."""
        if self._scan_of is not self.runs:  # a new activation
            self._scan_of, self._scan_runs, self._scan_at = self.runs, [], {}
        if len(self._scan_runs) != len(self.runs):
            self._scan_runs = list(self.runs.values())
        runs, i = self._scan_runs, self._scan_at.get(key, 0)
        while i < len(runs) and not pending(runs[i]):
            i += 1
        self._scan_at[key] = i
        return i == len(runs)

    def _timer(self, phase: str, seconds: float) -> StartTimer:
        self._token += 1
        return StartTimer(engine=None, phase=phase, token=self._token, seconds=seconds)

    def _finish(self, at: float, outcome: str, message: str) -> list[Action]:
        engines = []
        for e, r in self.runs.items():
            if r.failed:
                eo = ENGINE_FENCED
            elif outcome in (ROLLED_BACK, FAILED):
                eo = ROLLED_BACK
            else:
                eo = ACTIVATED
            transfer = max(0.0, (r.staged_at or at) - self.started_at) if r.staged_at else 0.0
            pause = max(0.0, (r.resumed_at or at) - r.paused_at) if r.paused_at is not None else 0.0
            engines.append(EngineOutcome(engine=e, outcome=eo, transfer_s=transfer, pause_s=pause, swapped_requests=dict(r.requests)))
        carried = (self.kv_policy == "keep" or self._kv_kept) and outcome in (ACTIVATED, ENGINE_FENCED) \
            and self.strategy != "adapter"  # a request keeps its adapter to the end: nothing carried
        record = Record(version=self.version if self.version is not None else -1, outcome=outcome,
                        engines=tuple(engines), strategy=self.strategy, kv_policy=self.kv_policy,
                        kv_carried=carried, message=message, at=at)
        self.history.append(record)
        self.phase, self.runs = IDLE, {}
        self._token += 1  # any timer still running is stale now
        return [record]
