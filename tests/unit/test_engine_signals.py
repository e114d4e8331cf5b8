"""The vLLM plugin that leaves a terminal's Ctrl-C to the orchestrator: it ignores SIGINT in
an engine's child processes only (the whole-run behaviour is tested in
tests/reliability/test_no_orphans.py)."""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from transports.engine_signals import ENGINE_CHILD_ENV

SCRIPT = """
import json, multiprocessing, signal
from transports.engine_signals import register

def child(queue):
    register()
    queue.put(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)

if __name__ == "__main__":
    # What the terminal gives a process: Python's own SIGINT handler (a test runner started in
    # the background would hand down "ignored", and the child would inherit that instead).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    register()
    parent = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    ctx = multiprocessing.get_context("spawn")  # what vLLM's CPU platform uses
    queue = ctx.Queue()
    p = ctx.Process(target=child, args=(queue,))
    p.start()
    print(json.dumps({"parent_ignores": parent, "child_ignores": queue.get(timeout=60)}))
    p.join(60)
"""


def run(env_value: str | None, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENGINE_CHILD_ENV}
    if env_value is not None:
        env[ENGINE_CHILD_ENV] = env_value
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_an_engines_child_ignores_sigint_and_its_parent_does_not(tmp_path):
    assert run("1", tmp_path) == {"parent_ignores": False, "child_ignores": True}


def test_other_vllm_processes_are_left_alone(tmp_path):
    assert run(None, tmp_path) == {"parent_ignores": False, "child_ignores": False}


def test_vllm_finds_the_plugin_among_its_general_plugins():
    found = [e for e in entry_points(group="vllm.general_plugins") if e.value == "transports.engine_signals:register"]
    assert len(found) == 1


CHAIN = """
import multiprocessing, os, sys, time
from transports.engine_signals import register

def grandchild(late):
    # The engine core's part: it dies with its parent (the API server). `late`: the parent is
    # killed before this registers (the go file appears only once it is gone).
    if late:
        print(os.getpid(), flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.01)
    register()
    if not late:
        print(os.getpid(), flush=True)  # armed: only now may the test kill the parent
    time.sleep(600)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=grandchild, args=(sys.argv[2] == "late",))
    p.start()
    time.sleep(600)
"""


def start_chain(tmp_path, env: dict, mode: str) -> tuple[subprocess.Popen, int, Path]:
    """The chain's parent and its child's pid, read from the child itself (its stdout is the
    parent's): for "armed", once the child has registered."""
    import select

    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    go = tmp_path / "go"
    parent = subprocess.Popen([sys.executable, str(script), str(go), mode], stdout=subprocess.PIPE, env=env, text=True)
    ready, _, _ = select.select([parent.stdout], [], [], 120)
    assert ready, "the chain's child printed no pid within 120 s"
    return parent, int(parent.stdout.readline()), go


def kill_and_wait(parent: subprocess.Popen) -> None:
    import signal

    parent.send_signal(signal.SIGKILL)
    parent.wait(30)
    parent.stdout.close()


def wait_gone(pid: int, within_s: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_with_die_with_parent_an_engines_child_ends_when_its_parent_is_killed(tmp_path):
    """What ends a Ray-placed server's engine core when the actor's kill took only the server:
    SIGKILL the parent, and the child (a grandchild of no watchdog) is gone too."""
    from transports.engine_signals import DIE_WITH_PARENT_ENV

    env = {**os.environ, ENGINE_CHILD_ENV: "1", DIE_WITH_PARENT_ENV: "1"}
    parent, child, _ = start_chain(tmp_path, env, "armed")
    assert _alive(child)
    kill_and_wait(parent)
    assert wait_gone(child), _describe(child)


def test_a_child_that_registers_after_its_parent_died_ends_at_once(tmp_path):
    """The race the parent-death signal cannot cover: the parent is gone before the child arms it
    (an engine core still importing when its server is killed). The child finds its parent changed
    and ends itself."""
    from transports.engine_signals import DIE_WITH_PARENT_ENV

    env = {**os.environ, ENGINE_CHILD_ENV: "1", DIE_WITH_PARENT_ENV: "1"}
    parent, child, go = start_chain(tmp_path, env, "late")
    kill_and_wait(parent)
    assert _alive(child)  # orphaned and still running: not yet registered
    go.touch()
    assert wait_gone(child), _describe(child)


def test_without_it_the_child_outlives_its_parent(tmp_path):
    """The control: the same chain without the variable leaves the child running (then killed here)."""
    import signal
    import time

    parent, child, _ = start_chain(tmp_path, {**os.environ, ENGINE_CHILD_ENV: "1"}, "armed")
    kill_and_wait(parent)
    time.sleep(1.0)
    try:
        assert _alive(child)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _describe(pid: int) -> str:
    """What a child that outlived its parent was doing: its state, its parent, where it waits."""
    try:
        status = {k: v.strip() for k, v in (line.split(":", 1) for line in open(f"/proc/{pid}/status"))}
        wchan = open(f"/proc/{pid}/wchan").read()
    except OSError as e:
        return f"pid {pid}: {e}"
    return f"pid {pid} alive: State={status.get('State')} PPid={status.get('PPid')} wchan={wchan}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_fork_worker_setting_is_set_while_engine_cores_start_and_restored_by_the_last(monkeypatch):
    """Two in-process engines starting at once: the setting holds until the second is up (its
    engine core may be spawned last), then the environment is as it was, unset or set."""
    from orchestrator.engines.inproc import engine_core_env
    from transports.server_main import FORK_WORKER_ENV

    monkeypatch.delenv(FORK_WORKER_ENV, raising=False)
    first, second = engine_core_env(FORK_WORKER_ENV, "1"), engine_core_env(FORK_WORKER_ENV, "1")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert os.environ[FORK_WORKER_ENV] == "1"
    second.__exit__(None, None, None)
    assert FORK_WORKER_ENV not in os.environ
    monkeypatch.setenv(FORK_WORKER_ENV, "0")
    with engine_core_env(FORK_WORKER_ENV, "1"):
        assert os.environ[FORK_WORKER_ENV] == "1"
    assert os.environ[FORK_WORKER_ENV] == "0"
