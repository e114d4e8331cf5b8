"""The orchestrator's side of the trainer: start its process, speak the link, stop it.

The trainer runs in its own process (`python -m orchestrator.trainer.process`), its output in
RUN_DIR/trainer.log. With trainer.world_size = N > 1 (or trainer.torchrun_args) it runs under
torchrun itself, `python -m torch.distributed.run --nproc-per-node N --master-addr 127.0.0.1
--master-port PORT [torchrun_args] -m orchestrator.trainer.process ...`: only its rank 0 speaks
the link, so the seam is the same. torchrun then runs in its own session, so that a trainer
that must be killed is killed with every rank (`TrainerProcess.kill`: torchrun gives each rank
a session of its own, so the agent's process group alone is not enough).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec

from orchestrator.errors import InflightError
from orchestrator.observe.logging import get_logger
from orchestrator.reaper import die_with_parent
from orchestrator.trainer.link import Ready, Replaying, Stop, TrainerLink

log = get_logger(__name__)


class TrainerError(InflightError, RuntimeError):
    """The trainer failed, died, or did not answer in time (the message names its log)."""


class TrainerProcess:
    def __init__(self, config, run_dir: Path, model_dir: str, *, resume: bool,
                 rendezvous: Rendezvous | None = None) -> None:
        # Spanning hosts ([cluster.trainer] nodes > 1): this host is node 0, and the trainer's
        # configuration names the rendezvous, so every node's torchrun (and the ranks' own
        # choices: no background checkpoints under torchrun) follows from it.
        self.rendezvous = rendezvous
        if rendezvous is not None:  # (the trainer reads no [cluster]: the rendezvous says it all)
            config = msgspec.structs.replace(config, cluster=None, trainer=msgspec.structs.replace(
                config.trainer, torchrun_args=[*config.trainer.torchrun_args, *rendezvous.flags(0)]))
        self.config = config
        self.run_dir = Path(run_dir)
        self.model_dir = model_dir
        self.resume = resume
        self.link = TrainerLink()
        self.process: subprocess.Popen | None = None
        self.group = False  # torchrun in its own session (killed with every rank: kill())
        # The process whose exit the trainer watches for (`--orchestrator-pid`): this one.
        self.orchestrator_pid = os.getpid()
        self.ready: Ready | None = None

    async def start(self) -> Ready:
        address = self.link.bind()
        log_file = open(self.run_dir / "trainer.log", "ab")  # noqa: SIM115 - owned by the child
        cmd = trainer_command(self.config.trainer, address, self.run_dir, self.model_dir,
                              msgspec.json.encode(self.config).decode(), resume=self.resume,
                              orchestrator_pid=self.orchestrator_pid)
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.rendezvous is not None:
            env.update(self.rendezvous.env())
        self.group = self.config.trainer.torchrun
        if self.group:
            # The whole argv (--resume included), the configuration's JSON named by its file.
            at = cmd.index("--config-json") + 1
            log.info("trainer.command", argv=[*cmd[:at], "$(cat RUN_DIR/config.json)", *cmd[at + 1:]])
        # It dies with the orchestrator (parent-death signal; torchrun's ranks, in sessions of
        # their own, by the run's watchdog: orchestrator.reaper), and leaves a terminal's Ctrl-C
        # to the orchestrator, which lets it finish the step it holds before stopping it.
        self.process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=self.group,
                                        preexec_fn=die_with_parent(ignore_sigint=True))
        log_file.close()
        message = await self._ready_message()
        if not isinstance(message, Ready):
            raise TrainerError(f"the trainer's first message was {type(message).__name__}: "
                               f"{getattr(message, 'error', message)}; see {self.run_dir / 'trainer.log'}")
        self.ready = message
        log.info("trainer.ready", step=message.step, version=message.version, pid=message.pid,
                 resumed=message.resumed)
        return message

    async def _ready_message(self):
        """The trainer's Ready (or Failed). Its start-up is bounded by trainer.start_timeout_s;
        a resume's journaled steps, which it trains again after that (`Replaying` before each),
        by trainer.step_timeout_s each: a replay is steps, not start-up."""
        tc = self.config.trainer
        message = await self._next_message(tc.start_timeout_s, "report ready")
        while isinstance(message, Replaying):
            log.info("trainer.replaying", step=message.step, index=message.index, total=message.total)
            what = f"train journaled step {message.step} again ({message.index} of {message.total})"
            message = await self._next_message(tc.step_timeout_s, what)
        return message

    async def _next_message(self, timeout: float, what: str):
        """The trainer's next message, within `timeout`; a trainer that exits first fails at
        once (under torchrun a rank that fails takes rank 0 down with SIGTERM, before it can say
        Failed), not after the whole timeout."""
        deadline = anyio.current_time() + timeout
        while True:
            left = deadline - anyio.current_time()
            if left <= 0:
                raise TrainerError(f"the trainer did not {what} within {timeout}s; see "
                                   f"{self.run_dir / 'trainer.log'}")
            try:
                return await self.link.recv(min(1.0, left))
            except TimeoutError:
                if self.alive:
                    continue
            try:  # a last message (Failed) sent just before it exited
                return await self.link.recv(0.2)
            except TimeoutError:
                raise TrainerError(f"the trainer exited (code {self.process.returncode}) before it reported "
                                   f"ready; see {self.run_dir / 'trainer.log'}") from None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Ask it to stop, wait (bounded), then kill. Shielded: runs during shutdown."""
        with anyio.CancelScope(shield=True):
            if self.alive and self.ready is None and not self.resume:
                # Still starting (the run failed at start-up, e.g. its task did not build): it has
                # trained nothing, so nothing is lost by not waiting for it to come up to be told.
                self.kill()
                await anyio.to_thread.run_sync(self.process.wait)
            if self.alive:
                try:
                    with anyio.move_on_after(5.0):
                        await self.link.send(Stop())
                except Exception:  # noqa: BLE001 - the link may already be gone
                    pass
                with anyio.move_on_after(timeout_s):
                    while self.alive:
                        await anyio.sleep(0.05)
                if self.alive:
                    log.warning("trainer.killed", reason="did not stop in time")
                    self.kill()
                    await anyio.to_thread.run_sync(self.process.wait)
            self.link.close()

    def node_command(self, node_rank: int) -> list[str]:
        """The argv another trainer node runs (`[cluster.trainer] nodes > 1`): this node's torchrun
        with that node's rank."""
        tc = self.config.trainer
        args = [a for a in tc.torchrun_args if a.split("=", 1)[0] != "--node-rank"] + [f"--node-rank={node_rank}"]
        cmd = trainer_command(msgspec.structs.replace(tc, torchrun_args=args), "tcp://0.0.0.0:0", self.run_dir,
                              self.model_dir, msgspec.json.encode(self.config).decode(), resume=self.resume,
                              orchestrator_pid=0)
        # Its ranks watch the process that owns them there (they exit when it is gone).
        cmd[cmd.index("--orchestrator-pid") + 1] = OWNER_PID
        return cmd

    def kill(self) -> None:
        """SIGKILL the trainer: under torchrun its agent and every rank (`kill_torchrun`)."""
        if self.process is None:
            return
        if not self.group:
            self.process.send_signal(signal.SIGKILL)
            return
        if self.process.poll() is not None:
            return  # the agent exited and was reaped: its pid (and group id) may name another now
        kill_torchrun(self.process.pid)


