"""`make test`'s two lanes (tests/lanes.py, `--lane` in tests/conftest.py): they split the suite
with nothing run twice and nothing left out, the light lane holding only the modules marked
`light_lane` (less their `wall_clock` tests and any that asks for a shared engine);
the runner runs both, prints the light lane's output and exits with the status that counts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.lanes import NO_TESTS, exit_status

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
# A module of each kind: an unmarked unit module with engine tests, a `light_lane` unit module, an
# engine module under integration, a run fixture's user, an unmarked module that starts no engine,
# the multi-host tests, a `light_lane` module with one `wall_clock` test, an engine module marked
# `light_lane` (its own engines, sync mode).
SAMPLE = ["tests/unit/test_refit_families.py", "tests/unit/test_model_presets.py",
          "tests/integration/test_run_misuse.py", "tests/integration/test_replay_analysis_run.py",
          "tests/unit/test_score_pool.py", "tests/cluster/test_hosts.py",
          "tests/unit/test_docs_tasks.py", "tests/integration/test_any_model.py"]
WALL_CLOCK = "tests/unit/test_docs_tasks.py::test_a_reward_that_raises_or_hangs_is_named_and_bounded"


def collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_the_lanes_split_the_suite_and_the_light_lane_has_only_its_marked_modules():
    everything = collected(*SAMPLE)
    main, light = collected("--lane=main", *SAMPLE), collected("--lane=light", *SAMPLE)
    assert sorted(main + light) == sorted(everything) and not set(main) & set(light)
    assert {t.split("::")[0] for t in main} == {"tests/unit/test_refit_families.py", "tests/integration/test_run_misuse.py",
                                                "tests/integration/test_replay_analysis_run.py", "tests/cluster/test_hosts.py",
                                                "tests/unit/test_score_pool.py", "tests/unit/test_docs_tasks.py"}
    assert [t for t in main if t.startswith("tests/unit/test_docs_tasks.py")] == [WALL_CLOCK]
    assert {t.split("::")[0] for t in light} == {"tests/unit/test_model_presets.py", "tests/unit/test_docs_tasks.py",
                                                 "tests/integration/test_any_model.py"}


def test_a_light_lane_test_that_asks_for_a_shared_engine_runs_in_the_main_lane():
    from types import SimpleNamespace

    from tests.conftest import in_main_lane

    def item(marks: set[str], fixtures: list[str]):
        return SimpleNamespace(fixturenames=fixtures, get_closest_marker=lambda name: name if name in marks else None)

    assert not in_main_lane(item({"light_lane"}, ["tmp_path"]), "unit")
    assert in_main_lane(item({"light_lane"}, ["tmp_path", "server_engine"]), "unit")
    assert in_main_lane(item({"light_lane", "wall_clock"}, []), "unit")
    assert in_main_lane(item({"light_lane"}, []), "cluster")
    assert in_main_lane(item({"engine"}, []), "integration") and in_main_lane(item(set(), []), "unit")


def test_the_status_is_the_main_lanes_failure_then_the_light_lanes():
    assert exit_status(0, 0) == 0
    assert exit_status(1, 0) == 1 and exit_status(2, 1) == 2 and exit_status(0, 1) == 1
    assert exit_status(NO_TESTS, 0) == 0 and exit_status(0, NO_TESTS) == 0  # a selection of one lane's tests
    assert exit_status(NO_TESTS, 1) == 1 and exit_status(NO_TESTS, NO_TESTS) == NO_TESTS


@pytest.mark.timeout(600)
def test_the_runner_runs_both_lanes_and_prints_the_light_ones_output(tmp_path):
    """Run inside `make test`'s own light lane: its log goes elsewhere (TEST_LANES_DIR), or it
    would truncate the log that lane is writing."""
    import os

    args = [sys.executable, "-m", "tests.lanes", "tests/unit/test_model_presets.py", "-k", "shapes"]
    env = {**os.environ, "TEST_REPORTS": str(tmp_path / "reports"), "TEST_LANES_DIR": str(tmp_path / "lanes")}
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    banner = f"the light lane ({tmp_path / 'lanes' / 'light.log'})"
    assert banner in done.stdout and "1 passed" in done.stdout.split(banner)[1]
    assert "lanes: main exit 5" in done.stdout and "light exit 0" in done.stdout
    assert 'tests="1"' in (tmp_path / "reports" / "light.xml").read_text()
    nothing = subprocess.run(args[:-1] + ["no_test_has_this_name"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env=env)
    assert nothing.returncode == NO_TESTS, nothing.stdout[-3000:]


def test_the_light_lane_runs_in_a_session_of_its_own_at_its_niceness():
    """Linux shares the CPU between sessions before niceness counts (autogroups): the light lane's
    niceness is felt by the engines' sessions only when its session's group carries it too."""
    import os

    from tests.lanes import AUTOGROUP, LIGHT_NICENESS, light_lane_preexec

    code = ("import os, pathlib; p = pathlib.Path('/proc/self/autogroup'); "
            "print(os.getsid(0) == os.getpid(), os.nice(0), p.read_text().split()[-1] if p.exists() else '-')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=light_lane_preexec())
    leader, nice, group_nice = out.stdout.split()
    assert leader == "True", out.stdout
    assert int(nice) == min(19, os.nice(0) + LIGHT_NICENESS)
    if AUTOGROUP.exists():
        assert int(group_nice) == LIGHT_NICENESS, out.stdout


def test_the_light_lane_and_the_sessions_its_tests_start_share_its_cpu_cgroup():
    """An `inflight run` started by a light test starts sessions of its own (its trainer, its
    engines): the autogroup's niceness stays behind, the light lane's cpu cgroup does not."""
    from tests.lanes import CPU_CGROUP, LIGHT_SHARES, cpu_cgroup_in, light_cgroup, light_lane_preexec, own_cpu_cgroup

    code = ("import subprocess, sys\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; print(os.getsid(0) == os.getpid()); "
            "print(open(\"/proc/self/cgroup\").read())'], start_new_session=True, capture_output=True, text=True)\n"
            "print(child.stdout, end='')\n")
    with light_cgroup() as group:
        if group is None:  # the fallback is for machines where no group can be made
            with pytest.raises(OSError):
                (own_cpu_cgroup() / "inflight-lanes-test").mkdir()
            return
        assert (group / "cpu.shares").read_text().strip() == str(LIGHT_SHARES)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             preexec_fn=light_lane_preexec(group))
        leader, cgroups = out.stdout.split("\n", 1)
        assert leader == "True", out.stdout + out.stderr  # the grandchild led a session of its own
        path = f"/{group.relative_to(CPU_CGROUP)}"  # inside `make test`'s light lane: inside that lane's group
        assert cpu_cgroup_in(cgroups) == path, cgroups
        assert cpu_cgroup_in(open("/proc/self/cgroup").read()) != path, "only the lane is in it"
    assert not group.exists(), "removed once the lanes are done"


@pytest.mark.timeout(600)
def test_a_ctrl_c_to_the_runners_group_stops_the_light_lane_too(tmp_path):
    """The light lane is not in the terminal's process group: the runner passes the Ctrl-C on."""
    import os
    import signal
    import time

    import psutil

    env = {**os.environ, "TEST_LANES_DIR": str(tmp_path / "lanes")}
    # A terminal's runner: SIGINT at its default, whatever this suite inherited (a shell's background
    # job starts with SIGINT ignored, and an ignored SIGINT stays ignored down every exec).
    runner = subprocess.Popen([sys.executable, "-m", "tests.lanes", "tests/unit/test_trainer_loss.py", "-k", "tis"],
                              cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        light = []
        deadline = time.monotonic() + 120
        while not light and time.monotonic() < deadline:
            light = [p for p in psutil.Process(runner.pid).children() if lane_of(p) == "light"]
            time.sleep(0.2)
        assert light, "no light lane started"
        assert os.getsid(light[0].pid) != os.getsid(runner.pid)
        time.sleep(3)  # inside pytest's start-up or its test: either way a SIGINT ends it
        os.killpg(runner.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the foreground group only
        output, _ = runner.communicate(timeout=240)
        assert not light[0].is_running() or light[0].status() == psutil.STATUS_ZOMBIE
        assert "light exit" in output and "light exit 0" not in output, output[-3000:]
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)


def lane_of(child) -> str | None:
    """"light" or "main" for a lane the runner started; None for another child, or one gone or a
    zombie by the time its command line is read (a lane that ended before its parent reaped it)."""
    import psutil

    try:
        argv = child.cmdline()
    except psutil.Error:
        return None
    return next((a.split("=", 1)[1] for a in argv if a.startswith("--lane=")), None)
