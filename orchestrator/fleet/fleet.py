"""The thin performer around `activation.ActivationCoordinator`: it executes the coordinator's
actions against real `Engine`s (each with a timeout), feeds the outcomes back as events, and
tracks the fleet's in-flight requests so that every token is attributed to the weights that
sampled it.

    fleet = Fleet(engines, strategy="double_buffer", kv_policy="recompute")
    await fleet.setup(plan_json, root)          # swap_init on every worker (transports.swap)
    # or, any transport: await fleet.setup(plan_json, transport="http", engine_options={id: {...}})
    completion = await fleet.generate(prompt_ids, sampling)   # routed to a serving engine
    record = await fleet.activate(version)      # stage -> pause -> swap -> fence -> label -> resume

Resume runs under a shielded cancel scope with its own limit, and `activate` ends (even when
cancelled) by resuming every engine it paused that has not answered a resume: no engine is
left paused. Per-token versions: vLLM's spans, corrected by each swap's report of how many
tokens every in-flight request had at the swap (exact: the worker runs the swap between two
forward passes). Engines must run `transports.swap.SwapWorkerExtension`.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from orchestrator.activation import coordinator as act
from orchestrator.engines.base import Engine
from orchestrator.fleet.action_run import ActionRun
from orchestrator.fleet.actions import FleetActions
from orchestrator.fleet.adapters import AdapterStaging, AdapterStore
from orchestrator.fleet.membership import FleetMembership
from orchestrator.fleet.rollouts import (  # noqa: F401 - re-exported: the fleet's request half
    ENGINE_REQUEST_PREFIX,
    FleetCompletion,
    RolloutStreams,
    SwitchReport,
    Track,
    fleet_request_id,
    version_salt,
)
from orchestrator.observe.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class FleetTimeouts:
    rpc_s: float = 60.0
    resume_limit_s: float = 30.0  # the shielded resume's own limit
    poll_s: float = 0.02


class Fleet(FleetActions, AdapterStaging, RolloutStreams, FleetMembership):
    def __init__(self, engines: Sequence[Engine], *, strategy: act.Strategy = "pause_swap",
                 kv_policy: act.KvPolicy = "recompute", timeouts: act.PhaseTimeouts | None = None,
                 fleet_timeouts: FleetTimeouts | None = None, live_version: int = 0,
                 max_redispatch: int = 3, on_outcome=None, adapters: AdapterStore | None = None) -> None:
        """`adapters` (with strategy "adapter"): where each version's LoRA adapter is."""
        self.engines = {e.engine_id: e for e in engines}
        self.init_adapters(adapters)
        self.coordinator = act.ActivationCoordinator(list(self.engines), strategy=strategy, kv_policy=kv_policy,
                                                     timeouts=timeouts, live_version=live_version)
        self.ft = fleet_timeouts or FleetTimeouts()
        self.tracks: dict[str, Track] = {}
        self._tracks_by_engine: dict[str, dict[str, Track]] = {}  # the same tracks by engine (`tracks_on`)
        # Called with every terminal outcome of `generate` (redispatched attempts included), in order;
        # nothing is kept here: a long run's memory stays flat (the replay log is the record).
        self.on_outcome = on_outcome
        # The newest activation records (each is also returned and written to the replay log).
        self.records: deque[act.Record] = deque(maxlen=64)
        self.max_redispatch = max_redispatch
        # Activation and rejoin both pause and resume engines: one at a time (issue: a rejoin
        # could resume an engine that an activation had paused mid-reload).
        self._activation_lock = anyio.Lock()
        self._events = None  # the running activation's event stream (engine deaths join it)
        self._deferred_aborts: dict[str, set[str]] = {}  # engine -> request ids, sent after resume
        self._rr = itertools.count()
        self._gates: dict[str, anyio.Event] = {}  # engines not admitting new requests (drain)
        self._gate_waiters: dict[str, anyio.CancelScope] = {}  # request id -> its wait at a gate
        self._paused: set[str] = set()
        # Engines reported dead (`engine_died`) and not resumed since: `_resume_leftovers` skips them.
        self._died: set[str] = set()
        # Pauses started but not yet answered, per engine: a Resume waits for them (see _perform).
        self._pauses_due: dict[str, int] = {}
        self._stage_source: dict = {}
        self.last_stall: dict[str, float] = {}
        # engine -> the swap report its ending rollouts wait for (see `SwitchReport`)
        self._reports_due: dict[str, SwitchReport] = {}
        # Prefix-cache salts during an activation (see `RolloutStreams._cache_salt`): engines
        # whose weights may change before a request sent now is scheduled, and the version an
        # engine was labelled with before the fleet's live version moved.
        self._salt_unsettled: set[str] = set()
        self._salt_version: dict[str, int] = {}
        self.init_membership()
        self._activations_begun = 0  # activations and rejoins begun: a request that spans one was not refused

    @classmethod
    def from_config(cls, engines: Sequence[Engine], config, **kwargs) -> Fleet:
        """A fleet whose strategy, KV policy and phase timeouts come from an ActivationConfig."""
        config.validate()
        return cls(engines, strategy=config.strategy, kv_policy=config.kv_policy,
                   timeouts=config.timeouts(), **kwargs)

    # -- set-up ------------------------------------------------------------------------------
    @property
    def strategy(self) -> str:
        return self.coordinator.strategy

    @property
    def live_version(self) -> int:
        return self.coordinator.live_version

    def worker_strategy(self) -> str:
        return "pause_swap" if self.strategy == "pause_swap" else "double_buffer"

    async def setup(self, plan_json: str, root: str | None = None, timeout_s: float = 60.0, *,
                    transport: str = "filesystem", engine_options: dict[str, dict] | None = None,
                    **extra) -> None:
        """`swap_init` on every worker. `transport`: which transport's receiver stages versions
        (filesystem: `root`; collective, ipc, http: `engine_options[engine_id]`, exactly the
        `options` of the trainer's `engine_init_info(i)` for that engine). Calling it again with
        the same options keeps each worker's receiver (a collective group stays formed); new
        options (a trainer that reconnected) rebuild it."""
        if transport != "filesystem":
            missing = sorted(set(self.engines) - set(engine_options or {}))
            if missing:
                raise ValueError(f"setup: transport {transport!r} needs engine_options for {missing}")
        elif root is None:
            raise ValueError("setup: the filesystem transport needs root")
        base = {"plan": plan_json, "root": None if root is None else str(root), "strategy": self.worker_strategy(),
                "timeout_s": timeout_s, "live_version": self.live_version, "transport": transport, **extra}
        self._init_args = (dict(base), None if engine_options is None else dict(engine_options))
        async with anyio.create_task_group() as tg:
            for engine_id, engine in self.engines.items():
                cfg = dict(base)
                if engine_options is not None and engine_id in engine_options:
                    cfg["options"] = engine_options[engine_id]
                tg.start_soon(self._rpc, engine, "swap_init", json.dumps(cfg))

    async def _rpc(self, engine: Engine, method: str, arg: str | None = None, timeout: float | None = None) -> dict:
        """Call a swap method on every worker of `engine`. Every worker's answer counts: under
        tensor parallelism a partial flip across shards must fail the phase, not hide."""
        args = (arg,) if arg is not None else ()
        results = await engine.collective_rpc(method, args=args, timeout=timeout or self.ft.rpc_s)
        answers = [_as_dict(r) for r in (results if isinstance(results, list) else [results])]
        if not answers:
            raise RuntimeError(f"{method} on {engine.engine_id}: no worker answered")
        first = answers[0]
        for i, other in enumerate(answers[1:], start=1):
            if _comparable(other) != _comparable(first):
                raise RuntimeError(f"{method} on {engine.engine_id}: workers disagree "
                                   f"(worker 0: {first}, worker {i}: {other})")
        return first

    async def engine_died(self, engine_id: str, error: str) -> None:
        """An engine is gone: fence it (no new requests; its in-flight rollouts end errored).
        During an activation the event joins it, so the coordinator decides with full state."""
        self._died.add(engine_id)
        if engine_id in self.coordinator.fenced:
            return
        if self._events is not None:
            await self._events.send(act.EngineDied(engine=engine_id, at=time.monotonic(), error=error))
            return
        for a in self.coordinator.handle(act.EngineDied(engine=engine_id, at=time.monotonic(), error=error)):
            if isinstance(a, act.Fence):
                self._fence(a.engine, a.reason)

    # -- activation --------------------------------------------------------------------------
    async def activate(self, version: int, *, rollback: bool = False, source: dict | None = None) -> act.Record:
        """Drive one activation to its record. Never leaves an engine paused. `source` goes to
        the workers' `swap_stage` (e.g. {"base_dir": ..., "lora_dir": ...} for a LoRA adapter);
        by default each stages `version` from the transport given to `setup` (filesystem: the
        committed version; a push transport: what the trainer's `sync_weights()` sends)."""
        async with self._activation_lock:
            return await self._activate(version, rollback, source)

    async def _activate(self, version: int, rollback: bool, source: dict | None) -> act.Record:
        self._activations_begun += 1
        coord = self.coordinator
        self._stage_source = dict(source or {})
        record: act.Record | None = None
        left: list[act.EngineAction] = []
        try:
            async with anyio.create_task_group() as tg:
                run = self._action_run(tg)  # done with the Record
                self._events = run  # engine deaths and departures join it
                run.dispatch(coord.begin(version, time.monotonic(), rollback=rollback))
                await run.wait()
                record, left = run.record, run.close()
                tg.cancel_scope.cancel()  # stragglers (a hung stage) and timers; drops are shielded
        finally:
            self._events = None
            if record is None:  # cancelled (or a bug) mid-activation: end it with what is known
                record = await self._abandon()
            await self._perform_leftovers(left)
            self._release_reports()
            self._settle_salts()
            await self._resume_leftovers()
            await self._retire_adapters()
            for gate in self._gates.values():
                gate.set()
            self._gates.clear()
            if record is not None:
                self.records.append(record)
        assert record is not None
        return record

    def _action_run(self, tg, finished=None) -> ActionRun:
        return ActionRun(tg, self._perform, self.coordinator.handle, finished, on_queued=self._note_queued)

    def _note_queued(self, a: act.EngineAction) -> None:
        if type(a) is act.Pause:  # on its way from now: a Resume of the engine waits for it
            self._pauses_due[a.engine] = self._pauses_due.get(a.engine, 0) + 1

    async def _perform_leftovers(self, left: list[act.EngineAction]) -> None:
        """The actions an ended run queued and no worker took (they came with its last answer):
        fences and unfences take effect, staged copies are dropped (shielded); a Pause never
        sent is no longer on its way; resumes are `_resume_leftovers`'."""
        for a in left:
            if isinstance(a, act.Pause):
                self._pauses_due[a.engine] = max(0, self._pauses_due.get(a.engine, 0) - 1)
            elif isinstance(a, (act.Fence, act.Unfence)):
                await self._perform(a)
        await self._drop_all([a for a in left if isinstance(a, act.DropStaged)])

    async def _abandon(self) -> act.Record | None:
        """The coordinator's `abandon`, performed without waiting on anything unshielded:
        fences at once, drops shielded under their own limit (resumes follow in
        `_resume_leftovers`). The next `activate` then starts from a coordinator at rest.
        None when no activation was under way (`begin` refused the version)."""
        record: act.Record | None = None
        drops: list[act.DropStaged] = []
        for a in self.coordinator.abandon(time.monotonic()):
            if isinstance(a, act.Record):
                record = a
            elif isinstance(a, act.Fence):
                self._fence(a.engine, a.reason)
            elif isinstance(a, act.DropStaged):
                drops.append(a)
            elif isinstance(a, act.Unfence):
                log.info("fleet.unfenced", engine=a.engine, version=a.version)
        await self._drop_all(drops)
        return record

    async def _drop_staged(self, a: act.DropStaged) -> None:
        if self.strategy == "adapter":
            await self._drop_adapter(a.engine, a.version)
        else:
            await self._rpc(self.engines[a.engine], "swap_drop", str(a.version))

    async def _drop_all(self, drops: list[act.DropStaged]) -> None:
        """Send the drops at once, shielded under their own limit (cleanup of a cancelled
        activation or rejoin: an unsent drop leaves a version that never went live staged)."""
        if drops:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.ft.rpc_s):
                async with anyio.create_task_group() as tg:
                    for a in drops:
                        tg.start_soon(self._drop_quietly, a)

    async def _drop_quietly(self, a: act.DropStaged) -> None:
        try:
            await self._drop_staged(a)
        except Exception as exc:  # noqa: BLE001 - a dead engine has nothing staged to keep
            log.warning("fleet.drop_failed", engine=a.engine, version=a.version, error=str(exc))

    def _settle_salts(self) -> None:
        """The activation ended: every engine serves (or is fenced from) the live version."""
        self._salt_unsettled.clear()
        self._salt_version.clear()

    def _release_reports(self, engine_id: str | None = None, reported: bool = False) -> None:
        """Wake the rollouts waiting for an engine's swap report (every engine's: the
        activation ended, whether or not each report came)."""
        for e in [engine_id] if engine_id is not None else list(self._reports_due):
            due = self._reports_due.pop(e, None)
            if due is not None:
                due.reported = reported
                due.arrived.set()

    def _note_prompt_cache(self, engine_id: str, version: int, cached: dict[str, int]) -> None:
        """Requests first scheduled after a pause-free flip that took prompt keys/values from
        the prefix cache under a salt that was not the new version's: those blocks may have
        been computed before the flip or after it, so which weights computed the prompt is
        unknown (`version_unknown`). A salt of the new version (or a request's own) cannot
        have matched blocks of the old weights."""
        for worker_rid, n in cached.items():
            track = self.tracks.get(fleet_request_id(worker_rid))
            if track is not None and track.engine == engine_id and int(n) > 0 \
                    and track.salt == version_salt(track.dispatched_version) \
                    and track.dispatched_version != version:
                track.prompt_unknown = int(n)

    def _note_switch(self, engine_id: str, version: int, requests: dict[str, int]) -> None:
        for rid, k in requests.items():
            track = self.tracks.get(rid)
            if track is not None and track.engine == engine_id:
                track.switches.append((k, version))
                policy = self.coordinator.kv_policy
                # Without a pause nothing recomputes: a request still running after a drain (it
                # timed out) keeps the keys/values of the old weights.
                keeps = policy == "keep" or (policy == "drain" and not self.coordinator.pauses)
                track.kv_mode = "keep" if keeps else policy

    async def _resume_leftovers(self) -> None:
        """Resume every engine still paused, all at once (a dead one must not delay the rest).
        An engine reported dead and still fenced is not called: over a cut link the call waits
        out `resume_limit_s`, and the activation's end with it (its lock, so the next version:
        30 s of a cluster run's steps). It stays marked paused, its deferred aborts unsent; a
        rejoin pauses, swaps and resumes it, and those aborts follow that resume."""
        async def resume_one(e: str) -> None:
            try:
                with anyio.move_on_after(self.ft.resume_limit_s):
                    await self.engines[e].resume()
            except Exception as exc:  # noqa: BLE001 - a dead engine cannot be resumed
                log.warning("fleet.resume_failed", engine=e, error=str(exc))
            self._paused.discard(e)

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for e in list(self._paused):
                    if e not in self._died or e not in self.coordinator.fenced:
                        tg.start_soon(resume_one, e)
            for e in list(self._deferred_aborts):
                await self._flush_deferred_aborts(e)

    def _fence(self, engine_id: str, reason: str) -> None:
        """No new requests; its in-flight rollouts end `errored(engine_fenced)`."""
        if engine_id in self.coordinator.leaving:
            # Out of the activation on its way out of the fleet: its rollouts finish (a drain
            # waits for them; a SIGTERM'd server finishes them itself).
            log.info("fleet.leaving_engine_out_of_activation", engine=engine_id, reason=reason)
            return
        log.warning("fleet.fenced", engine=engine_id, reason=reason)
        self.set_state(engine_id, "fenced", reason)
        for t in self.tracks_on(engine_id):
            t.fenced = True
            if t.cancel is not None:
                t.cancel.cancel()


def _as_dict(result) -> dict:
    if isinstance(result, str):
        try:
            result = json.loads(result)
        except ValueError:
            pass
    return result if isinstance(result, dict) else {"result": result}


def _comparable(answer: dict) -> dict:
    """What must agree across workers: everything but timings."""
    return {k: v for k, v in answer.items() if k != "seconds"}
