"""No process outlives a run: every child (vLLM's engine core and worker, a server engine and its
children, the trainer) dies with the orchestrator, whether it exits, is SIGKILLed, or its
terminal sends SIGINT to the whole process group.

Processes are told apart by a marker the test puts in the environment of `inflight run` (every
descendant inherits it, wherever it is re-parented), read from /proc; zombies are gone already.
The first tests exercise the mechanism (`orchestrator.reaper`) with plain processes; the
engine-marked ones run the real command (the Ctrl-C one: the session's `interrupted_run`, whose
log the replay tests analyse).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

MARK = "INFLIGHT_TEST_MARK"
INFLIGHT = [sys.executable, "-m", "orchestrator.commands.cli"]


def marked(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment holds MARK=mark."""
    entry = f"{MARK}={mark}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found.append((int(name), f.read().replace(b"\0", b" ").decode(errors="replace")[:200]))
        except (OSError, IndexError):
            continue
    return found


def gone_within(mark: str, seconds: float) -> list[tuple[int, str]]:
    """The marked processes still alive after `seconds` (empty as soon as none is)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = marked(mark)
        if not left:
            return []
        time.sleep(0.2)
    return marked(mark)


def kill_marked(mark: str) -> None:
    for pid, _ in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def marked_env(mark: str) -> dict[str, str]:
    """A user's shell, marked: without the VLLM_WORKER_MULTIPROC_METHOD that vLLM leaves in this
    process's environment once an engine started here (a run's engines then start as from a
    plain shell)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    return {**env, MARK: mark}


# -- the mechanism, with plain processes ----------------------------------------------------------
ORCHESTRATOR = textwrap.dedent("""
    import os, subprocess, sys, time
    from orchestrator.reaper import Reaper, die_with_parent
    reaper = Reaper.start()
    # a child in our group, one in a session of its own (as a server engine), and a grandchild
    # re-parented to init (as vLLM's engine core once its parent is gone)
    subprocess.Popen(["sleep", "300"])
    subprocess.Popen(["sleep", "300"], start_new_session=True)
    subprocess.Popen(["sh", "-c", "sleep 300 & exit 0"])
    # and a child forked without exec: /proc shows it the environment this process started with,
    # which holds no token (as vLLM's engine core, retitled, shows none)
    if os.fork() == 0:
        time.sleep(300)
        os._exit(0)
    print("ready", flush=True)
    if sys.argv[1] == "stop":
        time.sleep(1)
        reaper.stop()
        print("stopped", flush=True)
    time.sleep(300)
""")


def start_orchestrator(mark: str, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR, mode], stdout=subprocess.PIPE, text=True,
                            env=marked_env(mark), start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.timeout(60)
def test_the_watchdog_kills_every_process_of_a_sigkilled_orchestrator():
    mark = uuid.uuid4().hex
    proc = start_orchestrator(mark, "kill")
    try:
        time.sleep(0.5)
        assert len(marked(mark)) >= 6  # orchestrator, watchdog, three sleeps, the forked child
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert gone_within(mark, 10) == []
    finally:
        kill_marked(mark)


@pytest.mark.timeout(60)
def test_a_normal_stop_sweeps_what_the_run_left_and_nothing_started_before_it():
    mark = uuid.uuid4().hex
    before = subprocess.Popen(["sleep", "300"], env=marked_env(mark))  # not the run's: no token
    proc = start_orchestrator(mark, "stop")
    try:
        assert proc.stdout.readline().strip() == "stopped"
        left = {pid for pid, _ in marked(mark)}
        assert left == {proc.pid, before.pid}, marked(mark)
    finally:
        proc.kill()
        before.kill()
        kill_marked(mark)


