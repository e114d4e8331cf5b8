"""The run's side of a fleet that changes (docs/fleet.md): engines join, leave, are lost and
replaced while rollouts go on. The fleet does each change (`fleet.membership`); this module
decides when, tells the scheduler, and answers the run's HTTP control routes.

- Join (`POST /fleet/engines`, `inflight fleet add RUN_DIR URL`): a server attached by URL is
  checked against an engine already serving (model, tokenizer, dtype, logprobs mode, LoRA; a
  mismatch is refused naming the field, the run unaffected), reset to the base weights, brought
  to the live version beside the others' generation, and only then offered rollouts.
- Leave (`POST /fleet/engines/{id}/drain`, `inflight fleet drain RUN_DIR ENGINE`, or SIGTERM to
  its server, found by a probe or by a request the server refused): no new rollout, no later
  activation includes it, its rollouts finish (past `fleet.drain_s` they are aborted, recorded
  and sampled again elsewhere), then it leaves.
- Lost: with `fleet.replace`, an engine the run started is replaced by a new one of the same
  settings, which joins as above (a Ray-placed one: `orchestrator.run.cluster.replace_lost`). A
  fenced server that answers again comes back the same way.
- `fleet.min_engines`: below it the scheduler admits no new group; /healthz and the display say
  why; after `fleet.min_engines_wait_s` the run stops with exit 2 and one line.

Every change of an engine's state is appended to RUN_DIR/fleet.jsonl (read by `inflight stats`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import msgspec

from orchestrator.errors import ConfigError
from orchestrator.observe.logging import get_logger
from orchestrator.scheduling import scheduler as sch

log = get_logger(__name__)
FLEET_LOG = "fleet.jsonl"
IDENTITY_FIELDS = ("model", "tokenizer", "dtype", "logprobs_mode", "lora")
REPLACE_ATTEMPTS = 3


class FleetRefused(Exception):
    """A membership change refused (HTTP 4xx), naming the field or engine at fault."""

    def __init__(self, status: int, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.status, self.field, self.reason = status, field, reason


class FleetKeeper:
    def __init__(self, loop) -> None:
        self.loop = loop
        self.run = loop.run
        self.config = loop.run.config.fleet
        self.busy: set[str] = set()  # engines with a membership change under way (ids reserved too)
        self.joining_urls: set[str] = set()
        self.below_since: float | None = None
        self.paused_why: str | None = None  # why admission is paused (too few engines)
        self.replacing = 0
        self._tg = None
        self._log_path = Path(self.run.run_dir) / FLEET_LOG
        self._logged: dict[str, str] = {}

    @property
    def fleet(self):
        return self.run.fleet

    # -- the task ----------------------------------------------------------------------------
    async def main(self) -> None:
        logged = logged_members(self._log_path) if getattr(self.run, "resume", False) else []
        joined_before = joined_urls(logged)
        self.fleet.used_ids |= logged_engine_ids(logged)  # the ids engines had before a resume stay theirs
        self.log_states()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self.fleet.on_member_change = self._changed
                tg.start_soon(self._probe)
                tg.start_soon(self._watch_minimum)
                if joined_before:
                    tg.start_soon(self._join_again, joined_before)
                await anyio.sleep_forever()
        finally:
            self.fleet.on_member_change = None
            self._tg = None

    def _changed(self, engine_id: str, state: str) -> None:
        """Every change is written at once; an engine fenced by an activation (it died there)
        is a loss like one seen by its requests."""
        self.log_states()
        if engine_id in self.busy or self._tg is None:
            return
        if state == "draining":  # the fleet found it leaving (an activation's call refused: SIGTERM)
            self.busy.add(engine_id)
            self._tg.start_soon(self._leave, engine_id, "its server was told to stop (SIGTERM): drained")
        elif state == "fenced" and self.config.replace:
            self._tg.start_soon(self._replace_if_dead, engine_id)

    async def _replace_if_dead(self, engine_id: str) -> None:
        engine = self.fleet.engines.get(engine_id)
        if engine is not None and not await engine.healthy():
            self.engine_lost(engine_id, self.fleet.members[engine_id].why or "fenced, not answering")

    def _running(self) -> None:
        if self._tg is None:
            raise FleetRefused(503, "run", "the run is starting or stopping: try again")

    async def _in_group(self, work: Callable[[], Awaitable[dict]]) -> dict:
        """Run `work` in the keeper's task group (a client that hangs up must not cancel a join
        half done) and wait for its answer."""
        self._running()
        done, box = anyio.Event(), {}

        async def runner() -> None:
            try:
                box["result"] = await work()
            except Exception as exc:  # noqa: BLE001 - handed to the caller, who answers with it
                box["error"] = exc
            finally:
                done.set()

        self._tg.start_soon(runner)
        await done.wait()
        if "error" in box:
            raise box["error"]
        if "result" not in box:  # the run stopped first (its task group cancelled the change)
            raise FleetRefused(503, "run", "the run is stopping: the change was not made")
        return box["result"]

    # -- the record --------------------------------------------------------------------------
    def log_states(self) -> None:
        """Append every engine whose state changed since the last call to RUN_DIR/fleet.jsonl."""
        lines, changes = [], []
        for engine_id, m in self.fleet.members.items():
            if self._logged.get(engine_id) != m.state:
                if engine_id in self._logged or m.state != "serving":
                    changes.append(f"{engine_id} {m.state}" + (f" ({m.why})" if m.why else ""))
                self._logged[engine_id] = m.state
                lines.append(json.dumps({"at": time.time(), **msgspec.to_builtins(m)}) + "\n")
        if lines:
            with open(self._log_path, "a") as f:
                f.writelines(lines)
        counts = self.fleet.member_counts()
        for state, n in counts.items():
            self.run.metrics.engines.labels(state=state).set(n)
        self.run.progress.state.engines = counts["serving"]
        for change in changes:  # the display's fleet line; a plain terminal gets one line each
            self.run.progress.note(f"fleet: {change}; {counts['serving']} serving")

    # -- join --------------------------------------------------------------------------------
    async def add_url(self, url: str) -> dict:
        try:
            parts = urlsplit(url or "")
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as exc:
            raise FleetRefused(400, "url", f"must be an engine server's http(s)://host:port, got {url!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FleetRefused(400, "url", f"must be an engine server's http(s)://host:port, got {url!r}")
        self._running()
        url = url.rstrip("/")
        for m in self.fleet.members.values():
            if m.url == url and m.state not in ("left", "lost", "refused"):
                raise FleetRefused(409, "url", f"{url} is already in the fleet as {m.engine} ({m.state})")
        if url in self.joining_urls:
            raise FleetRefused(409, "url", f"{url} is joining already")
        self.joining_urls.add(url)
        engine_id = self.fleet.new_engine_id(reserved=self.busy)
        self.busy.add(engine_id)  # reserved at once: a second join at the same time gets another id

        async def join() -> dict:
            try:
                return await self._join_url(url, engine_id)
            finally:  # released by the join itself: a client that hangs up does not end it
                self.joining_urls.discard(url)
                self.busy.discard(engine_id)

        return await self._in_group(join)

    async def _join_again(self, urls: list[str]) -> None:
        """--resume: the servers that had joined by URL and not left when the run stopped join
        again, each checked as any joiner is; one that does not answer, or serves something else,
        is logged and left out (the run goes on with the engines it has)."""
        for url in urls:
            try:
                result = await self.add_url(url)
            except FleetRefused as exc:
                log.warning("fleet.not_joined_again", url=url, field=exc.field, error=exc.reason)
            except Exception as exc:  # noqa: BLE001 - a server that is gone: named, the run goes on
                log.warning("fleet.not_joined_again", url=url, error=f"{type(exc).__name__}: {exc}")
            else:
                log.info("fleet.joined_again", url=url, engine=result.get("engine"))

    async def _join_url(self, url: str, engine_id: str) -> dict:
        from orchestrator.engines.server import ServerEngine

        config = msgspec.structs.replace(self.run.engine_base_config, kind="server", url=url, port=None)
        engine = ServerEngine(config, engine_id, expect=await self._expected_identity())
        try:
            try:
                await engine.start()  # attach: health, identity, reset to the base weights
            except ConfigError as exc:
                await engine.shutdown()
                raise FleetRefused(409, exc.field, exc.reason) from None
            except Exception as exc:  # noqa: BLE001 - not reachable, not a vLLM server
                await engine.shutdown()
                raise FleetRefused(502, "url", f"{engine_id} at {url} did not start: {exc}") from None
            return await self.enter(engine, source="fleet add")
        except BaseException:
            if engine_id not in self.fleet.members:  # cancelled before it joined: nothing else holds it
                await self.close(engine)
            raise

    async def _expected_identity(self) -> dict | None:
        """What a joiner must serve: an engine that serves now, as its workers report it."""
        for engine_id in self.fleet.coordinator.serving:
            try:
                with anyio.fail_after(self.fleet.ft.rpc_s):
                    return await self.fleet.engines[engine_id].identity()
            except Exception as exc:  # noqa: BLE001 - ask the next one
                log.warning("fleet.identity_failed", engine=engine_id, error=str(exc))
        return None

    async def enter(self, engine, *, source: str) -> dict:
        """A started engine: into the fleet, to the live version, then offered rollouts."""
        engine_id = engine.engine_id
        self.fleet.add(engine, source=source)
        self.log_states()
        started = time.monotonic()
        try:
            ok = await self.fleet.bring_in(engine_id)
        except Exception as exc:  # noqa: BLE001 - it never served: out again, the run unaffected
            ok = False
            log.warning("fleet.join_failed", engine=engine_id, error=str(exc))
        if not ok:
            await self.fleet.remove(engine_id, "refused", "could not be brought to the live version")
            await self.close(engine)
            self.log_states()
            raise FleetRefused(502, engine_id, "could not be brought to the live version (see orchestrator.jsonl)")
        config = getattr(engine, "config", None)
        self.loop.handle(sch.EngineUp(engine=engine_id, capacity=getattr(config, "max_num_seqs", None)))
        self.log_states()
        log.info("fleet.joined", engine=engine_id, source=source, version=self.fleet.live_version,
                 seconds=round(time.monotonic() - started, 3))
        return {"engine": engine_id, "state": "serving", "version": self.fleet.live_version,
                "catch_up_s": round(time.monotonic() - started, 3)}

    # -- leave -------------------------------------------------------------------------------
    async def drain(self, engine_id: str, why: str = "drained (inflight fleet drain)") -> dict:
        m = self.fleet.members.get(engine_id)
        if m is None or engine_id not in self.fleet.engines:
            raise FleetRefused(404, "engine", f"no engine {engine_id!r} in the fleet; it has "
                                              f"{sorted(self.fleet.engines)}")
        if engine_id in self.busy:
            raise FleetRefused(409, "engine", f"{engine_id} is already {m.state}")
        if self.fleet.coordinator.serving == (engine_id,):
            raise FleetRefused(409, "engine", f"{engine_id} is the only engine serving: add one first")
        self._running()
        self.busy.add(engine_id)  # released by `_leave`, in the keeper's group
        return await self._in_group(lambda: self._leave(engine_id, why))

    async def _leave(self, engine_id: str, why: str) -> dict:
        try:
            self.loop.handle(sch.EngineDown(engine=engine_id))
            aborted = await self.fleet.drain(engine_id, self.config.drain_s, why)
            self.log_states()
            engine = self.fleet.engines.get(engine_id)
            await self.fleet.remove(engine_id, "left", why + (f"; {aborted} rollouts aborted past fleet.drain_s"
                                                              if aborted else ""))
            self.loop.handle(sch.EngineLeft(engine=engine_id))
            if engine is not None:
                await self.close(engine)
            self.log_states()
            log.info("fleet.left", engine=engine_id, aborted=aborted, why=why)
            self.loop.check_serving()
            return {"engine": engine_id, "state": "left", "aborted": aborted}
        finally:
            self.busy.discard(engine_id)

    def engine_refused(self, engine_id: str) -> None:
        """A request came back aborted before its first token and nobody here asked: the
        engine may be leaving (SIGTERM). Down for the scheduler until the probe says."""
        if engine_id in self.busy or engine_id not in self.fleet.engines or self._tg is None:
            return
        self.loop.handle(sch.EngineDown(engine=engine_id))
        self.busy.add(engine_id)
        self._tg.start_soon(self._check_refusal, engine_id)

    async def _check_refusal(self, engine_id: str) -> None:
        engine = self.fleet.engines.get(engine_id)
        leaving = engine is not None and await engine.leaving()
        self.busy.discard(engine_id)
        if leaving:
            self.busy.add(engine_id)
            await self._leave(engine_id, "its server was told to stop (SIGTERM): drained")
        elif engine_id in self.fleet.coordinator.serving:
            self.loop.handle(sch.EngineUp(engine=engine_id))

    # -- lost --------------------------------------------------------------------------------
    def engine_lost(self, engine_id: str, why: str) -> None:
        """The fleet fenced `engine_id` as dead. With `fleet.replace`, one the run started is
        replaced (the dead one leaves for good); on a Ray cluster by `run.cluster.replace_lost`,
        in its bundle of the placement group, once Ray has a node for it."""
        self.log_states()
        engine = self.fleet.engines.get(engine_id)
        if (not self.config.replace or engine is None or engine_id in self.busy or self._tg is None
                or not _replaceable(engine) or getattr(self.run, "cluster", None) is not None):
            return
        self.busy.add(engine_id)
        self.replacing += 1
        self._tg.start_soon(self._replace, engine_id, why)

    async def _replace(self, engine_id: str, why: str) -> None:
        from orchestrator.engines import make_engine

        try:
            old = self.fleet.engines[engine_id]
            await self.fleet.remove(engine_id, "lost", why)
            self.loop.handle(sch.EngineLeft(engine=engine_id))
            await self.close(old)
            self.log_states()
            for attempt in range(1, REPLACE_ATTEMPTS + 1):
                new = make_engine(old.config, self.fleet.new_engine_id(reserved=self.busy), log_dir=self.run.run_dir)
                self.busy.add(new.engine_id)
                log.info("fleet.replacing", engine=engine_id, replacement=new.engine_id, attempt=attempt)
                try:
                    await new.start()
                    await self.enter(new, source=f"replacement of {engine_id}")
                    return
                except Exception as exc:  # noqa: BLE001 - try again, then give up by name
                    log.warning("fleet.replacement_failed", engine=engine_id, replacement=new.engine_id,
                                attempt=attempt, error=str(exc))
                    await self.close(new)
                    await anyio.sleep(min(30.0, 2.0 ** attempt))
                except BaseException:
                    if new.engine_id not in self.fleet.members:  # cancelled while it started
                        await self.close(new)
                    raise
                finally:
                    self.busy.discard(new.engine_id)
        finally:
            self.busy.discard(engine_id)
            self.replacing -= 1
            self.loop.check_serving()

    def may_recover(self) -> bool:
        """With no engine serving: is one on its way (a join, a replacement, a return)?"""
        return bool(self.busy) or self.replacing > 0

    # -- probes ------------------------------------------------------------------------------
    async def _probe(self) -> None:
        """Every `fleet.probe_s`: a serving server told to stop leaves; a fenced one (not on a
        Ray cluster, whose own watcher brings engines back) that answers again comes back."""
        while True:
            await anyio.sleep(self.config.probe_s)
            async with anyio.create_task_group() as tg:
                for engine_id in list(self.fleet.engines):
                    if engine_id not in self.busy:
                        tg.start_soon(self._probe_one, engine_id)

    async def _probe_one(self, engine_id: str) -> None:
        """Ask (bounded by the probe's period), then act in the keeper's task group: a drain
        or a catch-up must not be cut by the probe's limit."""
        engine = self.fleet.engines.get(engine_id)
        if engine is None:
            return
        coordinator = self.fleet.coordinator
        action = None
        with anyio.move_on_after(max(1.0, self.config.probe_s)):
            if engine_id in coordinator.serving and await engine.leaving():
                action = self._leave
            elif (engine_id in coordinator.fenced and engine_id not in coordinator.leaving
                  and getattr(self.run, "cluster", None) is None and await _answers_again(engine)
                  and await self._same_identity(engine)):
                action = self._return
        if action is None or engine_id in self.busy or self._tg is None:
            return
        self.busy.add(engine_id)
        if action == self._leave:
            self._tg.start_soon(self._leave, engine_id, "its server was told to stop (SIGTERM): drained")
        else:
            self._tg.start_soon(self._return, engine_id)

    async def _return(self, engine_id: str) -> None:
        """A fenced engine that answers again (its server restarted at the same address, its link
        back): to the live version, then rollouts."""
        try:
            log.info("engine.rejoining", engine=engine_id, live_version=self.fleet.live_version)
            if await self.fleet.bring_in(engine_id):
                self.loop.handle(sch.EngineUp(engine=engine_id))
        finally:
            self.busy.discard(engine_id)
            self.log_states()

    async def _same_identity(self, engine) -> bool:
        """A server that answers again at a fenced engine's URL may be another one (restarted with
        other settings): it comes back only if it serves what the run's engines serve."""
        check = getattr(engine, "check_identity", None)
        expected = await self._expected_identity() if check is not None else None
        if expected is None:
            return True
        try:
            await check(expected)
            return True
        except ConfigError as exc:
            m = self.fleet.members.get(engine.engine_id)
            if m is not None and m.why != str(exc):
                m.why = str(exc)
                log.warning("engine.return_refused", engine=engine.engine_id, field=exc.field, reason=exc.reason)
            return False
        except Exception as exc:  # noqa: BLE001 - not answering after all: the next probe asks again
            log.warning("engine.identity_failed", engine=engine.engine_id, error=str(exc))
            return False

    async def _watch_minimum(self, every_s: float = 1.0) -> None:
        limit = self.config.min_engines
        while True:
            await anyio.sleep(every_s)
            serving = len(self.fleet.coordinator.serving)
            if serving >= limit:
                if self.below_since is not None:
                    log.info("fleet.minimum_met", serving=serving, min_engines=limit)
                self.below_since, self.paused_why = None, None
                continue
            now = time.monotonic()
            if self.below_since is None:
                self.below_since = now
                log.warning("fleet.below_minimum", serving=serving, min_engines=limit)
            waited = now - self.below_since
            self.paused_why = (f"admission paused: {serving} engine{'s' if serving != 1 else ''} serving, "
                               f"fleet.min_engines = {limit} (for {waited:.0f}s; the run stops after "
                               f"fleet.min_engines_wait_s = {self.config.min_engines_wait_s:g}s)")
            self.run.progress.state.status = self.paused_why
            if waited >= self.config.min_engines_wait_s:
                self.loop.request_stop("too few engines", failure=(
                    f"{serving} engine{'s' if serving != 1 else ''} served for {math.floor(waited)}s, below "
                    f"fleet.min_engines = {limit} (fleet.min_engines_wait_s = {self.config.min_engines_wait_s:g}); "
                    f"see {self._log_path}"))
                return

    async def close(self, engine) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(60):
            try:
                await engine.shutdown()
            except Exception as exc:  # noqa: BLE001 - it is gone either way
                log.warning("fleet.close_failed", engine=engine.engine_id, error=str(exc))


def _replaceable(engine) -> bool:
    """An engine the run started (an in-process engine, or a server process of its own), whose
    settings it can start again; a server attached by URL is the user's to restart."""
    return getattr(engine, "url", None) is None or getattr(engine, "process", None) is not None


async def _answers_again(engine) -> bool:
    check = getattr(engine, "answers_again", None)
    return bool(check is not None and await check())


def logged_members(path: Path) -> list[dict]:
    """RUN_DIR/fleet.jsonl's lines, in order (a line torn by a crash mid-write skipped; none without the file)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    members = []
    for line in lines:
        try:
            member = json.loads(line)
        except ValueError:
            continue
        if isinstance(member, dict) and isinstance(member.get("engine"), str) and member["engine"]:
            members.append(member)
    return members


def logged_engine_ids(path: Path | list[dict]) -> set[str]:
    """Every engine id RUN_DIR/fleet.jsonl (or its `logged_members`) names."""
    return {m["engine"] for m in (logged_members(path) if isinstance(path, Path) else path)}


def joined_urls(path: Path | list[dict]) -> list[str]:
    """The URLs of the servers that joined by `fleet add` (RUN_DIR/fleet.jsonl) and had not left,
    been lost or refused at its last line of them, in the order they joined."""
    last: dict[str, dict] = {}
    for member in (logged_members(path) if isinstance(path, Path) else path):
        last[member["engine"]] = member
    urls = []
    for member in last.values():
        url = member.get("url")
        if member.get("source") == "fleet add" and url and member.get("state") not in ("left", "lost", "refused") \
                and url not in urls:
            urls.append(url)
    return urls
