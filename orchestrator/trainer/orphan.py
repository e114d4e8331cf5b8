"""Whether the trainer's orchestrator is gone (`Orphan`): the trainer then exits instead of
waiting for messages that will never come."""

from __future__ import annotations

import os


class Orphan:
    """Whether the orchestrator is gone: the parent changed (the trainer was re-parented), or
    the `--orchestrator-pid` process (under torchrun the parent is torchrun's agent) exited, or
    its pid now names another process (its start time changed)."""

    def __init__(self, orchestrator_pid: int | None) -> None:
        self.parent_pid = os.getppid()
        self.orchestrator_pid = orchestrator_pid
        self._started = _start_time(orchestrator_pid) if orchestrator_pid is not None else None

    def __call__(self) -> bool:
        if os.getppid() != self.parent_pid:
            return True
        if self.orchestrator_pid is None:
            return False
        if not _alive(self.orchestrator_pid):
            return True
        started = _start_time(self.orchestrator_pid)
        return started is not None and self._started is not None and started != self._started


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/PID/stat field 22); None unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
