"""A vLLM general plugin (entry point `vllm.general_plugins`): the engine core and worker
processes of an engine that inflight started ignore SIGINT, and, where asked, die with their parent;
and every engine core drains the requests an activation paused when it is told to stop (SIGTERM).

Every engine child (engine core, worker) also skips the interpreter's final garbage collection
when it exits (`skip_final_gc_at_exit`): that collection alone made each of them take seconds to
leave after vLLM's own teardown had finished, long enough for vLLM to force-kill them.

A terminal's Ctrl-C goes to the whole foreground process group. vLLM's engine core and worker
processes are in it and handle SIGINT themselves: the worker raises SystemExit, the engine core
fails with `RuntimeError: cancelled`, a screen of tracebacks follows, and the engine dies under
the rollouts still in flight, so the orchestrator's graceful stop (abort and record every
rollout, then shut the engine down) found a dead engine and waited out its timeouts. With this
plugin the orchestrator alone takes the Ctrl-C and stops its engines in order; SIGTERM (what
vLLM's own shutdown sends) still ends them, and the reaper and parent-death signal still keep
none alive after the orchestrator.

vLLM loads general plugins in every process it runs, after the engine core and the worker have
installed their own signal handlers. This one acts only in a child process (a multiprocessing
parent exists) whose environment carries ENGINE_CHILD_ENV, which `inflight run` sets before it
starts its engines and `ServerEngine` sets for every server it spawns (a test's server among them);
any other vLLM use (`inflight generate`, a test's in-process engine, a user's own `vllm serve` in
this environment) is left alone.

With DIE_WITH_PARENT_ENV (set for every server inflight starts: `ServerEngine` on this host, a Ray
actor's on another, `orchestrator.cluster.ray_engines`) each such child also gets a parent-death
signal: the engine core dies with the API server, the worker with the engine core. On another host
no watchdog of ours outlives the actor (Ray kills a dead worker's children, the watchdog among them,
but not its grandchildren): the chain of parent-death signals is what ends the whole server when
its actor goes. On this one it is what ends a server's engine core and worker when the API server is
killed outright and nobody stops its group (a test session interrupted while a server of its own
started: the engine core and worker lived on, reparented to init, before the chain was set here).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

from transports.server_main import FORK_WORKER_ENV, fork_worker

ENGINE_CHILD_ENV = "INFLIGHT_ENGINE_CHILD"
# How long a drained engine core refuses calls before it exits (bounded by --shutdown-timeout).
SHUTDOWN_LINGER_S = float(os.environ.get("INFLIGHT_SHUTDOWN_LINGER_S", "10"))
DIE_WITH_PARENT_ENV = "INFLIGHT_ENGINE_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1


def register() -> None:
    drain_paused_requests_on_shutdown()  # every engine core in this environment, ours or a user's server
    if os.environ.get(FORK_WORKER_ENV) == "1" and multiprocessing.parent_process() is not None:
        fork_worker()  # an in-process engine's engine core (transports.server_main)
    if multiprocessing.parent_process() is not None:  # vLLM's engine core and worker processes
        skip_final_gc_at_exit()
    if os.environ.get(ENGINE_CHILD_ENV) != "1" or multiprocessing.parent_process() is None:
        return
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signal dispositions are set from there only
        pass
    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        die_with_parent(multiprocessing.parent_process().pid)


def die_with_parent(parent_pid: int | None) -> None:
    """SIGKILL this process when its parent ends (and now, if it already has)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # prctl is variadic and its options are unsigned longs: typed, so that no register's upper
    # half reaches the kernel as part of the signal number (which it would refuse, EINVAL).
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        # Unarmed, this process would outlive its parent unseen: leave now rather than run orphaned.
        errno = ctypes.get_errno()
        os.write(2, f"inflight: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(errno)}): exiting\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent ended before the prctl
        os.kill(os.getpid(), signal.SIGKILL)


_final_gc_skipped = False


def skip_final_gc_at_exit() -> None:
    """Freeze the heap (`gc.freeze`) as the process exits, so that the interpreter's finalization
    does not scan it. An engine's worker and engine core hold the whole of torch, transformers and
    vLLM: after vLLM's own teardown has run (message queues shut and unlinked, distributed state
    destroyed), the collections of `Py_FinalizeEx` took ~3.4 s of a 4.8 s shutdown between them
    (measured 2026-12-03, tiny-rl: py-spy showed the exiting worker in `gc_collect_main` with no
    Python frame left). The engine core waits for its worker before it exits, and AsyncLLM gives
    the engine core a bounded wait (CORE_EXIT_WAIT_S, orchestrator.engines.inproc): every shutdown
    ended in "force killing remaining process EngineCore" and "force killing sub process
    VLLM::Worker", and the killed engine core never unlinked its rpc broadcast queue's shared
    memory ("resource_tracker: There appear to be 1 leaked shared_memory objects"). With the heap
    frozen at exit the shutdown takes 1.4-1.5 s (idle or mid-stream), and both processes leave on
    their own. vLLM does the same on ROCm for the engine core (`gc.freeze()` after a clean
    shutdown, "process exit reclaims it"). Objects in cycles are not finalized at exit then:
    nothing of vLLM's teardown relies on that (it closes and unlinks explicitly before), and the
    memory goes with the process."""
    import atexit
    import gc

    global _final_gc_skipped
    if _final_gc_skipped:
        return
    _final_gc_skipped = True
    atexit.register(gc.freeze)  # atexit runs before the interpreter's final collections


def drain_paused_requests_on_shutdown() -> None:
    """A SIGTERM with --shutdown-timeout > 0 drains: the engine core keeps stepping until it has
    no work, refusing anything new. vLLM 0.32 counts no unfinished request while its scheduler
    is paused with mode "keep" (an activation's pause), so a SIGTERM that lands during a pause
    ends the engine at once and strands every paused request. Resuming the scheduler when the
    shutdown is requested lets them finish like the others (under the weights they started with:
    a swap is a utility call, and the shutting-down engine refuses those). Patched only in a
    process that has the engine core loaded (the engine core's own). Once drained, it lingers
    `SHUTDOWN_LINGER_S` refusing calls ("Server shutting down") before it exits: without that, an
    engine with nothing in flight exits at once and its clients see a crash, not a leave."""
    import sys

    core = sys.modules.get("vllm.v1.engine.core")
    cls = getattr(core, "EngineCoreProc", None)  # where the busy loop and `_handle_shutdown` live
    original = getattr(cls, "_handle_shutdown", None)
    if original is None or getattr(original, "_inflight_drains_paused", False):
        return

    def _handle_shutdown(self):
        if not getattr(self.vllm_config, "shutdown_timeout", 0):
            return original(self)  # abort mode: vLLM's own
        drained_at = self.__dict__.get("_inflight_drained_at")
        if drained_at is None:
            if self.shutdown_state == core.EngineShutdownState.REQUESTED and self.is_scheduler_paused():
                self.resume_scheduler()
            if original(self):
                return True
            drained_at = self.__dict__["_inflight_drained_at"] = time.monotonic()
        # Drained (or nothing to drain): linger a moment, refusing every request and control
        # call with "Server shutting down", so that a client that asks learns the server is
        # leaving rather than finding it gone (which reads as a crash).
        if quit_marker(os.getppid()).exists():  # stopped by the process that started the server
            return False
        if time.monotonic() - drained_at < min(SHUTDOWN_LINGER_S, self.vllm_config.shutdown_timeout):
            time.sleep(0.05)  # the busy loop does not block while it shuts down
            return True
        return False

    _handle_shutdown._inflight_drains_paused = True
    cls._handle_shutdown = _handle_shutdown


def quit_marker(server_pid: int):
    """A file whose presence tells the engine core of server `server_pid` that the process which
    started the server stops it (inflight's own shutdown, `terminate_process_group`): it exits
    once drained, without the linger meant for a SIGTERM from elsewhere (a spot reclaim)."""
    import tempfile
    from pathlib import Path

    return Path(tempfile.gettempdir()) / f"inflight-quit-{server_pid}"
