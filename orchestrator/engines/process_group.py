"""Stopping a server engine's process tree: its process group (it runs in a session of its own),
SIGTERM then SIGKILL, until no member is left (`terminate_process_group`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from transports.engine_signals import quit_marker


def terminate_process_group(proc: subprocess.Popen, grace_s: float = 15.0) -> bool:
    """SIGTERM a server's process group, SIGKILL what is left after grace_s, and wait until no
    member (zombies included) remains, so that no engine process outlives us. False when the
    leader could not be reaped."""
    pgid = proc.pid  # started with start_new_session: the group id is the leader's pid
    marker = quit_marker(pgid)  # our own stop: no linger after the drain (transports.engine_signals)
    try:
        marker.touch()
    except OSError:
        pass
    try:
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            if _wait_group_gone(proc, pgid, wait):
                break
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return False
        return True
    finally:
        marker.unlink(missing_ok=True)


def _wait_group_gone(proc: subprocess.Popen, pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader; orphaned members are reaped by init
        if not _group_alive(pgid):
            return True
        time.sleep(0.05)
    return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
