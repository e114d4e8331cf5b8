"""Trainer nodes placed by Ray (`[cluster.trainer] nodes > 1`): node 0 is the orchestrator's host
(its rank 0 speaks the trainer link and writes the run directory); each other node is one
`TrainerNode` actor that runs the same torchrun command with its own `--node-rank`, joined at the
static rendezvous on node 0. Gradients travel over torch.distributed (gloo here, NCCL on GPUs),
never through Ray. The actor's watchdog (`orchestrator.reaper`) ends every rank with it; a node or
actor that dies is seen by `TrainerNodes.watch` and stops the run by name.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import anyio

from orchestrator.cluster.placement import actor_in, bundle_of, kill_actor, release, reserve
from orchestrator.config.cluster import ClusterConfig
from orchestrator.observe.logging import get_logger
from orchestrator.reaper import die_with_parent

log = get_logger(__name__)
CALL_TIMEOUT_S = 10.0


class TrainerNode:
    """The Ray actor that runs one trainer node's torchrun on its host."""

    def __init__(self, node_rank: int) -> None:
        from orchestrator.reaper import Reaper

        self.node_rank = node_rank
        self.reaper = Reaper.start()
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def start(self, argv: list[str], env: dict[str, str]) -> dict:
        import ray

        from orchestrator.trainer.launcher import OWNER_PID, Rendezvous

        argv = [str(os.getpid()) if a == OWNER_PID else a for a in argv]
        ip = ray.util.get_node_ip_address()
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        environ.update(Rendezvous(nnodes=0, addr=ip, port=0).env())  # this host's interface for gloo
        self.log_path = Path(tempfile.mkdtemp(prefix=f"inflight-trainer-node{self.node_rank}-")) / "trainer.log"
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                            env=environ, start_new_session=True,
                                            preexec_fn=die_with_parent(ignore_sigint=True))
        return {"node_ip": ip, "pid": self.process.pid, "log": str(self.log_path)}

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self) -> str:
        from orchestrator.engines.server import tail

        return tail(self.log_path) if self.log_path else "(no log)"

    def stop(self) -> None:
        from orchestrator.trainer.launcher import kill_torchrun

        if self.process is not None and self.process.poll() is None:
            kill_torchrun(self.process.pid)
            self.process.wait(30)
        self.reaper.stop()


class TrainerNodes:
    """Nodes 1..N-1 of the trainer, each a `TrainerNode` actor in one placement group."""

    def __init__(self, config: ClusterConfig, run_id: str) -> None:
        self.config, self.run_id = config, run_id
        self.group = None
        self.actors: list = []
        self.info: list[dict] = []

    def place(self) -> None:
        trainer = self.config.trainer
        bundle = bundle_of(trainer.resources, trainer.node_resource)
        self.group = reserve(f"inflight-{self.run_id}-trainer", bundle, trainer.nodes - 1, "STRICT_SPREAD",
                             self.config.start_timeout_s, "trainer node(s), each on its own host,")
        self.actors = [actor_in(TrainerNode, self.group, rank - 1, bundle, f"trainer-node-{rank}").remote(rank)
                       for rank in range(1, trainer.nodes)]

    async def start(self, commands: list[list[str]]) -> None:
        for actor, argv in zip(self.actors, commands):
            with anyio.fail_after(CALL_TIMEOUT_S * 3):
                info = await actor.start.remote(argv, {})
            self.info.append(info)
            log.info("trainer.node_started", node_rank=len(self.info), node_ip=info["node_ip"], pid=info["pid"],
                     log=info["log"])

    async def watch(self, on_lost, poll_s: float = 2.0) -> None:
        """Until cancelled: a node whose actor, host or torchrun is gone is reported once through
        `on_lost(message)`."""
        from ray.exceptions import RayActorError

        while True:
            for rank, actor in enumerate(self.actors, start=1):
                where = self.info[rank - 1]["node_ip"] if rank <= len(self.info) else "?"
                try:
                    with anyio.move_on_after(CALL_TIMEOUT_S):
                        code = await actor.exit_code.remote()
                        if code is not None:
                            tail = await actor.log_tail.remote()
                            await on_lost(f"trainer node {rank} at {where}: its torchrun exited with code {code}; "
                                          f"last lines of its log:\n{tail}")
                            return
                except RayActorError as exc:
                    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    await on_lost(f"trainer node {rank} at {where} is lost (Ray: {first})")
                    return
            await anyio.sleep(poll_s)

    async def stop(self) -> None:
        with anyio.CancelScope(shield=True):
            for actor in self.actors:
                with anyio.move_on_after(40):
                    try:
                        await actor.stop.remote()
                    except Exception:  # noqa: BLE001 - its node is gone: nothing to stop
                        pass
                kill_actor(actor)
            self.actors = []

    def close(self) -> None:
        release(self.group)
        self.group = None