@pytest.mark.timeout(60)
def test_a_child_started_with_die_with_parent_dies_with_it_without_the_watchdog():
    mark = uuid.uuid4().hex
    script = textwrap.dedent("""
        import subprocess, time
        from orchestrator.reaper import die_with_parent
        subprocess.Popen(["sleep", "300"], start_new_session=True, preexec_fn=die_with_parent(ignore_sigint=True))
        print("ready", flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=marked_env(mark))
    try:
        assert proc.stdout.readline().strip() == "ready"
        (child, _), = [(pid, cmd) for pid, cmd in marked(mark) if pid != proc.pid]
        with open(f"/proc/{child}/status") as f:  # SIGINT (2) ignored: bit 1 of SigIgn
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1))
        proc.kill()
        proc.wait(10)
        assert gone_within(mark, 5) == []
    finally:
        kill_marked(mark)


@pytest.mark.timeout(60)
def test_die_with_parent_can_send_a_sigint_that_the_child_handles_its_own_way(tmp_path):
    """What the test runner's light lane uses: a pytest that gets SIGINT when its runner dies ends
    as on a Ctrl-C (its own cleanup), where a SIGKILL would leave its children behind."""
    mark, said = uuid.uuid4().hex, tmp_path / "interrupted"
    started = tmp_path / "started"
    # Its KeyboardInterrupt handler set explicitly: a suite started as a shell's background job
    # inherits SIGINT ignored, and Python then installs none.
    child = (f"import pathlib, signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
             f"try:\n    pathlib.Path({str(started)!r}).touch()\n    time.sleep(300)\n"
             f"except KeyboardInterrupt:\n    pathlib.Path({str(said)!r}).write_text('SIGINT')\n")
    script = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        from orchestrator.reaper import die_with_parent
        subprocess.Popen([sys.executable, "-c", {child!r}], start_new_session=True,
                         preexec_fn=die_with_parent(death_signal=signal.SIGINT))
        print("ready", flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=marked_env(mark))
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:  # inside its try: the handler in place
            time.sleep(0.05)
        proc.kill()
        proc.wait(10)
        assert gone_within(mark, 10) == []
        assert said.read_text() == "SIGINT"
    finally:
        kill_marked(mark)


# -- the real command ---------------------------------------------------------------------------
def write_config(tmp_path: Path, model: Path, extra: str = "") -> Path:
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(f"""
        [engine]
        model = "{model}"
        {extra}
        [scheduler]
        group_size = 4
        batch_groups = 4
        [run]
        progress = "plain"
        tensorboard = false
        shutdown_grace_s = 10.0
    """))
    return path


def health(run_dir: Path) -> dict:
    import urllib.request

    try:
        url = json.loads((run_dir / "http.json").read_text())["url"]
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError, KeyError):
        return {}


def run_until_step(tmp_path: Path, config: Path, mark: str, step: int = 2) -> tuple[subprocess.Popen, Path]:
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    proc = subprocess.Popen([*INFLIGHT, "run", str(config), "--run-dir", str(run_dir), "--max-steps", "200"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=marked_env(mark),
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while (health(run_dir).get("step") or 0) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_marked(mark)
            raise AssertionError(f"no step {step} (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    return proc, run_dir


def engine_processes(mark: str) -> list[str]:
    return [cmd for _, cmd in marked(mark) if "orchestrator.trainer.process" not in cmd]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["inproc", "server"])
def test_sigkill_of_the_orchestrator_leaves_no_process_of_the_run_after_10_s(tmp_path, rl_model, kind):
    mark = uuid.uuid4().hex
    extra = 'kind = "server"' if kind == "server" else ""
    proc, _ = run_until_step(tmp_path, write_config(tmp_path, rl_model, extra), mark)
    try:
        alive = marked(mark)
        commands = " | ".join(cmd for _, cmd in alive)
        assert "orchestrator.trainer.process" in commands, commands
        if kind == "server":
            assert "transports.server_main" in commands, commands  # the server (its engine forked from it)
        assert len(alive) >= 4, commands  # orchestrator, watchdog, trainer, engine processes
        os.kill(proc.pid, signal.SIGKILL)  # the orchestrator alone, as the OOM killer would
        proc.wait(10)
        assert gone_within(mark, 10) == [], "processes outlived the run"
    finally:
        kill_marked(mark)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_successful_run_ends_cleanly_and_its_engine_leaves_on_its_own(tmp_path, rl_model):
    """Issue #30 item 8: the end of a run that succeeded prints no traceback, no force-kill and no
    leaked shared memory. vLLM force-killed the engine core (and its worker) when they were slow
    to exit, the killed core never unlinked its message queue's shared memory (the resource
    tracker's warning), and AsyncLLM's output handler could log an EngineDeadError traceback
    (transports.engine_signals.skip_final_gc_at_exit, InProcessEngine.shutdown). And still
    nothing of the run is left."""
    mark = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    try:
        out = subprocess.run([*INFLIGHT, "run", str(write_config(tmp_path, rl_model)), "--run-dir", str(run_dir),
                              "--max-steps", "2"], capture_output=True, text=True, env=marked_env(mark), timeout=540)
        output = out.stdout + out.stderr
        assert out.returncode == 0, output[-4000:]
        for line in ("force killing", "leaked shared_memory", "Traceback", "output_handler failed",
                     "still running after"):
            assert line not in output, f"{line!r} in the output:\n{output[-4000:]}"
        assert gone_within(mark, 10) == [], "processes outlived the run"
    finally:
        kill_marked(mark)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigint_to_the_whole_process_group_stops_gracefully_and_leaves_nothing(interrupted_run):
    """On the session's run that a Ctrl-C stopped after 5 steps (tests/conftest.py, shared with
    the replay tests): its whole process group got the SIGINT."""
    from replay.log import read_records
    from replay.records import ConsumptionRecord, RolloutRecord

    output = interrupted_run.output
    assert interrupted_run.code == 0, output[-4000:]
    assert interrupted_run.left == [], "processes outlived the run"
    # The engine's own processes leave the Ctrl-C to the orchestrator (transports.engine_signals):
    # none of them dies of it (a worker's SystemExit, the engine core's "RuntimeError: cancelled"),
    # and no rollout errors because the engine died under it.
    assert "RuntimeError: cancelled" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    records = list(read_records(interrupted_run.run_dir))  # strict: every record reads
    assert not [r for r in records if isinstance(r, RolloutRecord) and r.status_name == "errored"]
    steps = [r.step for r in records if isinstance(r, ConsumptionRecord)]
    assert steps and steps == list(range(1, len(steps) + 1))
    rollouts = [r.rollout_id for r in records if isinstance(r, RolloutRecord)]
    assert len(rollouts) == len(set(rollouts))


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_second_ctrl_c_exits_130_at_once_and_still_leaves_nothing(tmp_path, rl_model):
    """The second SIGINT skips the graceful stop (os._exit): only the watchdog is left to stop
    the engine and the trainer."""
    mark = uuid.uuid4().hex
    proc, run_dir = run_until_step(tmp_path, write_config(tmp_path, rl_model), mark, step=1)
    try:
        os.kill(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 60
        while '"run.stopping"' not in (run_dir / "orchestrator.jsonl").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "the first Ctrl-C did not start a stop"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130
        assert gone_within(mark, 10) == [], "processes outlived the run"
    finally:
        kill_marked(mark)


def test_a_zombie_is_no_process_left_to_kill():
    """A killed child of a living orchestrator stays a zombie until reaped: the sweep must not
    count it (it looped on one until its time limit, delaying every run's normal end by 30 s)."""
    from orchestrator.reaper import _stat, descendants, tracked_processes

    child = subprocess.Popen(["sleep", "300"])
    try:
        tracked = descendants(os.getpid())
        assert child.pid in tracked and _stat(child.pid) is not None
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while open(f"/proc/{child.pid}/stat").read().split(") ")[1][0] != "Z":  # dead, not reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert child.pid not in dict(tracked_processes(tracked, exclude=set()))
    finally:
        child.kill()
        child.wait()
