"""The vLLM plugin that leaves a terminal's Ctrl-C to the orchestrator: it ignores SIGINT in
an engine's child processes only (the whole-run behaviour is tested in
tests/reliability/test_no_orphans.py)."""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

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
