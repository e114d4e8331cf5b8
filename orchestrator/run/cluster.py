"""A run over the hosts of a Ray cluster (`[cluster]`, docs/cluster.md): what `Run` and `RunLoop` do
differently when the engines live on other hosts.

- The run's HTTP server listens on this host's address in the cluster (not loopback), since the
  engines pull each version from it (`orchestrator.cluster.weights`, token-guarded).
- The engines are placed by Ray (`orchestrator.cluster.ray_engines`); their workers mirror each
  committed version into a scratch directory of their own host (`transports.pull`).
- Ray's signals become fleet events: an engine whose actor or node died is reported down at once,
  without waiting for a stream to time out (`watch_engines`).
- A trainer over several hosts (`[cluster.trainer] nodes > 1`): node 0 here, the others placed
  by Ray (`orchestrator.cluster.ray_trainer`); a lost trainer node stops the run by name.
- A fenced engine that answers again (its host's link came back) rejoins at the live version
  before it gets another rollout (`rejoin_fenced`).
- With `fleet.replace`, an engine lost for good (its actor, node or server died) leaves the fleet
  and frees its bundle of the placement group; when Ray places that bundle on a node that is alive
  (a node that joined offering the engine resource, or one with room), a new engine is started
  there and joins as any joiner: at the live version first, then rollouts (`replace_lost`).
- With `cluster.engines.max_count` above `count`, the fleet grows past `count` one engine at a time:
  a pending one-bundle placement group asks Ray for room for the next engine; when a node has it (one
  joins offering the engine resource), a new engine is started there and joins the same way
  (`grow_fleet`, source "growth"). A lost engine's bundle is filled first.
"""

from __future__ import annotations

import secrets
import socket
import urllib.parse
from pathlib import Path

import anyio

from orchestrator.config.cluster import ClusterConfig
from orchestrator.observe.logging import get_logger
from orchestrator.scheduling import scheduler as sch

log = get_logger(__name__)
REJOIN_PROBE_S = 5.0  # how often fenced engines are asked whether they answer again
REPLACE_PROBE_S = 3.0  # how often lost engines and the placement group's bundles are looked at
REPLACE_ATTEMPTS = 3  # failed starts in one bundle before it is given up (named in the log)


class ClusterSide:
    def __init__(self, config: ClusterConfig, run_id: str) -> None:
        from orchestrator.cluster.ray_engines import RayPlacement, node_ip_towards
        from orchestrator.cluster.ray_trainer import TrainerNodes

        self.config = config
        self.node_ip = config.node_ip or node_ip_towards(config.address)  # where other hosts reach us
        self.placement = RayPlacement(config, run_id, self.node_ip)
        self.trainer_nodes = TrainerNodes(config, run_id) if config.trainer.nodes > 1 else None
        self.token = secrets.token_urlsafe(24)  # the weight server's: handed to engine workers only
        self.engines: list = []
        self.free: dict[int, tuple[str, object]] = {}  # bundle -> (the lost engine's id, its config)
        self.placing: set[int] = set()  # bundles a new engine is being started in
        self.attempts: dict[int, int] = {}  # failed starts per bundle
        self.growth = None  # the pending one-bundle group of the next engine past `count`
        self.grown = 0  # growth groups asked for (names them)
        self.growing = 0  # engines past `count` starting now
        self.growth_failures = 0  # failed starts in a row of engines past `count`

    def rendezvous(self):
        """Node 0's rendezvous for a trainer over several hosts (None: the trainer is this host's)."""
        from orchestrator.trainer.launcher import Rendezvous

        if self.trainer_nodes is None:
            return None
        port = self.config.trainer.port
        if not port:
            with socket.socket() as s:  # bound, read, released: torchrun binds it a moment later
                s.bind((self.node_ip, 0))
                port = s.getsockname()[1]
        return Rendezvous(nnodes=self.config.trainer.nodes, addr=self.node_ip, port=port)

    async def start_trainer_nodes(self, trainer) -> None:
        """Place and start nodes 1.. of the trainer (node 0 is `trainer`, started by the caller)."""
        if self.trainer_nodes is None:
            return
        await anyio.to_thread.run_sync(self._connected, self.trainer_nodes.place)
        await self.trainer_nodes.start([trainer.node_command(rank) for rank in range(1, self.config.trainer.nodes)])

    def _connected(self, then):
        self.placement.connect()
        return then()

    def http_host(self, configured: str) -> str:
        """Where the run's HTTP server listens: the configured host, unless it is loopback, which
        no other host reaches; then this host's address in the cluster."""
        return self.node_ip if configured in ("127.0.0.1", "localhost", "::1") else configured

    async def place(self, engine_configs) -> list:
        self.engines = await anyio.to_thread.run_sync(self._connected,
                                                      lambda: self.placement.place_engines(engine_configs))
        return self.engines

    def serve_weights(self, app, weights_root: str) -> None:
        from orchestrator.cluster.weights import weights_routes

        app.router.routes.extend(weights_routes(Path(weights_root), self.token))

    def pull(self, http_url: str) -> dict:
        """What an engine worker needs to pull versions: our weight server at this host's cluster
        address (the server may listen on every address), and its token."""
        port = urllib.parse.urlsplit(http_url).port
        return {"url": f"http://{self.node_ip}:{port}", "token": self.token}

    async def close(self) -> None:
        from orchestrator.cluster.placement import release

        with anyio.CancelScope(shield=True):
            # The pending group; an engine past `count` gives its own back when it shuts down (before this).
            groups = [self.growth] + [e.group for e in self.engines if getattr(e, "group", None) is not None]
            self.growth = None
            with anyio.move_on_after(30):
                for group in groups:
                    await anyio.to_thread.run_sync(release, group)
            if self.trainer_nodes is not None:
                await self.trainer_nodes.stop()
                with anyio.move_on_after(30):
                    await anyio.to_thread.run_sync(self.trainer_nodes.close)
            with anyio.move_on_after(30):
                await anyio.to_thread.run_sync(self.placement.close)


