"""A vLLM general plugin (entry point `vllm.general_plugins`): the engine core and worker
processes of an engine that inflight started ignore SIGINT.

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
starts its engines; any other vLLM use (`inflight generate`, a test's engine, a user's own
`vllm serve` in this environment) is left alone.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

ENGINE_CHILD_ENV = "INFLIGHT_ENGINE_CHILD"


def register() -> None:
    if os.environ.get(ENGINE_CHILD_ENV) != "1" or multiprocessing.parent_process() is None:
        return
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signal dispositions are set from there only
        pass
