"""A scoring worker process (`orchestrator.scoring.pool`): build the task once, then answer jobs.

Started as `python -c ...` with the parent's sys.path; reads length-framed pickles from its job
pipe (the first one the builder), writes length-framed answers to its answer pipe. Light on
purpose: what it imports, every worker pays for at start.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
from collections.abc import Iterator

from orchestrator.errors import ConfigError, InflightError, ModelError
from orchestrator.scoring.outcome import REWARD_ERROR, ScoreFailed, checked, one_line

FRAME = struct.Struct("!I")  # each message: its length, then the pickle
READ_SIZE = 1 << 16  # per read(): a larger buffer costs an mmap per call
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def worker_main(job_fd: str, answer_fd: str, parent_pid: str, title: str, nice: str) -> None:
    """A worker's life: build the task, then score jobs until the job pipe closes."""
    _arm(int(parent_pid), title, int(nice))
    jobs, out = _frames(int(job_fd)), int(answer_fd)
    try:
        builder_bytes = next(jobs, None)
        if builder_bytes is None:
            return
        try:
            from orchestrator.observe.logging import configure_logging

            # The orchestrator built this same task and logged its warnings: not again per worker.
            configure_logging("json", "error")
            task = pickle.loads(builder_bytes)()
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to start(), named
            _write_frame(out, pickle.dumps(("failed", _encode_start_error(exc))))
            return
        _write_frame(out, pickle.dumps(("ready", os.getpid())))
        for job in jobs:
            _write_frame(out, _answer(task, job))
    except OSError:
        return  # the orchestrator is gone


def _answer(task, job: bytes) -> bytes:
    try:
        prompt, token_ids = pickle.loads(job)
        return pickle.dumps(("ok", checked(task.score_sync(prompt, token_ids))), protocol=pickle.HIGHEST_PROTOCOL)
    except ScoreFailed as exc:
        return pickle.dumps(("failed", exc.kind, exc.message))
    except Exception as exc:  # noqa: BLE001 - a task's bug errors one rollout, not the run
        return pickle.dumps(("failed", REWARD_ERROR, one_line(exc)))


def _frames(fd: int) -> Iterator[bytes]:
    """Messages read from `fd` until EOF (blocking)."""
    buffer = bytearray()
    while True:
        while len(buffer) >= FRAME.size and len(buffer) >= FRAME.size + FRAME.unpack_from(buffer)[0]:
            size = FRAME.unpack_from(buffer)[0]
            message = bytes(buffer[FRAME.size:FRAME.size + size])
            del buffer[:FRAME.size + size]
            yield message
        data = os.read(fd, READ_SIZE)
        if not data:
            return
        buffer += data


def _write_frame(fd: int, payload: bytes) -> None:
    data = memoryview(FRAME.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data):]


def _arm(parent_pid: int, title: str, nice: int) -> None:
    """Die with the orchestrator, ignore a terminal's Ctrl-C, carry a name `ps -o comm` shows,
    and yield the CPU to the event loop when the machine is short of it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        name = ctypes.create_string_buffer(title.encode()[:15])
        libc.prctl(PR_SET_NAME, ctypes.addressof(name), 0, 0, 0)
    if nice:
        os.nice(nice)
    if os.getppid() != parent_pid:  # the orchestrator died before the signal was armed
        os._exit(1)


def _encode_start_error(exc: BaseException) -> tuple:
    """A builder's failure as plain data: these errors' field and reason do not survive the
    plain pickling of an exception (their constructors take two arguments)."""
    if isinstance(exc, ConfigError):
        return ("config", exc.field, exc.reason)
    if isinstance(exc, ModelError):
        return ("model", exc.path, exc.reason)
    if isinstance(exc, InflightError):
        try:
            data = pickle.dumps(exc)
            pickle.loads(data)
            return ("pickled", data)
        except Exception:  # noqa: BLE001 - it does not round-trip: say it in words
            pass
    return ("other", f"building the task in a scoring process failed: {one_line(exc)}")