async def watch_engines(loop) -> None:
    """One watcher per Ray-placed engine (a dead actor or node: the engine is lost), and the probe
    that brings fenced engines back."""
    side: ClusterSide = loop.run.cluster

    async def trainer_node_lost(message: str) -> None:
        # Node 0's ranks would wait in a collective until its timeout: end them now, by name.
        loop.run.trainer.kill()
        loop.trainer_lost(message)

    async with anyio.create_task_group() as tg:
        for engine in side.engines:
            tg.start_soon(engine.watch, loop.engine_lost, side.config.unreachable_s)
        if side.trainer_nodes is not None:
            tg.start_soon(side.trainer_nodes.watch, trainer_node_lost)
        tg.start_soon(rejoin_fenced, loop)
        if loop.run.config.fleet.replace:
            tg.start_soon(replace_lost, loop, tg)
        if side.config.engines.most > side.config.engines.count:
            tg.start_soon(grow_fleet, loop, tg)


async def replace_lost(loop, tg, probe_s: float = REPLACE_PROBE_S) -> None:
    """`fleet.replace` on a Ray cluster: every `probe_s`, each engine lost for good leaves the fleet
    (`retire`), and a new engine is placed in each free bundle that Ray has placed on a live node
    (`bundles_to_fill`; `place_in`, in `tg`, which also watches it)."""
    from orchestrator.cluster.placement import bundles_to_fill

    side: ClusterSide = loop.run.cluster
    while True:
        await anyio.sleep(probe_s)
        for engine_id, engine in list(loop.run.fleet.engines.items()):
            if (getattr(engine, "lost_for_good", None) and engine_id in loop.run.fleet.coordinator.fenced
                    and engine_id not in loop.keeper.busy):  # fenced first (`engine_lost`), then out
                await retire(loop, engine_id)
        if not side.free or loop.stop_requested.is_set():
            continue
        try:
            placed, alive = await anyio.to_thread.run_sync(side.placement.bundle_nodes)
        except Exception as exc:  # noqa: BLE001 - the cluster did not answer: ask again next time
            log.warning("fleet.placement_unknown", error=f"{type(exc).__name__}: {exc}")
            continue
        room = side.config.engines.most - len(members(loop)) - side.growing - len(side.placing)
        for index in bundles_to_fill(replace=loop.run.config.fleet.replace, stopping=loop.stop_requested.is_set(), free=side.free,
                                     placing=side.placing, placed=placed, alive=alive)[:max(0, room)]:
            side.placing.add(index)
            tg.start_soon(place_in, loop, tg, index, alive[placed[index]])


