"""Engines that come and go: the membership half of the `Fleet`.

    await fleet.add(engine, source="fleet add")   # started engine -> in the fleet, fenced
    await fleet.bring_in(engine_id)               # -> the live version, then serving
    await fleet.drain(engine_id, drain_s)         # no new requests; what it holds finishes
    fleet.remove(engine_id)                       # gone (after a drain, or lost and replaced)

An engine enters fenced and serves only once it holds the live version. It stages that version
*outside* the activation lock, beside the serving engines' generation, so no activation waits
for its transfer; only its own pause, swap, cache fence and label run under the lock (what
`Fleet.rejoin` does, a few milliseconds). If a version went live while it staged, it stages the
newer one. The same path brings back a fenced engine that answers again and starts a
replacement.

A leaving engine takes no new request and no later activation includes it (`coordinator.leave`);
its rollouts finish under the weights they started with, or past `drain_s` are aborted (each
then ends `dropped` with its record and the scheduler samples it again elsewhere).

`members` keeps one `EngineMember` per engine the run ever had (for /stats and `inflight
stats`): where it came from, its state, first and last version it served, rollouts and tokens.
"""

from __future__ import annotations

import json
import time
from typing import Literal

import anyio
import msgspec

from orchestrator.activation import coordinator as act
from orchestrator.observe.logging import get_logger

log = get_logger(__name__)

MemberState = Literal["joining", "serving", "fenced", "draining", "left", "lost", "refused"]
MEMBER_STATES: tuple[str, ...] = MemberState.__args__  # type: ignore[attr-defined]
PRESTAGE_ROUNDS = 4  # stage, find the fleet moved on, stage the newer version: at most this often


class EngineMember(msgspec.Struct):
    """One engine's life in a run's fleet. Times are wall-clock seconds (time.time())."""

    engine: str
    source: str  # "config", "fleet add", "replacement of engine-1"
    state: MemberState
    joined_at: float
    url: str | None = None
    serving_at: float | None = None  # when it first served (held the live version)
    left_at: float | None = None
    first_version: int | None = None  # the versions of the first and last rollout it sampled
    last_version: int | None = None
    rollouts: int = 0  # rollouts that ended on it (any outcome)
    tokens: int = 0  # completion tokens it sampled
    why: str = ""  # the last change of state, in words


