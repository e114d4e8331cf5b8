"""The vLLM OpenAI server as inflight starts it (`python -m transports.server_main ARGS...`, the
arguments of `python -m vllm.entrypoints.openai.api_server`), with its engine core and worker
processes started by `fork` instead of `spawn` (EngineConfig.start_method = "fork", the default).

vLLM's CPU platform forces `spawn` for every process it starts. A spawned child imports vLLM (and
torch, transformers) again from nothing: a server is three processes (API server, engine core,
worker), so start-up paid that import three times in a row, about 12 s each on an idle 2-core
machine and far more under load. Forked from the API server, the engine core and the worker hold
those modules already; measured 2026-12-03 under the same load, back to back: 37 s to /health
against 72 s (tiny-rl, enforce_eager). `inflight bench engine-start` measures it.

Why fork is safe here, and what it must redo:
- The API server runs no torch kernel before it starts the engine core, and the engine core none
  before it starts its worker, so no OpenMP thread pool exists to be broken by the fork (vLLM's
  worker sets its OpenMP binding itself, after it starts). vLLM on CUDA forks by default when
  CUDA is not initialized; only its CPU platform says spawn.
- vLLM loads its general plugins once a process (a module flag). A forked child inherits the flag
  set, so inflight's plugin (`transports.engine_signals`: Ctrl-C, parent death, the drain on
  SIGTERM, the exit without a final collection) would not run in the engine core and worker; the
  flag is cleared in every forked child so that vLLM's own call runs it there, as under spawn.
- A forked child inherits the API server's open files, its listening socket among them. Kept
  open there, a server whose API process died would still take connections that nobody answers
  (a client waits out its timeout instead of being refused at once, which is how a dead server
  is told apart). Every forked child closes its copy of the server's socket first.

Only servers use this: an in-process engine's parent is the orchestrator itself (threads, the
trainer's link, open files), which must not be forked.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import socket
import sys

VLLM_MAIN = "vllm.entrypoints.openai.api_server"
# Set (to "1") in the environment of an in-process engine's engine core: its worker is forked.
FORK_WORKER_ENV = "INFLIGHT_FORK_WORKER"
# Where vLLM asks for its start method (each module imported the function by name).
_MP_CONTEXT_USERS = ("vllm.utils.system_utils", "vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor",
                     "vllm.v1.engine.coordinator")


def _fork_context():
    return multiprocessing.get_context("fork")


def _plugins_again() -> None:
    import vllm.plugins

    vllm.plugins.plugins_loaded = False


def _in_forked_server_child() -> None:
    _plugins_again()
    close_server_sockets(_served_port())


_hooks: set = set()


def _at_fork(hook) -> None:
    if hook not in _hooks:  # once a process: a plugin may be loaded again in it
        _hooks.add(hook)
        os.register_at_fork(after_in_child=hook)


def _served_port() -> int | None:
    args = sys.argv
    for i, arg in enumerate(args):
        if arg == "--port" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return None


def close_server_sockets(port: int | None) -> list[int]:
    """Close this process's TCP sockets bound to `port`: the API server's, inherited. It binds
    the socket before it starts the engine and listens on it only later, so a bound socket of
    that port is the one, listening yet or not. Returns their file descriptors."""
    if port is None:
        return []
    closed = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket (or gone since the listing)
            continue
        try:
            ours = sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6) \
                and sock.getsockname()[1] == port
        except OSError:
            ours = False
        finally:
            sock.detach()  # the descriptor is closed below or left as it was, never twice
        if ours:
            os.close(fd)
            closed.append(fd)
    return closed


def fork_worker() -> None:
    """In an engine core (vLLM's general plugin, `transports.engine_signals`, where
    FORK_WORKER_ENV is set): its worker is forked from it rather than spawned. An in-process
    engine's engine core is still spawned (its parent is the orchestrator); its worker then
    imports nothing again."""
    import vllm.v1.executor.multiproc_executor as executor

    executor.get_mp_context = _fork_context
    _at_fork(_plugins_again)


def use_fork() -> None:
    """Every process vLLM starts from here on is forked (see the module's docstring)."""
    import importlib

    for name in _MP_CONTEXT_USERS:
        module = importlib.import_module(name)
        if not hasattr(module, "get_mp_context"):
            raise RuntimeError(f"{name} has no get_mp_context: this vLLM starts its processes elsewhere; "
                               "set engine.start_method = \"spawn\"")
        module.get_mp_context = _fork_context
    _at_fork(_in_forked_server_child)


def main() -> None:
    use_fork()
    sys.argv = [VLLM_MAIN, *sys.argv[1:]]
    runpy.run_module(VLLM_MAIN, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