async def retire(loop, engine_id: str) -> None:
    """A Ray engine lost for good leaves the fleet (`lost`); its actor is ended, which frees its
    bundle: Ray places that bundle again (on a live node with room, or one that joins)."""
    side: ClusterSide = loop.run.cluster
    keeper, fleet = loop.keeper, loop.run.fleet
    keeper.busy.add(engine_id)
    try:
        engine = fleet.engines[engine_id]
        await fleet.remove(engine_id, "lost", engine.lost_for_good)
        loop.handle(sch.EngineLeft(engine=engine_id))
        await keeper.close(engine)
        if engine in side.engines:
            side.engines.remove(engine)
        if engine.bundle is None:  # past `count`: its group went back as it shut down; growth asks again
            log.info("fleet.growth_group_released", engine=engine_id, why=engine.lost_for_good)
        else:
            side.free[engine.bundle] = (engine_id, engine.config)
            log.info("fleet.bundle_free", engine=engine_id, bundle=engine.bundle, why=engine.lost_for_good)
        keeper.log_states()
    finally:
        keeper.busy.discard(engine_id)


async def place_in(loop, tg, index: int, node_ip: str | None) -> None:
    """Start a new engine in bundle `index` (on `node_ip`, where Ray placed it) and bring it in as any
    joiner (`FleetKeeper.enter`: the live version first, then rollouts); then watch it. A start that
    fails leaves the bundle free for the next probe, at most `REPLACE_ATTEMPTS` times."""
    side: ClusterSide = loop.run.cluster
    keeper, fleet = loop.keeper, loop.run.fleet
    replaced, config = side.free[index]
    engine_id = fleet.new_engine_id(reserved=keeper.busy)
    keeper.busy.add(engine_id)
    keeper.replacing += 1
    engine = None
    try:
        log.info("fleet.replacing", engine=replaced, replacement=engine_id, bundle=index, node_ip=node_ip)
        engine = await anyio.to_thread.run_sync(side.placement.engine_in, index, engine_id, config)
        try:
            await engine.start()
            await keeper.enter(engine, source=f"replacement of {replaced}")
        except Exception as exc:  # noqa: BLE001 - named, and tried again while attempts are left
            side.attempts[index] = side.attempts.get(index, 0) + 1
            log.warning("fleet.replacement_failed", engine=replaced, replacement=engine_id, bundle=index,
                        attempt=side.attempts[index], error=str(exc))
            await keeper.close(engine)
            if side.attempts[index] >= REPLACE_ATTEMPTS:
                side.free.pop(index, None)
                log.warning("fleet.replacement_given_up", engine=replaced, bundle=index, attempts=REPLACE_ATTEMPTS)
            return
        side.free.pop(index, None)
        side.attempts.pop(index, None)
        side.engines.append(engine)
        tg.start_soon(engine.watch, loop.engine_lost, side.config.unreachable_s)
    except BaseException:
        if engine is not None and engine_id not in fleet.members:  # cancelled while it started
            await keeper.close(engine)
        raise
    finally:
        side.placing.discard(index)
        keeper.busy.discard(engine_id)
        keeper.replacing -= 1
        loop.check_serving()


def members(loop) -> list:
    """The Ray-placed engines still in the fleet (serving, fenced or joining; not those that left)."""
    return [e for e in loop.run.cluster.engines if e.engine_id in loop.run.fleet.engines]


