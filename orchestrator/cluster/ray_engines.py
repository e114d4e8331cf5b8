"""Engines placed by Ray: one vLLM server process per engine, on the node Ray picks, owned by an actor.

`RayPlacement` joins an existing Ray cluster (`ray.init(address=...)`: the run never starts one),
reserves one placement group with a bundle per engine (`[cluster.engines]`: resources, an optional
node resource to pin engines to, a spread strategy), and creates per engine an `EngineHost` actor
in its bundle. The actor starts the server on its node (bound to the node's address, so the
orchestrator and nothing else on loopback reaches it) and reports its URL; from there the
orchestrator drives it as any server engine (`RayServerEngine`): rollouts over its HTTP API,
weights pulled from the run's HTTP server (`transports.pull`). Ray carries placement and
lifetimes only, never rollouts or weights.

Lifetimes: Ray kills the actors of a driver that exits, and removes its placement group; the server
dies with its actor (a parent-death signal), its engine core with it and its worker with the engine
core (`transports.engine_signals`: Ray kills a dead worker's children, not their children), so a
SIGKILLed orchestrator leaves nothing on any node; an orderly stop ends the server's process group
(no watchdog of ours runs on the engine's node, see `EngineHost`). A node or actor that dies answers
`exit_code` with an error: the engine reports itself dead (`RayServerEngine.watch`).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import anyio
import msgspec

from orchestrator.cluster.placement import actor_in, bundle_nodes, bundle_of, kill_actor, pending_group, release, reserve
from orchestrator.config.cluster import ClusterConfig
from orchestrator.config.run import EngineConfig
from orchestrator.engines.process_group import terminate_process_group
from orchestrator.engines.server import ServerEngine, server_command, server_env, tail
from orchestrator.errors import ConfigError, EngineDeadError
from orchestrator.observe.logging import get_logger
from orchestrator.reaper import die_with_parent
from transports.engine_signals import DIE_WITH_PARENT_ENV, ENGINE_CHILD_ENV

log = get_logger(__name__)
CALL_TIMEOUT_S = 10.0  # an actor call that is not answered in this time: its node is unreachable
GCS_PROBE_S = 5.0  # a TCP connect to the Ray head's GCS port that takes longer: nothing answers there


def node_ip_towards(address: str) -> str:
    """This host's address on the route to `address` (the Ray head): a UDP socket's `connect` sends
    nothing, it only picks the source address the kernel would use."""
    host = urllib.parse.urlsplit(f"//{address}").hostname or address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
        except OSError as exc:
            raise ConfigError("cluster.address", f"no route to {host}: {exc}") from None
        return s.getsockname()[0]


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("cluster.backend", "\"ray\" needs Ray on every host: pip install 'inflight-rl[ray]'") \
            from None
    return ray


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """The (host, port) a `[cluster] address` names, None when it names no port (Ray resolves it)."""
    parts = urllib.parse.urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    return (parts.hostname, port) if parts.hostname and port else None


def probe_gcs(host: str, port: int, timeout_s: float = GCS_PROBE_S) -> None:
    """A TCP connect to the head's GCS port: `ray.init` retries a closed or silent port for minutes,
    printing nothing, so a cluster that is not there is refused here, in seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConfigError("cluster.address", f"no Ray cluster answers at {host}:{port} ({exc})") from None


def within(deadline_s: float, fn):
    """`fn()`'s result (or exception), or TimeoutError once `deadline_s` passes. `fn` runs in a daemon
    thread, left behind on a timeout: a blocking call with no timeout of its own cannot be cancelled,
    and the run that gave up on it exits rather than wait."""
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=call, name="inflight-within", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {deadline_s}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


