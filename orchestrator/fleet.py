"""The thin performer around `activation.ActivationCoordinator`: it executes the coordinator's
actions against real `Engine`s (each with a timeout), feeds the outcomes back as events, and
tracks the fleet's in-flight requests so that every token is attributed to the weights that
sampled it.

    fleet = Fleet(engines, strategy="double_buffer", kv_policy="recompute")
    await fleet.setup(plan_json, root)          # swap_init on every worker (transports.swap)
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
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from orchestrator import activation as act
from orchestrator.engines.base import Engine, SamplingSettings, versions_from_spans
from orchestrator.errors import (
    ActivationError,
    EngineDeadError,
    EngineError,
    FencedEngineError,
)
from orchestrator.logging import get_logger

log = get_logger(__name__)
ENGINE_REQUEST_PREFIX = "generate-tokens-"


def fleet_request_id(worker_request_id: str) -> str:
    """vLLM appends '-<random>' to request ids (and the server prefixes its own)."""
    rid = worker_request_id
    if rid.startswith(ENGINE_REQUEST_PREFIX):
        rid = rid[len(ENGINE_REQUEST_PREFIX):]
    head, sep, _tail = rid.rpartition("-")
    return head if sep else rid


def version_salt(version: int) -> str:
    """Prefix-cache salt of requests dispatched under `version`."""
    return f"inflight-v{version}"


@dataclass
class Track:
    request_id: str
    engine: str
    dispatched_version: int
    started_at: float
    n_tokens: int = 0
    switches: list[tuple[int, int]] = field(default_factory=list)  # (token index, version)
    aborted_by_activation: bool = False
    cancel: anyio.CancelScope | None = None
    fenced: bool = False
    kv_mode: str = "recompute"  # "keep" when a swap left its old keys/values in place


@dataclass
class FleetCompletion:
    request_id: str
    engine_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    dispatched_version: int
    kv_carried_across_versions: bool
    status: str  # completed, dropped, errored
    reason: str = ""
    finish_reason: str | None = None
    attempts: int = 1

    def change_points(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for i, v in enumerate(self.versions):
            if not out or out[-1][1] != v:
                out.append((i, v))
        return out


@dataclass(frozen=True)
class FleetTimeouts:
    rpc_s: float = 60.0
    resume_limit_s: float = 30.0  # the shielded resume's own limit
    poll_s: float = 0.02


class Fleet:
    def __init__(self, engines: Sequence[Engine], *, strategy: act.Strategy = "pause_swap",
                 kv_policy: act.KvPolicy = "recompute", timeouts: act.PhaseTimeouts | None = None,
                 fleet_timeouts: FleetTimeouts | None = None, live_version: int = 0,
                 replay_log=None) -> None:
        self.engines = {e.engine_id: e for e in engines}
        self.coordinator = act.ActivationCoordinator(list(self.engines), strategy=strategy, kv_policy=kv_policy,
                                                     timeouts=timeouts, live_version=live_version)
        self.ft = fleet_timeouts or FleetTimeouts()
        self.tracks: dict[str, Track] = {}
        self.completions: list[FleetCompletion] = []  # every terminal outcome, in order
        self.records: list[act.Record] = []
        self.replay_log = replay_log
        self._rr = itertools.count()
        self._gates: dict[str, anyio.Event] = {}  # engines not admitting new requests (drain)
        self._paused: set[str] = set()
        self._stage_source: dict = {}
        self.last_stall: dict[str, float] = {}

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

    async def setup(self, plan_json: str, root: str, timeout_s: float = 60.0, **extra) -> None:
        cfg = json.dumps({"plan": plan_json, "root": str(root), "strategy": self.worker_strategy(),
                          "timeout_s": timeout_s, "live_version": self.live_version, **extra})
        async with anyio.create_task_group() as tg:
            for engine in self.engines.values():
                tg.start_soon(self._rpc, engine, "swap_init", cfg)

    async def _rpc(self, engine: Engine, method: str, arg: str | None = None, timeout: float | None = None) -> dict:
        args = (arg,) if arg is not None else ()
        results = await engine.collective_rpc(method, args=args, timeout=timeout or self.ft.rpc_s)
        result = results[0] if isinstance(results, list) and results else results
        if isinstance(result, str):
            try:
                result = json.loads(result)
            except ValueError:
                pass
        return result if isinstance(result, dict) else {"result": result}

    # -- requests ----------------------------------------------------------------------------
    def _pick(self, engine_id: str | None) -> str:
        serving = self.coordinator.serving
        if engine_id is not None:
            if engine_id not in serving:
                raise FencedEngineError(engine_id, "fenced out of the fleet: it takes no new requests")
            return engine_id
        if not serving:
            raise ActivationError("no engine serves: every engine is fenced")
        return serving[next(self._rr) % len(serving)]

    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingSettings, *,
                       engine_id: str | None = None, request_id: str | None = None,
                       redispatch: bool = True) -> FleetCompletion:
        """One rollout, routed to a serving engine; ends in exactly one terminal outcome.
        Under the `abort` KV policy, a rollout aborted by an activation is recorded as dropped
        and (with `redispatch`) dispatched again as a new rollout."""
        attempts = 0
        while True:
            attempts += 1
            completion = await self._generate_once(prompt_token_ids, sampling, engine_id,
                                                   request_id if attempts == 1 else None)
            completion.attempts = attempts
            if completion.status == "dropped" and completion.reason == "aborted" and redispatch:
                continue
            return completion

    async def _generate_once(self, prompt_token_ids, sampling, engine_id, request_id) -> FleetCompletion:
        target = self._pick(engine_id)
        while target in self._gates:  # draining for an activation: wait for it to end
            await self._gates[target].wait()
            target = self._pick(engine_id)
        engine = self.engines[target]
        rid = request_id or f"r{uuid.uuid4().hex[:16]}"
        track = Track(rid, target, self.live_version, time.time())
        self.tracks[rid] = track
        tokens: list[int] = []
        logprobs: list[float] = []
        spans = None
        finish = None
        status, reason = "completed", ""
        try:
            with anyio.CancelScope() as scope:
                track.cancel = scope
                # Salted with the dispatched version: a new request never reuses keys/values
                # cached under older weights, even where vLLM cannot reset the prefix cache
                # (blocks held by running requests under `keep` or the pause-free flip).
                async for chunk in engine.generate(rid, prompt_token_ids, sampling,
                                                   cache_salt=version_salt(track.dispatched_version)):
                    tokens.extend(chunk.token_ids)
                    logprobs.extend(chunk.logprobs)
                    track.n_tokens = len(tokens)
                    if chunk.finished:
                        finish, spans = chunk.finish_reason, chunk.version_spans
            if scope.cancelled_caught or track.fenced:
                status, reason = "errored", "engine_fenced"
            elif finish == "abort" and track.aborted_by_activation:
                status, reason = "dropped", "aborted"
            elif finish == "abort":
                status, reason = "dropped", "aborted"
        except EngineDeadError as exc:
            status, reason = "errored", "engine_died"
            log.warning("fleet.request_failed", request=rid, engine=target, error=str(exc))
        except EngineError as exc:
            status, reason = "errored", "engine_fenced" if track.fenced else type(exc).__name__
        finally:
            self.tracks.pop(rid, None)
        versions = self._versions(track, spans, len(tokens))
        carried = track.kv_mode == "keep" and any(k < len(tokens) for k, _v in track.switches)
        completion = FleetCompletion(rid, target, list(prompt_token_ids), tokens, logprobs, versions,
                                     track.dispatched_version, carried, status, reason, finish)
        self.completions.append(completion)
        self._record_rollout(completion)
        return completion

    def _versions(self, track: Track, spans, n: int) -> list[int]:
        if spans is not None:
            try:
                versions = versions_from_spans(spans, n)
            except ValueError:
                versions = [track.dispatched_version] * n
        else:
            versions = [track.dispatched_version] * n
        for k, v in track.switches:
            for i in range(k, n):
                if versions[i] < v:
                    versions[i] = v
        return versions

    def _record_rollout(self, c: FleetCompletion) -> None:
        if self.replay_log is None:
            return
        from replay.records import COMPLETED, Dropped, Errored, PolicyIdentity, RolloutRecord, Timings

        status = {"completed": COMPLETED, "dropped": Dropped(c.reason),
                  "errored": Errored(c.reason)}[c.status]
        record = RolloutRecord.from_lists(
            rollout_id=abs(hash(c.request_id)) % (2**62), group_id=0, prompt_id=c.request_id, engine_id=c.engine_id,
            prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids,
            completion_logprobs=c.logprobs or [0.0] * len(c.token_ids), dispatched_version=c.dispatched_version,
            identity=PolicyIdentity("", "", "", "float32"), timings=Timings(time.time()),
            token_versions=c.versions if c.token_ids else None,
            kv_carried_across_versions=c.kv_carried_across_versions, status=status)
        self.replay_log.append(record)

    # -- activation --------------------------------------------------------------------------
    async def activate(self, version: int, *, rollback: bool = False, source: dict | None = None) -> act.Record:
        """Drive one activation to its record. Never leaves an engine paused. `source` goes to
        the workers' `swap_stage` (e.g. {"base_dir": ..., "lora_dir": ...} for a LoRA adapter);
        by default each stages `version` from the filesystem transport."""
        coord = self.coordinator
        self._stage_source = dict(source or {})
        send, recv = anyio.create_memory_object_stream[act.Event](1000)
        record: act.Record | None = None
        try:
            async with anyio.create_task_group() as tg:
                for a in self._dispatch(tg, coord.begin(version, time.monotonic(), rollback=rollback), send):
                    record = a
                while record is None:
                    event = await recv.receive()
                    for a in self._dispatch(tg, coord.handle(event), send):
                        record = a
                tg.cancel_scope.cancel()  # stragglers (a hung stage) and timers
        finally:
            await self._resume_leftovers()
            for gate in self._gates.values():
                gate.set()
            self._gates.clear()
        self.records.append(record)
        self._record_activation(record)
        return record

    def _dispatch(self, tg, actions: list[act.Action], send):
        """Starts the actions (one task per engine, its actions in order); yields a Record."""
        by_engine: dict[str, list[act.Action]] = {}
        for a in actions:
            if isinstance(a, act.Record):
                yield a
            elif isinstance(a, act.StartTimer):
                tg.start_soon(self._timer, a, send)
            else:
                by_engine.setdefault(a.engine, []).append(a)
        for engine, queue in by_engine.items():
            tg.start_soon(self._perform_all, engine, queue, send)

    async def _timer(self, timer: act.StartTimer, send) -> None:
        await anyio.sleep(timer.seconds)
        await send.send(act.Timeout(timer.engine, time.monotonic(), phase=timer.phase, token=timer.token))

    async def _perform_all(self, engine_id: str, actions: list[act.Action], send) -> None:
        for a in actions:
            event = await self._perform(a)
            if event is not None:
                await send.send(event)

    async def _perform(self, a: act.Action) -> act.Event | None:
        e = a.engine
        engine = self.engines[e]
        now = time.monotonic
        try:
            if isinstance(a, act.Stage):
                return await self._stage(engine, a)
            if isinstance(a, act.DropStaged):
                with anyio.move_on_after(self.ft.rpc_s):
                    await self._rpc(engine, "swap_drop", str(a.version))
                return None
            if isinstance(a, act.Drain):
                self._gates.setdefault(e, anyio.Event())
                while any(t.engine == e for t in self.tracks.values()):
                    await anyio.sleep(self.ft.poll_s)
                return act.Drained(e, now())
            if isinstance(a, act.AbortInflight):
                for t in list(self.tracks.values()):
                    if t.engine == e:
                        t.aborted_by_activation = True
                        await engine.abort(t.request_id)
                return None
            if isinstance(a, act.Pause):
                self._paused.add(e)
                for t in self.tracks.values():
                    if t.engine == e:
                        t.aborted_by_activation = a.mode == "abort"
                await engine.pause(a.mode, a.clear_cache)
                return act.Paused(e, now())
            if isinstance(a, act.Swap):
                arg = json.dumps({"watch": a.between_steps})
                result = await self._rpc(engine, "swap_rollback" if a.rollback else "swap_apply", arg)
                requests = {fleet_request_id(k): int(v) for k, v in (result.get("requests") or {}).items()}
                self._note_switch(e, a.version, requests)
                return act.Swapped(e, now(), version=a.version, requests=requests)
            if isinstance(a, act.FenceCache):
                await engine.reset_prefix_cache()
                return act.CacheFenced(e, now())
            if isinstance(a, act.SetVersion):
                await engine.set_weight_version(a.version)
                requests: dict[str, int] = {}
                if self.strategy == "pause_free":
                    result = await self._rpc(engine, "swap_confirm")
                    requests = {fleet_request_id(k): int(v) for k, v in (result.get("requests") or {}).items()}
                    self._note_switch(e, a.version, requests)
                return act.VersionSet(e, now(), version=a.version, requests=requests)
            if isinstance(a, act.Resume):
                await self._resume(engine)
                return act.Resumed(e, now())
            if isinstance(a, act.Fence):
                self._fence(e, a.reason)
                return None
            if isinstance(a, act.Unfence):
                log.info("fleet.unfenced", engine=e, version=a.version)
                return None
        except EngineDeadError as exc:
            return act.EngineDied(e, now(), error=str(exc))
        except (EngineError, RuntimeError, ValueError, OSError) as exc:
            step = {act.Pause: "pause", act.Swap: "swap", act.FenceCache: "fence_cache",
                    act.SetVersion: "set_version", act.Resume: "resume", act.Drain: "drain"}.get(type(a), "stage")
            if isinstance(a, act.Stage):
                return act.StageFailed(e, now(), version=a.version, error=str(exc))
            return act.StepFailed(e, now(), step=step, error=f"{type(exc).__name__}: {exc}")
        return None

    def _note_switch(self, engine_id: str, version: int, requests: dict[str, int]) -> None:
        for rid, k in requests.items():
            track = self.tracks.get(rid)
            if track is not None and track.engine == engine_id:
                track.switches.append((k, version))
                track.kv_mode = self.coordinator.kv_policy

    async def _stage(self, engine: Engine, a: act.Stage) -> act.Event:
        if a.rollback:
            state = await self._rpc(engine, "swap_live_version")
            if state.get("shadow") is None:
                return act.StageFailed(engine.engine_id, time.monotonic(), version=a.version,
                                       error="no previous version to roll back to")
            return act.Staged(engine.engine_id, time.monotonic(), version=a.version)
        source = self._stage_source if a.engine not in self.coordinator.rejoining else {}
        await self._rpc(engine, "swap_stage", json.dumps({**source, "version": a.version, "attempt": 0}))
        while True:
            status = await self._rpc(engine, "swap_status")
            if status.get("version") == a.version and status.get("state") == "staged":
                return act.Staged(engine.engine_id, time.monotonic(), version=a.version)
            if status.get("state") == "failed":
                return act.StageFailed(engine.engine_id, time.monotonic(), version=a.version,
                                       error=str(status.get("error")))
            await anyio.sleep(self.ft.poll_s)

    async def _resume(self, engine: Engine) -> None:
        """Shielded, with its own limit: a cancelled activation still resumes the engine."""
        with anyio.CancelScope(shield=True):
            with anyio.fail_after(self.ft.resume_limit_s):
                await engine.resume()
        self._paused.discard(engine.engine_id)

    async def _resume_leftovers(self) -> None:
        with anyio.CancelScope(shield=True):
            for e in list(self._paused):
                try:
                    with anyio.move_on_after(self.ft.resume_limit_s):
                        await self.engines[e].resume()
                except Exception as exc:  # noqa: BLE001 - a dead engine cannot be resumed
                    log.warning("fleet.resume_failed", engine=e, error=str(exc))
                self._paused.discard(e)

    def _fence(self, engine_id: str, reason: str) -> None:
        """No new requests; its in-flight rollouts end `errored(engine_fenced)`."""
        log.warning("fleet.fenced", engine=engine_id, reason=reason)
        for t in list(self.tracks.values()):
            if t.engine == engine_id:
                t.fenced = True
                if t.cancel is not None:
                    t.cancel.cancel()

    def _record_activation(self, record: act.Record) -> None:
        if self.replay_log is None:
            return
        from replay.records import ActivationRecord, EngineActivation

        self.replay_log.append(ActivationRecord(
            version=record.version, outcome=record.outcome,
            engines=[EngineActivation(eo.engine, eo.transfer_s, eo.pause_s, eo.outcome) for eo in record.engines],
            activated_at=time.time(), message=record.message[:1000], strategy=record.strategy,
            kv_policy=record.kv_policy, kv_carried=record.kv_carried))

    async def rejoin(self, engine_id: str) -> bool:
        """Re-sync a fenced engine to the live version; True when it serves again."""
        coord = self.coordinator
        send, recv = anyio.create_memory_object_stream[act.Event](100)
        done = False
        try:
            async with anyio.create_task_group() as tg:
                pending = coord.rejoin(engine_id, time.monotonic())
                while True:
                    list(self._dispatch(tg, pending, send))
                    if any(isinstance(a, act.Unfence) for a in pending) or engine_id not in coord.rejoining:
                        done = engine_id not in coord.fenced
                        break
                    pending = coord.handle(await recv.receive())
                tg.cancel_scope.cancel()
        finally:
            await self._resume_leftovers()
        return done