async def grow_fleet(loop, tg, probe_s: float = REPLACE_PROBE_S) -> None:
    """`cluster.engines.max_count`: every `probe_s`, one step of `growth_step` (ask Ray for room for
    the next engine past `count`, give that request back, or look whether Ray placed it); once it is
    placed on a live node, a new engine is started in it (`grow_in`, in `tg`)."""
    from orchestrator.cluster.placement import GROW, RELEASE, WATCH, growth_step, release

    side: ClusterSide = loop.run.cluster
    while True:
        await anyio.sleep(probe_s)
        step = growth_step(max_count=side.config.engines.most, members=len(members(loop)), starting=side.growing + len(side.placing),
                           free=len(side.free.keys() - side.placing), stopping=loop.stop_requested.is_set(), pending=side.growth is not None,
                           given_up=side.growth_failures >= REPLACE_ATTEMPTS)
        try:
            if step == RELEASE:
                group, side.growth = side.growth, None
                await anyio.to_thread.run_sync(release, group)
            elif step == GROW:
                side.grown += 1
                side.growth = await anyio.to_thread.run_sync(side.placement.grow_group, side.grown)
                log.info("fleet.growth_asked", engines=len(members(loop)), max_count=side.config.engines.most)
            elif step == WATCH:
                placed, alive = await anyio.to_thread.run_sync(side.placement.bundle_nodes, side.growth)
                if placed.get(0) in alive:
                    group, side.growth = side.growth, None
                    side.growing += 1
                    tg.start_soon(grow_in, loop, tg, group, alive[placed[0]])
        except Exception as exc:  # noqa: BLE001 - the cluster did not answer: ask again next time
            log.warning("fleet.placement_unknown", error=f"{type(exc).__name__}: {exc}")


async def grow_in(loop, tg, group, node_ip: str | None) -> None:
    """Start an engine past `count` in `group` (placed on `node_ip`) and bring it in as any joiner; then
    watch it. A start that fails gives the group back (the next probe asks again), at most
    `REPLACE_ATTEMPTS` times in a row."""
    from orchestrator.cluster.placement import release

    side: ClusterSide = loop.run.cluster
    keeper, fleet = loop.keeper, loop.run.fleet
    engine_id = fleet.new_engine_id(reserved=keeper.busy)
    keeper.busy.add(engine_id)
    keeper.replacing += 1
    engine, entered = None, False
    try:
        log.info("fleet.growing", engine=engine_id, node_ip=node_ip, engines=len(members(loop)),
                 max_count=side.config.engines.most)
        engine = await anyio.to_thread.run_sync(side.placement.engine_in, 0, engine_id, loop.run.engine_base_config,
                                                group)
        try:
            await engine.start()
            await keeper.enter(engine, source="growth")
        except Exception as exc:  # noqa: BLE001 - named; the next probe asks for room again
            side.growth_failures += 1
            log.warning("fleet.growth_failed", engine=engine_id, node_ip=node_ip, attempt=side.growth_failures,
                        error=str(exc))
            if side.growth_failures >= REPLACE_ATTEMPTS:
                log.warning("fleet.growth_given_up", attempts=REPLACE_ATTEMPTS)
            return
        entered = True
        side.growth_failures = 0
        side.engines.append(engine)
        tg.start_soon(engine.watch, loop.engine_lost, side.config.unreachable_s)
    finally:
        with anyio.CancelScope(shield=True):
            if not entered:  # failed, or cancelled while it started: its actor and group go back
                if engine is None:  # no engine holds the group
                    with anyio.move_on_after(30):
                        await anyio.to_thread.run_sync(release, group)
                elif engine_id not in fleet.members:  # a member is closed by `enter` or the run's end
                    await keeper.close(engine)  # its shutdown gives the group back
        keeper.busy.discard(engine_id)
        keeper.replacing -= 1
        side.growing -= 1
        loop.check_serving()


async def rejoin_fenced(loop, probe_s: float = REJOIN_PROBE_S) -> None:
    """A fenced engine that answers its health check again is re-synced to the live version
    (`Fleet.rejoin`: stage, swap, unfence) and only then offered rollouts (`EngineUp`)."""
    fleet = loop.run.fleet
    while True:
        await anyio.sleep(probe_s)
        for engine_id in sorted(fleet.coordinator.fenced):
            if engine_id in loop.keeper.busy:  # joining (`bring_in` brings it in), or leaving for good
                continue
            engine = fleet.engines[engine_id]
            if not await engine.answers_again():
                continue
            log.info("engine.rejoining", engine=engine_id, live_version=fleet.live_version)
            async with loop.activation_lock:  # no version goes live while it catches up
                ok = await fleet.rejoin(engine_id)
            log.info("engine.rejoined" if ok else "engine.rejoin_failed", engine=engine_id,
                     live_version=fleet.live_version)
            if ok:
                loop.handle(sch.EngineUp(engine=engine_id))
