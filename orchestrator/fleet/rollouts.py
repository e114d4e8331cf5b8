"""Rollout streaming and version attribution: the request half of the `Fleet`.

`RolloutStreams` streams one rollout from an engine (salted with its dispatched version, so
no new request reuses keys/values of older weights), keeps a `Track` per request in flight
so that an activation can note the exact token index where each request switched version,
and turns the engine's version spans plus those switch reports into one version per token.
It also gives the scheduler what it needs: per-engine load, batched aborts that never reach
a paused engine, and real timings (dispatch, first token, end; wall clock) per rollout.

Streaming costs no per-token Python work here: tokens arrive in chunks and are extended as
lists; with `final_only` an in-process engine sends one chunk per request.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from orchestrator.engines.base import SamplingSettings, VersionSpan
from orchestrator.errors import ActivationError, EngineDeadError, EngineError, FencedEngineError
from orchestrator.observe.logging import get_logger

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
class SwitchReport:
    """A swap report an engine owes the fleet: set once its requests (and, for a flip
    between steps, the confirm's) are noted on the tracks, or once the activation ended
    without it (`reported` False)."""

    between_steps: bool
    arrived: anyio.Event = field(default_factory=anyio.Event)
    reported: bool = False


@dataclass
class Track:
    request_id: str
    engine: str
    dispatched_version: int
    started_at: float
    tokens: list[int] = field(default_factory=list)  # the completion's tokens, as they stream
    switches: list[tuple[int, int]] = field(default_factory=list)  # (token index, version)
    aborted_by_activation: bool = False
    cancel: anyio.CancelScope | None = None
    fenced: bool = False
    kv_mode: str = "recompute"  # "keep" when a swap left its old keys/values in place
    first_token_at: float | None = None
    salt: str = ""  # the prefix-cache salt it was sent with
    # > 0: that many prompt tokens came from the prefix cache under weights not known (see
    # `Fleet._note_prompt_cache`)
    prompt_unknown: int = 0
    abort_sent: bool = False  # the fleet asked its engine to abort it (an abort not asked for is the engine's)
    left: bool = False  # aborted because its engine left the fleet (`FleetMembership.drain`)

    @property
    def n_tokens(self) -> int:
        """Progress, readable while it streams (no counter kept per chunk)."""
        return len(self.tokens)


@dataclass
class FleetCompletion:
    request_id: str
    engine_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    # [(first token index, version), ...]: where the (non-decreasing) per-token version changes.
    # Kept as change points, not one version per token: expanding costs per token and the
    # record stores change points anyway (`versions` expands on demand).
    changes: list[tuple[int, int]]
    dispatched_version: int
    kv_carried_across_versions: bool
    status: str  # completed, dropped, errored
    reason: str = ""
    finish_reason: str | None = None
    attempts: int = 1
    # Wall-clock instants (time.time()) observed here: dispatch, first token chunk, end.
    dispatched_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    message: str = ""
    # What the engine reported it ran as the prompt, where it reports it (None: not reported).
    engine_prompt_token_ids: list[int] | None = None
    # Dropped before its first token by an abort nobody here asked for, with no activation under
    # way since it was sent: the engine refused it (a server told to stop refuses every request).
    refused: bool = False
    # A multi-turn episode (orchestrator/run/episodes.py): the completion tokens the environment
    # wrote, [(start, end), ...] (their logprobs are NaN), and why the episode ended.
    environment_spans: list[tuple[int, int]] | None = None
    episode_end: str | None = None

    def change_points(self) -> list[tuple[int, int]]:
        return list(self.changes)

    @property
    def versions(self) -> list[int]:
        """The policy version of every completion token."""
        n = len(self.token_ids)
        out: list[int] = []
        for i, (start, version) in enumerate(self.changes):
            end = self.changes[i + 1][0] if i + 1 < len(self.changes) else n
            out += [version] * (end - start)
        return out


def spans_cover(spans, n: int) -> bool:
    """Whether the engine's version spans label exactly tokens 0..n, contiguously."""
    if not spans:
        return False
    covered = [s for s in spans if s.end > s.start]
    return bool(covered) and covered[0].start == 0 and spans[-1].end == n and all(
        a.end == b.start for a, b in zip(spans, spans[1:]))


def change_points(spans, n: int, dispatched_version: int, switches: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Per-token versions of n tokens as change points: the engine's spans (or the dispatched
    version when it reported none or inconsistent ones), raised at each switch the activation
    reported ((k, v): from token k on, at least version v: the worker swapped before it)."""
    if n == 0:
        return []
    base: list[tuple[int, int]] = [(0, dispatched_version)]
    if spans_cover(spans, n):
        base = [(s.start, s.version) for s in spans if s.end > s.start]
    if not switches:
        return _compress(base)
    bounds = sorted({s for s, _ in base} | {k for k, _ in switches if k < n})
    points = []
    for b in bounds:
        value = max(v for s, v in base if s <= b)
        raised = [v for k, v in switches if k <= b]
        points.append((b, max([value, *raised])))
    return _compress(points)


def _compress(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, version in points:
        if not out or out[-1][1] != version:
            out.append((start, version))
    return out


class RolloutStreams:
    """Mixed into `Fleet`: requires `engines`, `coordinator`, `ft`, `tracks`, `_tracks_by_engine`, `request_adapter`,
    `_gates`, `_gate_waiters`, `_paused`, `_deferred_aborts`, `_reports_due`, `_salt_unsettled`, `_salt_version`,
    `_rr` and `live_version`."""

    def leaving_or_gone(self, engine_id: str) -> bool:
        """Whether the engine is leaving the fleet (drained, or its server told to stop) or has
        left: a rollout dispatched to it that has not started never reaches it."""
        return engine_id in self.coordinator.leaving or engine_id not in self.coordinator.engines

    def _pick(self, engine_id: str | None) -> str:
        if engine_id is not None:  # the scheduler's choice (not `serving`: a new tuple of the fleet per rollout)
            if not self.coordinator.may_dispatch(engine_id):
                raise FencedEngineError(engine_id, "fenced out of the fleet: it takes no new requests")
            return engine_id
        serving = self.coordinator.serving
        if not serving:
            raise ActivationError("no engine serves: every engine is fenced")
        return serving[next(self._rr) % len(serving)]

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingSettings, *,
                       engine_id: str | None = None, request_id: str | None = None,
                       redispatch: bool = True, final_only: bool = False) -> FleetCompletion:
        """One rollout, routed to a serving engine; ends in exactly one terminal outcome.
        Under the `abort` KV policy, a rollout aborted by an activation is dropped and (with
        `redispatch`, at most `max_redispatch` times) dispatched again as a new rollout; the
        orchestrator's scheduler passes redispatch=False and replaces it itself.

        Cancelled, it aborts the request on its engine (shielded, bounded) and re-raises: the
        caller writes the terminal record (the scheduler has already decided what it is)."""
        attempts = 0
        while True:
            attempts += 1
            completion = await self._generate_once(prompt_token_ids, sampling, engine_id,
                                                   request_id if attempts == 1 else None, final_only)
            completion.attempts = attempts
            if (completion.status == "dropped" and completion.reason == "aborted" and redispatch
                    and attempts <= self.max_redispatch):
                continue
            return completion

    async def _generate_once(self, prompt_token_ids, sampling, engine_id, request_id,
                             final_only: bool = False) -> FleetCompletion:
        target = self._pick(engine_id)
        if target in self._gates:  # draining for an activation: wait for it to end (an abort ends the wait)
            with anyio.CancelScope() as waiting:
                if request_id is not None:
                    self._gate_waiters[request_id] = waiting
                try:
                    while target in self._gates:
                        await self._gates[target].wait()
                        target = self._pick(engine_id)
                finally:
                    self._gate_waiters.pop(request_id, None)
            if waiting.cancel_called:  # aborted before any engine saw it
                return FleetCompletion(request_id, target, list(prompt_token_ids), [], [], [], self.live_version,
                                       False, "dropped", "aborted", None, finished_at=time.time(),
                                       message="aborted while waiting for an activation (never sent)")
        engine = self.engines[target]
        activations_before = self._activations_begun
        rid = request_id or f"r{uuid.uuid4().hex[:16]}"
        track = Track(rid, target, self.live_version, time.time())
        self.tracks[rid] = track
        self._tracks_by_engine.setdefault(target, {})[rid] = track
        tokens = track.tokens  # extended in place: the track's progress
        logprobs: list[float] = []
        spans = None
        finish = None
        engine_prompt = None
        status, reason, message = "completed", "", ""
        kwargs: dict = {"final_only": True} if final_only else {}
        adapter = self.request_adapter(track.dispatched_version)
        if adapter is not None:
            kwargs["adapter"] = adapter
        try:
            with anyio.CancelScope() as scope:
                track.cancel = scope
                track.salt = self._cache_salt(target, rid, track)
                async for chunk in engine.generate(rid, prompt_token_ids, sampling, cache_salt=track.salt, **kwargs):
                    # The per-chunk work is kept to list extends: it runs for every chunk of
                    # every rollout in flight (inflight bench orchestrator measures it).
                    ids = chunk.token_ids
                    if ids:
                        if track.first_token_at is None:
                            track.first_token_at = time.time()
                        tokens += ids
                        logprobs += chunk.logprobs
                    if chunk.finished:
                        finish, spans, engine_prompt = chunk.finish_reason, chunk.version_spans, chunk.prompt_token_ids
            fenced = (scope.cancelled_caught or track.fenced) and not track.left
            # No coroutine when no report is owed (every rollout but those an activation crossed).
            reported = (fenced or track.left or track.engine not in self._reports_due
                        or await self._switch_reported(track))
            if track.left:
                status, reason = "dropped", "aborted"
                message = f"{target} left the fleet before this rollout finished (fleet.drain_s passed)"
            elif fenced:
                status, reason = "errored", "engine_fenced"
            elif finish == "abort":
                status, reason = "dropped", "aborted"
            elif not reported:
                status, reason = "errored", "version_unknown"
                message = (f"{target} flipped weights between steps while this rollout ran and the "
                           "activation ended without reporting where: its tokens' versions are unknown")
            elif track.prompt_unknown:
                status, reason = "errored", "version_unknown"
                message = (f"first scheduled on {target} after a pause-free flip, it took "
                           f"{track.prompt_unknown} prompt tokens from the prefix cache under salt "
                           f"{track.salt!r}: computed before the flip or after it, unknown")
            elif len(logprobs) != len(tokens):
                # Never invent a logprob: a completion without them is not a usable sample.
                status, reason = "errored", "missing_logprobs"
                message = f"{len(logprobs)} logprobs for {len(tokens)} tokens"
        except EngineDeadError as exc:
            status, reason, message = "errored", "engine_died", str(exc)
            log.warning("fleet.request_failed", request=rid, engine=target, error=str(exc))
        except EngineError as exc:
            status = "errored"
            reason = "engine_fenced" if track.fenced else _error_kind(exc)
            message = str(exc)
        except BaseException:
            # Cancelled (the run stops, or the caller gave up): the engine must not keep
            # generating a rollout that nobody will record.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.ft.resume_limit_s):
                try:
                    await engine.abort(rid)
                except Exception:  # noqa: BLE001 - a dead engine has nothing to abort
                    pass
            raise
        finally:
            self.tracks.pop(rid, None)
            self._tracks_by_engine[target].pop(rid, None)
        if self.strategy == "adapter":
            # Its adapter is its version, first token to last; the engine's labels say nothing
            # about adapters (every engine stays labelled 0).
            spans = [VersionSpan(track.dispatched_version, 0, len(tokens))] if tokens else None
        if tokens and not spans_cover(spans, len(tokens)):
            # The per-token versions then fall back to the dispatched one (raised by the swaps'
            # reports): say so, since that is the fleet's inference, not the engine's label.
            log.warning("fleet.version_spans_missing", request=rid, engine=target, tokens=len(tokens),
                        spans=[(s.version, s.start, s.end) for s in spans or ()], switches=track.switches)
        changes = change_points(spans, len(tokens), track.dispatched_version, track.switches)
        carried = track.kv_mode == "keep" and any(k < len(tokens) for k, _v in track.switches)
        if status == "errored" and reason in ("missing_logprobs", "version_unknown"):
            tokens, logprobs, changes = [], [], []
        # Nobody here asked and no activation touched the engine meanwhile (its pause or abort
        # policy can end a request before its first token): the engine refused it (a server
        # told to stop drains what it holds and aborts every new request); the run asks why.
        refused = (status == "dropped" and finish == "abort" and not tokens and not track.left
                   and not (track.abort_sent or track.aborted_by_activation)
                   and self._activations_begun == activations_before and self._events is None)
        completion = FleetCompletion(rid, target, list(prompt_token_ids), tokens, logprobs, changes,
                                     track.dispatched_version, carried, status, reason, finish,
                                     dispatched_at=track.started_at, first_token_at=track.first_token_at,
                                     finished_at=time.time(), message=message, engine_prompt_token_ids=engine_prompt,
                                     refused=refused)
        self.note_served(target, track.dispatched_version, len(tokens))
        if self.on_outcome is not None:
            self.on_outcome(completion)
        return completion

    def _cache_salt(self, engine_id: str, rid: str, track: Track) -> str:
        """The request's prefix-cache salt: the version of the weights it will run under, so a
        new request never reuses keys/values cached under other weights, even where vLLM cannot
        reset the prefix cache (blocks held by running requests under `keep` or the pause-free
        flip). While an activation pauses or swaps the engine that version is not known (the
        request may be scheduled on either side of the swap): then a salt of its own, shared
        with no other request. Once the engine is labelled with the new version, that version,
        though the fleet's live version moves only when every engine has it."""
        if engine_id in self._salt_unsettled:
            return f"{version_salt(track.dispatched_version)}-{rid}"
        return version_salt(self._salt_version.get(engine_id, track.dispatched_version))

    async def _switch_reported(self, track: Track) -> bool:
        """Wait (bounded) for the swap report its engine owes, if any: the rollout's stream may
        end before the report of a swap it crossed comes back, and its per-token versions need
        it. False when a flip between steps went unreported (its later tokens' versions are then
        unknown); a missing report of a swap under pause cannot concern tokens already streamed."""
        due = self._reports_due.get(track.engine)
        if due is None:
            return True
        with anyio.move_on_after(self.ft.rpc_s * 2):
            await due.arrived.wait()
        return due.reported or not due.between_steps

    def _versions(self, track: Track, spans, n: int) -> list[int]:
        """One version per token (see `change_points`)."""
        c = FleetCompletion("", "", [], [0] * n, [], change_points(spans, n, track.dispatched_version,
                                                                      track.switches), 0, False, "")
        return c.versions

    def tracks_on(self, engine_id: str) -> list[Track]:
        """The requests in flight on one engine. Kept per engine: a scan of every request for
        each engine made an activation O(engines x requests) (a drain polls it)."""
        return list(self._tracks_by_engine.get(engine_id, {}).values())

    # -- what the scheduler needs -------------------------------------------------------------
    def load(self) -> dict[str, int]:
        """Requests in flight per serving engine."""
        counts = {e: 0 for e in self.coordinator.serving}
        for t in self.tracks.values():
            if t.engine in counts:
                counts[t.engine] += 1
        return counts

    async def abort_many(self, request_ids: Sequence[str]) -> None:
        """Abort these requests, batched per engine. A request on a paused engine is aborted
        when it resumes (no abort reaches a paused engine); one that already finished is
        ignored (an abort that arrives late is harmless)."""
        by_engine: dict[str, list[str]] = {}
        for rid in request_ids:
            track = self.tracks.get(rid)
            if track is not None:
                track.abort_sent = True
                by_engine.setdefault(track.engine, []).append(rid)
            elif rid in self._gate_waiters:  # not sent yet: waiting at a drain gate
                self._gate_waiters[rid].cancel()
        async with anyio.create_task_group() as tg:
            for engine_id, rids in by_engine.items():
                if engine_id in self._paused:
                    self._deferred_aborts.setdefault(engine_id, set()).update(rids)
                else:
                    tg.start_soon(self._abort_on, engine_id, rids)

    async def _abort_on(self, engine_id: str, request_ids: Sequence[str]) -> None:
        engine = self.engines.get(engine_id)  # None: it left the fleet (its requests end with it)
        live = [rid for rid in request_ids if rid in self.tracks]
        if not live or engine is None:
            return
        with anyio.move_on_after(self.ft.rpc_s):
            try:
                await engine.abort_many(live)  # one call per engine
            except EngineError as exc:
                log.warning("fleet.abort_failed", engine=engine_id, requests=len(live), error=str(exc))


def _error_kind(exc: Exception) -> str:
    """A stable snake_case name for an engine error (EngineGenerateError -> engine_generate_error)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()
