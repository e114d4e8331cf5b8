"""The orchestrator's side of the trainer: start its process, speak the link, stop it.

The trainer runs in its own process (`python -m orchestrator.trainer.process`), its output in
RUN_DIR/trainer.log. Only its rank 0 speaks the link, so a torchrun trainer fits the same seam.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec

from orchestrator.logging import get_logger
from orchestrator.trainer.link import Ready, Stop, TrainerLink

log = get_logger(__name__)


class TrainerError(RuntimeError):
    """The trainer failed, died, or did not answer in time."""


class TrainerProcess:
    def __init__(self, config, run_dir: Path, model_dir: str, *, resume: bool) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.model_dir = model_dir
        self.resume = resume
        self.link = TrainerLink()
        self.process: subprocess.Popen | None = None
        self.ready: Ready | None = None

    async def start(self) -> Ready:
        address = self.link.bind()
        log_file = open(self.run_dir / "trainer.log", "ab")  # noqa: SIM115 - owned by the child
        cmd = [sys.executable, "-m", "orchestrator.trainer.process", "--connect", address,
               "--run-dir", str(self.run_dir), "--model", str(self.model_dir),
               "--config-json", msgspec.json.encode(self.config).decode()]
        if self.resume:
            cmd.append("--resume")
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        log_file.close()
        timeout = self.config.trainer.start_timeout_s
        try:
            message = await self.link.recv(timeout)
        except TimeoutError:
            raise TrainerError(f"the trainer did not report ready within {timeout}s; see "
                               f"{self.run_dir / 'trainer.log'}") from None
        if not isinstance(message, Ready):
            raise TrainerError(f"the trainer's first message was {type(message).__name__}: "
                               f"{getattr(message, 'error', message)}; see {self.run_dir / 'trainer.log'}")
        self.ready = message
        log.info("trainer.ready", step=message.step, version=message.version, pid=message.pid,
                 resumed=message.resumed)
        return message

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Ask it to stop, wait (bounded), then kill. Shielded: runs during shutdown."""
        with anyio.CancelScope(shield=True):
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
                    self.process.send_signal(signal.SIGKILL)
                    await anyio.to_thread.run_sync(self.process.wait)
            self.link.close()