OWNER_PID = "{owner_pid}"  # in a node's argv: the pid of the process that starts it there


class Rendezvous(msgspec.Struct, frozen=True):
    """torchrun's static rendezvous over hosts: node 0 (this host) listens at addr:port."""

    nnodes: int
    addr: str
    port: int

    def flags(self, node_rank: int) -> list[str]:
        return [f"--nnodes={self.nnodes}", f"--node-rank={node_rank}", f"--master-addr={self.addr}",
                f"--master-port={self.port}"]

    def env(self) -> dict[str, str]:
        """gloo binds to the address its host name resolves to, which a host of several
        interfaces may not route to the others: name the interface that holds our address."""
        name = interface_of(self.addr)
        return {"GLOO_SOCKET_IFNAME": name} if name and "GLOO_SOCKET_IFNAME" not in os.environ else {}


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this host, if any."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    return None


def kill_torchrun(agent: int) -> None:
    """SIGKILL torchrun's agent and every rank. torchrun starts each rank in a session of its own
    (`start_new_session=True` in its SubprocessHandler), so killing the agent's process group
    alone would leave the ranks running, re-parented: the agent is stopped first (it can start
    nothing more), its descendants listed, then every one of their process groups is killed, the
    agent's last."""
    try:
        os.killpg(agent, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    own = os.getpgrp()
    groups = []
    for pid in descendants(agent):
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if pgid not in (own, agent) and pgid not in groups:
            groups.append(pgid)
    for pgid in [*groups, agent]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children first), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


_MASTER_FLAGS = ("--master-addr", "--master-port", "--rdzv-endpoint", "--rdzv-backend", "--standalone")


def trainer_command(tc, address: str, run_dir, model_dir, config_json: str, *, resume: bool,
                    orchestrator_pid: int | None = None) -> list[str]:
    """The trainer's argv: one process, or torchrun with tc.world_size ranks on this host
    (its rendezvous on 127.0.0.1 and a free port unless tc.torchrun_args names one)."""
    if tc.torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tc.world_size}"]
        named = {a.split("=", 1)[0].replace("_", "-") for a in tc.torchrun_args}
        if not named & set(_MASTER_FLAGS):
            cmd += ["--master-addr=127.0.0.1", f"--master-port={_free_port()}"]
        cmd += list(tc.torchrun_args) + ["-m", "orchestrator.trainer.process"]
    else:
        cmd = [sys.executable, "-m", "orchestrator.trainer.process"]
    cmd += ["--connect", address, "--run-dir", str(run_dir), "--model", str(model_dir),
            "--orchestrator-pid", str(orchestrator_pid or os.getpid()), "--config-json", config_json]
    if resume:
        cmd.append("--resume")
    return cmd


def _free_port() -> int:
    # Bound, read, released: torchrun binds it a moment later (a race with another binder is
    # possible and ends in a start-up failure, not in a wrong rendezvous).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
