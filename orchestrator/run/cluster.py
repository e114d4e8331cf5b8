"""A run over the hosts of a Ray cluster (`[cluster]`, docs/cluster.md): what `Run` and `RunLoop` do
differently when the engines live on other hosts.

- The run's HTTP server listens on this host's address in the cluster (not loopback), since the
  engines pull each version from it (`orchestrator.cluster.weights`, token-guarded).
- The engines are placed by Ray (`orchestrator.cluster.ray_engines`); their workers mirror each
  committed version into a scratch directory of their own host (`transports.pull`).
- Ray's signals become fleet events: an engine whose actor or node died is reported down at once,
  without waiting for a stream to time out (`watch_engines`).
- A fenced engine that answers again (its host's link came back) rejoins at the live version
  before it gets another rollout (`rejoin_fenced`).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import anyio

from orchestrator.config.cluster import ClusterConfig
from orchestrator.observe.logging import get_logger
from orchestrator.scheduling import scheduler as sch

log = get_logger(__name__)
REJOIN_PROBE_S = 5.0  # how often fenced engines are asked whether they answer again


class ClusterSide:
    def __init__(self, config: ClusterConfig, run_id: str) -> None:
        from orchestrator.cluster.ray_engines import RayPlacement

        self.config = config
        self.placement = RayPlacement(config, run_id)
        self.token = secrets.token_urlsafe(24)  # the weight server's: handed to engine workers only
        self.engines: list = []

    @staticmethod
    def http_host(config: ClusterConfig, configured: str) -> str:
        """Where the run's HTTP server listens: the configured host, unless it is loopback, which
        no other host reaches; then this host's address on the route to the Ray head."""
        from orchestrator.cluster.ray_engines import node_ip_towards

        if configured not in ("127.0.0.1", "localhost", "::1"):
            return configured
        return config.node_ip or node_ip_towards(config.address)

    async def place(self, engine_configs) -> list:
        def place_all():
            self.placement.connect()
            return self.placement.place_engines(engine_configs)

        self.engines = await anyio.to_thread.run_sync(place_all)
        return self.engines

    def serve_weights(self, app, weights_root: str) -> None:
        from orchestrator.cluster.weights import weights_routes

        app.router.routes.extend(weights_routes(Path(weights_root), self.token))

    def pull(self, http_url: str) -> dict:
        return {"url": http_url, "token": self.token}

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(30):
                await anyio.to_thread.run_sync(self.placement.close)


async def watch_engines(loop) -> None:
    """One watcher per Ray-placed engine (a dead actor or node: the engine is lost), and the probe
    that brings fenced engines back."""
    side: ClusterSide = loop.run.cluster
    async with anyio.create_task_group() as tg:
        for engine in side.engines:
            tg.start_soon(engine.watch, loop.engine_lost)
        tg.start_soon(rejoin_fenced, loop)


async def rejoin_fenced(loop, probe_s: float = REJOIN_PROBE_S) -> None:
    """A fenced engine that answers its health check again is re-synced to the live version
    (`Fleet.rejoin`: stage, swap, unfence) and only then offered rollouts (`EngineUp`)."""
    fleet = loop.run.fleet
    while True:
        await anyio.sleep(probe_s)
        for engine_id in sorted(fleet.coordinator.fenced):
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