class EngineHost:
    """The Ray actor that owns one engine's server process on its node (see the module docstring).

    It starts no watchdog (`orchestrator.reaper`): one would be the actor's child, which Ray kills
    with a dead actor before it could sweep (and a dead node takes it along), and an orderly `stop`
    ends the server's whole process group and waits until none of it is left. What ends the server
    when the actor dies is the chain of parent-death signals: the server's (`die_with_parent`), its
    engine core's and its worker's (DIE_WITH_PARENT_ENV, `transports.engine_signals`)."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def start(self, config_json: bytes) -> dict:
        import ray

        config = msgspec.json.decode(config_json, type=EngineConfig)
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        log_dir = Path(tempfile.mkdtemp(prefix=f"inflight-{self.engine_id}-"))
        self.log_path = log_dir / f"{self.engine_id}.log"
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                server_command(config, port, host=ip), stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=subprocess.STDOUT, env={**server_env(config), ENGINE_CHILD_ENV: "1", DIE_WITH_PARENT_ENV: "1"},
                start_new_session=True,
                preexec_fn=die_with_parent())
        return {"url": f"http://{ip}:{port}", "node_ip": ip, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": self.process.pid, "log": str(self.log_path)}

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self) -> str:
        return tail(self.log_path) if self.log_path else "(no log)"

    def stop(self, grace_s: float = 15.0) -> int | None:
        if self.process is not None:
            terminate_process_group(self.process, grace_s)
        return self.exit_code()


class RayServerEngine(ServerEngine):
    """A server engine whose process an `EngineHost` actor starts on a Ray node."""

    def __init__(self, config: EngineConfig, engine_id: str, actor, bundle: int | None = None,
                 group=None) -> None:
        super().__init__(config, engine_id)
        self.actor = actor
        self.bundle = bundle  # its bundle in the engines' placement group: where a replacement goes
        self.group = group  # an engine past `count`: its own one-bundle group (released when it leaves)
        self.node: dict = {}
        self._gone: str | None = None
        self.lost_for_good: str | None = None  # its actor, node or server died: it never answers again

    async def _launch(self) -> None:
        info = await self._call(self.actor.start.remote(msgspec.json.encode(self.config)),
                                timeout=self.config.start_timeout_s)
        self.url, self.node = info["url"], info
        log.info("engine.placed", engine=self.engine_id, url=self.url, node_ip=info["node_ip"],
                 node_id=info["node_id"][:12], pid=info["pid"], log=info["log"])

    def _owns_server(self) -> bool:
        return True

    async def _exit_code(self) -> int | None:
        if self._gone is not None:
            return -1
        try:
            return await self._call(self.actor.exit_code.remote())
        except EngineDeadError:
            return -1
        except TimeoutError:
            return None  # unknown: the caller asks the server itself

    async def _log_tail(self) -> str:
        try:
            return await self._call(self.actor.log_tail.remote())
        except (EngineDeadError, TimeoutError) as exc:
            return f"(the log on node {self.node.get('node_ip', '?')} is unreachable: {exc})"

    async def _call(self, ref, timeout: float = CALL_TIMEOUT_S):
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        try:
            with anyio.fail_after(timeout):
                return await ref
        except ActorUnavailableError:  # unreachable for now (a cut link, a node Ray still checks): unknown
            raise TimeoutError(f"{self.engine_id}'s Ray actor is unavailable") from None
        except RayActorError as exc:  # the actor, or its node, is gone
            self._gone = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise EngineDeadError(self.engine_id, f"its Ray actor died ({self._gone})") from None
        except RayTaskError as exc:
            raise EngineDeadError(self.engine_id, f"its Ray actor failed: {exc}") from None

    async def watch(self, on_lost, unreachable_s: float, poll_s: float = 2.0) -> None:
        """Until the engine is shut down, report through `on_lost(engine_id, message)`: a dead actor
        or node (Ray's signal) or an exited server, once, and then stop watching; a server that
        answers neither its health check nor its actor for `unreachable_s` (its host's link is cut),
        once per outage: it may answer again and rejoin (`orchestrator.run.cluster.rejoin_fenced`)."""
        last_seen, reported = time.monotonic(), False
        while self._client is not None:
            code, answers = await self._look()
            if code is not None:
                self._dead = True
                self.lost_for_good = (f"its Ray actor died ({self._gone})" if self._gone
                                      else f"its server exited with code {code}")
                await on_lost(self.engine_id, self.lost_for_good)
                return
            if answers:
                last_seen, reported = time.monotonic(), False
            elif not reported and time.monotonic() - last_seen > unreachable_s:
                reported = True
                self._dead = True
                await on_lost(self.engine_id, f"unreachable for {time.monotonic() - last_seen:.0f}s at {self.url}")
            await anyio.sleep(poll_s)

    async def _look(self) -> tuple[int | None, bool]:
        """The server's exit code as its actor knows it (None: running, or the actor did not
        answer) and whether the server answers its health check, asked at once: over a cut link
        both wait out their limits (10 s and 5 s), one after the other 15 s a look."""
        found: dict[str, object] = {}

        async def ask(name, call):
            found[name] = await call()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "code", self._exit_code)
            tg.start_soon(ask, "answers", self._answers)
        return found["code"], bool(found["answers"])

    async def shutdown(self) -> None:
        with anyio.CancelScope(shield=True):
            await super().shutdown()
            if self._gone is None:
                with anyio.move_on_after(30):
                    try:
                        await self._call(self.actor.stop.remote(), timeout=30)
                    except (EngineDeadError, TimeoutError):
                        pass
            kill_actor(self.actor)
            if self.group is not None:  # an engine past `count` gives its own group back as it leaves
                group, self.group = self.group, None
                with anyio.move_on_after(30):
                    await anyio.to_thread.run_sync(release, group)


class RayPlacement:
    """The run's share of the Ray cluster: one placement group, one `EngineHost` per engine."""

    def __init__(self, config: ClusterConfig, run_id: str, node_ip: str) -> None:
        self.config, self.run_id = config, run_id
        self.node_ip = node_ip  # this host's address in the cluster, named to Ray (`ClusterSide.node_ip`)
        self.group = None
        self._connecting = threading.Lock()

    def connect(self) -> None:
        """Join the Ray cluster at `cluster.address` (once), or refuse it by name, bounded in time.
        The trainer's nodes and the engines are placed from two threads at once: one joins, the
        other waits for it."""
        ray = import_ray()
        with self._connecting:
            if ray.is_initialized():
                return
            endpoint = gcs_endpoint(self.config.address)
            if endpoint is not None:
                probe_gcs(*endpoint)
            self._init(ray, "{}:{}".format(*endpoint) if endpoint else self.config.address)

    def _init(self, ray, where: str) -> None:
        # Ray 2.60's `init` has no deadline of its own (a port that accepts and never answers, a GCS
        # that hangs: it retries, printing nothing): bounded here, so a run that cannot join says so.
        timeout_s = self.config.start_timeout_s
        try:
            within(timeout_s, lambda: ray.init(
                address=self.config.address, namespace=f"inflight-{self.run_id}", log_to_driver=False,
                logging_level=logging.ERROR, include_dashboard=False,
                # This node's address named: a host without a default route cannot guess it.
                _node_ip_address=self.node_ip))
        except TimeoutError:
            raise ConfigError("cluster.address", f"no Ray cluster answers at {where} (ray.init did not return "
                                                 f"within cluster.start_timeout_s = {timeout_s}s)") from None
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError("cluster.address", f"cannot join the Ray cluster at {self.config.address}: "
                                                 f"{exc}") from None

    def place_engines(self, engine_configs: list[tuple[str, EngineConfig]]) -> list[RayServerEngine]:
        """Reserve the placement group (bounded by `start_timeout_s`) and create the actors."""
        self.group = reserve(f"inflight-{self.run_id}", self._bundle(), len(engine_configs),
                             self.config.engines.strategy, self.config.start_timeout_s, "engine(s)")
        return [self.engine_in(index, engine_id, config) for index, (engine_id, config) in enumerate(engine_configs)]

    def engine_in(self, index: int, engine_id: str, config: EngineConfig, group=None) -> RayServerEngine:
        """An engine whose actor Ray creates in bundle `index` of the group (at start, or in the bundle
        of a lost engine, which Ray placed again on a node that joined), or in `group`, the one-bundle
        group of an engine past `count` (`grow_group`)."""
        actor = actor_in(EngineHost, self.group if group is None else group, index, self._bundle(),
                         engine_id).remote(engine_id)
        return RayServerEngine(config, engine_id, actor, bundle=None if group else index, group=group)

    def grow_group(self, serial: int):
        """The next engine past `count`: a one-bundle group that Ray holds pending until a node has
        room for it (bounded in time: an unanswered cluster raises TimeoutError)."""
        return within(CALL_TIMEOUT_S, lambda: pending_group(f"inflight-{self.run_id}-grow-{serial}", self._bundle()))

    def _bundle(self) -> dict[str, float]:
        """What one engine reserves (`[cluster.engines]`: its resources and the node resource)."""
        return bundle_of(self.config.engines.resources, self.config.engines.node_resource)

    def bundle_nodes(self, group=None) -> tuple[dict[int, str], dict[str, str | None]]:
        """({bundle index: node id} of the engines' group, or of `group`; {alive node id: address}),
        bounded in time."""
        return within(CALL_TIMEOUT_S, lambda: bundle_nodes(self.group if group is None else group))

    def close(self) -> None:
        """Release the placement group and leave the cluster (never stops the cluster itself)."""
        release(self.group)
        self.group = None
        # Ray never imported: the cluster was never joined (a run that failed before placing its
        # engines closes this too, on a host that may not even have Ray).
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


__all__ = ["EngineHost", "RayPlacement", "RayServerEngine", "gcs_endpoint", "node_ip_towards", "probe_gcs",
           "within"]
