"""The run's end of the verifiers 0.4 driver (`verifiers04_driver.py`, run by the 0.4 venv's python):
one long-lived process serving many episodes over stdin/stdout JSON lines, any number at once.

Never a hang: the driver's start is bounded (`start_timeout_s`), every episode's answer too
(`timeout_s`: past it the episode is cancelled in the driver and ends `DriverTimeout`); the
driver's death is seen at once (its stdout closes), and every episode it held ends `DriverDied`
naming its exit code and the end of its stderr. The next episode starts a new driver: once; a
driver that then completes an episode earns the next restart, so a driver that keeps dying at
start is given up (`DriverGone`) rather than restarted for ever. Each call comes from an
episode's own worker thread (`task.agent`'s runner): the link is thread-safe.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import os
import queue
import subprocess
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from orchestrator.errors import ConfigError
from orchestrator.observe.logging import get_logger

log = get_logger(__name__)

DRIVER = Path(__file__).with_name("verifiers04_driver.py")
TOKEN_VAR = "INFLIGHT_TOKEN"
_STDERR_LINES = 40


class Verifiers04Error(Exception):
    """An episode of a verifiers 0.4 environment failed (its rollout, or the driver)."""


class DriverDied(Verifiers04Error):
    """The driver process died while it held the episode."""


class DriverTimeout(Verifiers04Error):
    """The driver gave no answer in time."""


class DriverGone(Verifiers04Error):
    """The driver died again after its restart: it is not started again."""


class DriverLink:
    """One driver process at a time, started from `python` with the JSON `config`."""

    def __init__(self, python: Path, config: dict, *, start_timeout_s: float, timeout_s: float) -> None:
        self.python = python
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.timeout_s = timeout_s
        self.rows: list[dict] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._proc: subprocess.Popen | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self._restart_allowed = True
        self.starts = 0
        atexit.register(self.close)

    # -- the process -------------------------------------------------------------------------------
    def start(self) -> dict:
        """Start the driver and wait for its `ready` (its rows); ConfigError for its `fatal`."""
        env = {**os.environ, "PATH": f"{self.python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("PYTHONPATH", None)  # the run's venv is not the driver's
        env.pop("VIRTUAL_ENV", None)
        proc = subprocess.Popen([str(self.python), "-I", str(DRIVER), json.dumps(self.config)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                bufsize=1, env=env, start_new_session=True)
        self.starts += 1
        first: queue.Queue = queue.Queue()
        stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self._stderr = stderr
        threading.Thread(target=_drain, args=(proc.stderr, stderr), daemon=True,
                         name="verifiers04-stderr").start()
        threading.Thread(target=self._read, args=(proc, first), daemon=True, name="verifiers04-stdout").start()
        try:
            message = first.get(timeout=self.start_timeout_s)
        except queue.Empty:
            _kill(proc)
            raise DriverTimeout(f"the verifiers 0.4 driver was not ready in {self.start_timeout_s:g} s "
                                f"(task.args.start_timeout_s){_tail(stderr)}") from None
        if message is None:
            code = proc.wait()
            raise DriverDied(f"the verifiers 0.4 driver exited with code {code} before it was ready{_tail(stderr)}")
        if "fatal" in message:
            proc.wait(timeout=30)
            raise ConfigError(message["fatal"]["field"], message["fatal"]["reason"])
        self._proc = proc
        return message["ready"]

    def _read(self, proc: subprocess.Popen, first: queue.Queue) -> None:
        """The driver's stdout: the first line to `first`, then each episode's answer to its
        future; at its end (the driver died or was closed), every pending episode fails."""
        try:
            line = proc.stdout.readline()
            first.put(_parse(line) if line else None)
            for line in proc.stdout:
                answer = _parse(line)
                future = self._pending.pop(answer.get("id"), None) if answer else None
                if future is not None and not future.done():
                    future.set_result(answer)
        finally:
            code = proc.wait()
            with self._lock:
                if self._proc is proc:
                    self._proc = None
                pending = [f for f in self._pending.values() if getattr(f, "proc", None) is proc]
            error = DriverDied(f"the verifiers 0.4 driver died (exit code {code}) during the episode"
                               f"{_tail(self._stderr)}")
            for future in pending:
                if not future.done():
                    future.set_exception(error)

    def close(self) -> None:
        """Close the driver's stdin (it ends its episodes and exits); killed past 10 s."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            _kill(proc)

    # -- episodes ----------------------------------------------------------------------------------
    def episode(self, idx: int, url: str, token: str) -> dict:
        """One rollout of task `idx` whose model calls go to `url`: the driver's answer
        ({"reward": ..., "rewards": {...}}); Verifiers04Error when it failed."""
        future, number, proc = self._send(idx, url, token)
        try:
            answer = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._pending.pop(number, None)
            self._write(proc, {"cancel": number})
            raise DriverTimeout(f"the verifiers 0.4 episode gave no answer in {self.timeout_s:g} s "
                                "(task.args.timeout_s): cancelled") from None
        if "error" in answer:
            raise Verifiers04Error(f"the verifiers 0.4 rollout failed: {answer['error']}")
        with self._lock:
            self._restart_allowed = True  # a driver that completes an episode earns its next restart
        return answer

    def _send(self, idx: int, url: str, token: str) -> tuple[Future, int, subprocess.Popen]:
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else None
            if proc is None:
                proc = self._restart()
            number = next(self._ids)
            future: Future = Future()
            future.proc = proc  # which driver holds it: its death fails it
            self._pending[number] = future
        if not self._write(proc, {"id": number, "idx": idx, "url": url, "token": token}):
            self._pending.pop(number, None)
            raise DriverDied(f"the verifiers 0.4 driver died before the episode reached it{_tail(self._stderr)}")
        return future, number, proc

    def _restart(self) -> subprocess.Popen:
        """A new driver in place of a dead one (under the lock): once until an episode completes."""
        if self.starts and not self._restart_allowed:
            raise DriverGone(f"the verifiers 0.4 driver died again after its restart: not started again"
                             f"{_tail(self._stderr)}")
        self._restart_allowed = False
        log.warning("verifiers04_driver_restart", starts=self.starts)
        ready = self.start()
        if ready["rows"] != self.rows:
            self.close()
            raise DriverGone("the restarted verifiers 0.4 driver loaded other tasks than the run's: not used")
        return self._proc

    @staticmethod
    def _write(proc: subprocess.Popen, message: dict) -> bool:
        try:
            proc.stdin.write(json.dumps(message) + "\n")
            proc.stdin.flush()
            return True
        except (OSError, ValueError):  # a closed pipe: the driver died
            return False


def _parse(line: str) -> dict | None:
    try:
        message = json.loads(line)
    except ValueError:
        log.warning("verifiers04_driver_bad_line", line=line[:200])
        return None
    return message if isinstance(message, dict) else None


def _drain(stream, lines: collections.deque) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))


def _tail(lines: collections.deque) -> str:
    text = "\n".join(list(lines)[-12:]).strip()
    return f"; its stderr ends:\n{text[-2000:]}" if text else ""


def _kill(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the harness programs it runs go too
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