class FleetMembership:
    """Mixed into `Fleet`: requires `engines`, `coordinator`, `tracks`, `ft`, `strategy`,
    `live_version`, `_activation_lock`, `_events`, `_rpc`, `_action_run`, `_perform_leftovers`,
    `_drop_all`, `_release_reports`, `_settle_salts`, `_resume_leftovers`, `_activations_begun`,
    `abort_many`, `tracks_on`."""

    def init_membership(self) -> None:
        now = time.time()
        self.members: dict[str, EngineMember] = {
            e: EngineMember(engine=e, source="config", state="serving", joined_at=now, serving_at=now,
                            url=getattr(engine, "url", None))
            for e, engine in self.engines.items()}
        self._init_args: tuple[dict, dict[str, dict] | None] | None = None  # what `setup` sent
        self._prestaged: dict[str, int] = {}  # engine -> the version it staged before its rejoin
        self.on_member_change = None  # called with (engine, state) after every change of state
        self.used_ids: set[str] = set()  # ids engines of an earlier incarnation of the run had (resume)

    # -- the record ------------------------------------------------------------------------
    def note_served(self, engine_id: str, version: int, tokens: int) -> None:
        m = self.members.get(engine_id)
        if m is None:
            return
        if m.first_version is None:
            m.first_version = version
        m.last_version = version
        m.rollouts += 1
        m.tokens += tokens

    def set_state(self, engine_id: str, state: MemberState, why: str = "") -> None:
        m = self.members.get(engine_id)
        if m is None or m.state == state:
            return
        m.state, m.why = state, why or m.why
        if state == "serving" and m.serving_at is None:
            m.serving_at = time.time()
        if state in ("left", "lost", "refused"):
            m.left_at = time.time()
        log.info("fleet.member", engine=engine_id, state=state, why=why)
        if self.on_member_change is not None:
            self.on_member_change(engine_id, state)

    def member_counts(self) -> dict[str, int]:
        counts = {s: 0 for s in MEMBER_STATES}
        for m in self.members.values():
            counts[m.state] += 1
        return counts

    # -- joining -----------------------------------------------------------------------------
    def new_engine_id(self, reserved: set[str] | frozenset[str] = frozenset()) -> str:
        """The next free `engine-<n>` (ids are never reused: records name engines by id), past
        those `reserved` (engines still starting, not yet members) and those an earlier incarnation
        of a resumed run gave out (`used_ids`): a resumed run's new engine never takes the id of one
        in the log already."""
        n = len(self.members)
        while f"engine-{n}" in self.members or f"engine-{n}" in reserved or f"engine-{n}" in self.used_ids:
            n += 1
        return f"engine-{n}"

    def add(self, engine, *, source: str) -> None:
        """A started engine enters the fleet, fenced (it serves after `bring_in`)."""
        engine_id = engine.engine_id
        if engine_id in self.members and self.members[engine_id].state not in ("left", "lost", "refused"):
            raise ValueError(f"{engine_id} is already in the fleet")
        self.coordinator.add_engine(engine_id)
        self.engines[engine_id] = engine
        self.members[engine_id] = EngineMember(engine=engine_id, source=source, state="joining",
                                               joined_at=time.time(), url=getattr(engine, "url", None))

    async def init_engine(self, engine) -> None:
        """`swap_init` on an engine that was not there at `setup` (or restarted since): the same
        transport and plan, with what it holds called version 0 until its rejoin swaps."""
        if self.strategy == "adapter":
            return  # adapters need no receiver in the workers
        if self._init_args is None:
            raise RuntimeError("init_engine before setup")
        base, options = self._init_args
        cfg = {**base, "live_version": 0}
        if options is not None:
            if engine.engine_id not in options:
                raise ValueError(f"the {base.get('transport')} transport cannot take a new engine "
                                 "(its trainer sends each version once, to the engines it formed a group with)")
            cfg["options"] = options[engine.engine_id]
        await self._rpc(engine, "swap_init", json.dumps(cfg))

    async def bring_in(self, engine_id: str) -> bool:
        """Bring a fenced engine (new, a replacement, or one that answers again) to the live
        version and unfence it; True when it serves. Its transfer runs beside everything else
        (no lock); only its own switch runs under the activation lock."""
        engine = self.engines[engine_id]
        self.set_state(engine_id, "joining", f"catching up with version {self.live_version}")
        await self.init_engine(engine)
        for _ in range(PRESTAGE_ROUNDS if self.strategy != "adapter" else 0):
            version = self.live_version
            if not await self._prestage(engine, version):
                break
            async with self._activation_lock:
                if self.live_version == version:
                    self._prestaged[engine_id] = version
                    return self._joined(engine_id, await self._rejoin(engine_id))
            log.info("fleet.join_restage", engine=engine_id, staged=version, live=self.live_version)
        async with self._activation_lock:
            return self._joined(engine_id, await self._rejoin(engine_id))

    def _joined(self, engine_id: str, ok: bool) -> bool:
        self._prestaged.pop(engine_id, None)
        if ok:
            self.set_state(engine_id, "serving", f"serves version {self.live_version}")
        else:
            self.set_state(engine_id, "fenced", "could not catch up with the live version")
        return ok

    async def _prestage(self, engine, version: int) -> bool:
        """Stage `version` on `engine` (not yet serving) and wait for it, bounded by the rejoin
        timeout. False (logged) when it failed: the rejoin then stages under the lock itself."""
        try:
            with anyio.fail_after(self.coordinator.timeouts.rejoin_s):
                await self._rpc(engine, "swap_stage", json.dumps({"version": version}))
                while True:
                    status = await self._rpc(engine, "swap_status")
                    if status.get("version") == version and status.get("state") == "staged":
                        return True
                    if status.get("state") == "failed":
                        raise RuntimeError(str(status.get("error")))
                    await anyio.sleep(self.ft.poll_s)
        except Exception as exc:  # noqa: BLE001 - a failed pre-stage only costs the lock's time
            log.warning("fleet.prestage_failed", engine=engine.engine_id, version=version, error=str(exc))
            return False

    async def staged_before(self, engine, version: int) -> bool:
        """Did `bring_in` stage exactly this version on the engine already (and is it still there)?"""
        if self._prestaged.pop(engine.engine_id, None) != version:
            return False
        status = await self._rpc(engine, "swap_status")
        return status.get("version") == version and status.get("state") == "staged"

    # -- leaving -----------------------------------------------------------------------------
    async def drain(self, engine_id: str, drain_s: float, why: str = "drained") -> int:
        """No new requests to the engine and no activation waits on it; its rollouts finish, or
        past `drain_s` are aborted. Returns how many were aborted. The engine stays in `engines`
        until `remove` (the caller shuts down an engine it owns)."""
        self.set_state(engine_id, "draining", why)
        await self.mark_leaving(engine_id)
        with anyio.move_on_after(drain_s):
            while self._holds(engine_id):
                await anyio.sleep(self.ft.poll_s)
        left = [t.request_id for t in self.tracks_on(engine_id)]
        if left:
            log.warning("fleet.drain_expired", engine=engine_id, aborting=len(left), drain_s=drain_s)
            for t in self.tracks_on(engine_id):
                t.left = True
            await self.abort_many(left)
            with anyio.move_on_after(self.ft.rpc_s):
                while self._holds(engine_id):
                    await anyio.sleep(self.ft.poll_s)
            for t in self.tracks_on(engine_id):  # an engine that does not answer its abort
                if t.cancel is not None:
                    t.cancel.cancel()
        return len(left)

    def _holds(self, engine_id: str) -> bool:
        return bool(self.tracks_on(engine_id))

    async def remove(self, engine_id: str, state: MemberState = "left", why: str = "") -> None:
        """The engine is out of the fleet (drained, or lost for good); between activations."""
        async with self._activation_lock:
            if engine_id in self.coordinator.engines:
                self.coordinator.remove_engine(engine_id)
            self.engines.pop(engine_id, None)
        self.set_state(engine_id, state, why)

    # -- the way back, and out -----------------------------------------------------------------
    async def mark_leaving(self, engine_id: str) -> None:
        """The engine takes no new request and no later activation includes it; an activation
        under way drops it without failing the version (the event joins its stream)."""
        if self._events is not None:
            await self._events.send(act.EngineLeaving(engine=engine_id, at=time.monotonic()))
            return
        await self._drop_all([a for a in self.coordinator.leave(engine_id, time.monotonic())
                              if isinstance(a, act.DropStaged)])

    def join_next(self, engine_id: str) -> None:
        """A fenced engine comes back with the next version that goes live (see
        `ActivationCoordinator.join_next`): the way back under a push transport, whose trainer
        never sends the live version again. First the engine must be ready to receive (after a
        restart: `setup` again, which keeps the other engines' receivers) and the trainer must
        send to it again (`sync.include_engine(i)`); the next `activate` then stages, flips and
        unfences it with the others."""
        self.coordinator.join_next(engine_id)

    async def rejoin(self, engine_id: str) -> bool:
        """Re-sync a fenced engine to the live version; True when it serves again. (A push
        transport never sends the live version again: use `join_next` there.)"""
        async with self._activation_lock:
            return await self._rejoin(engine_id)

    async def _rejoin(self, engine_id: str) -> bool:
        self._activations_begun += 1
        coord = self.coordinator
        done = False
        left: list = []
        try:
            async with anyio.create_task_group() as tg:
                run = self._action_run(tg, lambda actions: any(isinstance(a, act.Unfence) for a in actions)
                                       or engine_id not in coord.rejoining)
                run.dispatch(coord.rejoin(engine_id, time.monotonic()))
                await run.wait()
                done = engine_id not in coord.fenced
                left = run.close()
                tg.cancel_scope.cancel()
        finally:
            if not done:  # cancelled mid-rejoin: the engine stays fenced, and may rejoin later
                await self._drop_all([a for a in coord.abandon_rejoin(engine_id) if isinstance(a, act.DropStaged)])
            await self._perform_leftovers(left)
            self._release_reports()
            self._settle_salts()
            await self._resume_leftovers()
        return done
