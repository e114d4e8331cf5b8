"""The suite as two pytest sessions at once (`--lane`, tests/conftest.py): what `make test` and CI
run. The main lane (every module not marked `light_lane`: the engine tests, the multi-host ones,
anything with a wall-clock bound) runs in the foreground as a plain pytest would; the light lane
(the modules marked `light_lane`: they pass at any pace) runs beside it at a lower CPU priority,
its output kept in .test-lanes/light.log and printed when the main lane is done. On two cores the
main lane alone leaves about half a core idle (three engine modules: 77% of both cores busy on
average, in stretches of a minute at 100% and of a minute at 50%); the light lane's tests use it.
docs/testing.md.

The light lane runs in a session of its own, its autogroup's nice at LIGHT_NICENESS. Linux groups
the CPU's share by session first (autogroup, on by default on desktop and cloud kernels alike), and
every vLLM server and `inflight run` a test starts is a session of its own: a niceness within the
runner's session ranked the light lane only against the main pytest, and the light lane took an
equal share against every engine (an engine test 72-78 s beside two busy light processes, 44-47 s
alone; in a session of its own at nice 10, 50 s). Its own session is not the terminal's foreground
group, so the runner passes a Ctrl-C on to it, and it gets one (SIGINT: its fixtures stop their
engines) if the runner dies.

    python -m tests.lanes [PYTEST ARGS...]   # both lanes; the arguments go to each
    TEST_REPORTS=DIR python -m tests.lanes   # also a JUnit XML per lane: DIR/main.xml, DIR/light.xml

The exit status is the main lane's if it failed, else the light lane's ("no tests collected" in one
lane counts as passing when the other ran). Ctrl-C stops both (each pytest handles it as usual);
SIGTERM is passed on to both.

Where the kernel has cgroup v1's cpu controller and this process may make a group in it (root on
these machines), the light lane runs in a cpu cgroup of its own at LIGHT_SHARES, and everything it
starts stays there: an `inflight run`'s trainer and engines start sessions of their own, which
leave a niceness's autogroup behind but never a cgroup. Without one, the light lane's own processes
are niced as above, and the runs its tests start compete at full weight.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# TEST_LANES_DIR: another place for the light lane's log (a runner started by a test of the runner
# must not truncate the log its own light lane is writing).
LOGS = Path(os.environ.get("TEST_LANES_DIR") or ROOT / ".test-lanes")
LIGHT_NICENESS = 10  # at 10 the light lane gets ~10% of a core the main lane wants, all of an idle one
AUTOGROUP = Path("/proc/self/autogroup")  # "nice N" of this process's session group, where the kernel has them
NO_TESTS = 5  # pytest's exit status when a selection collects nothing
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller, where it is mounted
LIGHT_SHARES = 110  # the weight of a nice-10 task against a nice-0 session's 1024: the same ranking


def pytest_argv(lane: str, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "pytest", f"--lane={lane}", *extra]
    if reports := os.environ.get("TEST_REPORTS"):
        Path(reports).mkdir(parents=True, exist_ok=True)
        argv.append(f"--junitxml={Path(reports) / f'{lane}.xml'}")
    if lane == "light":  # one session writes pytest's cache (last failures): two would overwrite each other
        argv += ["-p", "no:cacheprovider"]
    return argv


def exit_status(main: int, light: int) -> int:
    if main not in (0, NO_TESTS):
        return main
    if light not in (0, NO_TESTS):
        return light
    return NO_TESTS if main == light == NO_TESTS else 0


def main(extra: list[str]) -> int:
    with light_cgroup() as group:
        return run_lanes(extra, group)


def run_lanes(extra: list[str], group: Path | None) -> int:
    LOGS.mkdir(exist_ok=True)
    log_path = LOGS / "light.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        light = subprocess.Popen(pytest_argv("light", extra), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 preexec_fn=light_lane_preexec(group))
    where = (f"in cpu cgroup {group} (cpu.shares {LIGHT_SHARES}: every process it starts stays there)" if group
             else "without a cpu cgroup (none could be made here: the runs its tests start are not niced)")
    print(f"lanes: the light lane (the modules marked light_lane) runs beside this one at niceness "
          f"{LIGHT_NICENESS}, {where}; its output goes to {shown(log_path)} and is printed at the end", flush=True)
    main_lane = subprocess.Popen(pytest_argv("main", extra), cwd=ROOT)
    children = (main_lane, light)

    def forward(signum, _frame) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    codes, seconds = wait_for({"main": main_lane, "light": light}, started)
    print(f"\n{'=' * 30} the light lane ({shown(log_path)}) {'=' * 30}", flush=True)
    sys.stdout.buffer.write(log_path.read_bytes())
    print(f"lanes: main exit {codes['main']} after {seconds['main']:.0f} s, light exit {codes['light']} after "
          f"{seconds['light']:.0f} s (both started together)", flush=True)
    return exit_status(codes["main"], codes["light"])


@contextlib.contextmanager
def light_cgroup():
    """A cpu cgroup for the light lane at LIGHT_SHARES (None where none can be made), removed after
    the lanes end. A process left in it (one that outlived its test) keeps it: rmdir then fails,
    and the group stays for that process's life; the next runner removes it once it is empty.
    The group is made inside the runner's own (a runner started by a light test: inside that
    lane's group, where its weight is a share of that lane's)."""
    parent = own_cpu_cgroup()
    for stale in parent.glob("inflight-light-lane-*"):  # left by a runner that was killed
        if not Path("/proc", stale.name.rsplit("-", 1)[-1]).exists():  # a live runner's group is its own
            with contextlib.suppress(OSError):
                stale.rmdir()  # refused while a process is in it
    group = parent / f"inflight-light-lane-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.shares").write_text(str(LIGHT_SHARES))
    except OSError:  # no cgroup v1 cpu controller here, or no right to make a group in it
        with contextlib.suppress(OSError):
            group.rmdir()
        group = None
    try:
        yield group
    finally:
        if group is not None:
            with contextlib.suppress(OSError):
                group.rmdir()


def own_cpu_cgroup() -> Path:
    """This process's cpu cgroup directory, or the controller's mount where that path is not under
    it (a container whose mount is its own subtree, while /proc names the host's path)."""
    try:
        path = cpu_cgroup_in(Path("/proc/self/cgroup").read_text())
    except (OSError, StopIteration, IndexError):
        return CPU_CGROUP
    own = CPU_CGROUP / path.lstrip("/")
    return own if own.is_dir() else CPU_CGROUP


def cpu_cgroup_in(proc_cgroup: str) -> str:
    """The cpu controller's group in a /proc/PID/cgroup text ("N:cpu,cpuacct:/path" lines);
    StopIteration where no line names that controller."""
    return next(line.split(":", 2)[2] for line in proc_cgroup.splitlines() if "cpu" in line.split(":")[1].split(","))


def light_lane_preexec(group: Path | None = None):
    """The light lane's `preexec_fn`: a session of its own whose autogroup (where the kernel has
    them) and niceness are LIGHT_NICENESS, in cpu cgroup `group` when given, and a SIGINT when the
    runner dies."""
    from orchestrator.reaper import die_with_parent

    die_with_runner = die_with_parent(death_signal=signal.SIGINT)  # built before the fork
    procs = None if group is None else group / "cgroup.procs"

    def preexec() -> None:
        os.setsid()
        try:
            AUTOGROUP.write_text(str(LIGHT_NICENESS))
        except OSError:  # a kernel without autogroups: the niceness alone ranks the lanes
            pass
        os.nice(LIGHT_NICENESS)
        if procs is not None:
            try:
                procs.write_text(str(os.getpid()))
            except OSError:  # the group went away: the niceness and the autogroup still rank the lane
                pass
        if die_with_runner is not None:
            die_with_runner()

    return preexec


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def wait_for(lanes: dict[str, subprocess.Popen], started: float) -> tuple[dict[str, int], dict[str, float]]:
    """Each lane's exit status and the seconds it ran, once both are done. A light lane that ends
    first says so in one line (its output still comes at the end)."""
    codes: dict[str, int] = {}
    seconds: dict[str, float] = {}
    while len(codes) < len(lanes):
        try:
            for name, child in lanes.items():
                if name not in codes and (code := child.poll()) is not None:
                    codes[name], seconds[name] = code, time.monotonic() - started
                    if name == "light" and "main" not in codes:
                        print(f"\nlanes: the light lane ended: exit {code} after {seconds[name]:.0f} s", flush=True)
            time.sleep(0.2)
        except KeyboardInterrupt:  # the terminal's Ctrl-C reached the main lane: each ends its own way
            light = lanes.get("light")
            if light is not None and light.poll() is None:  # not in the terminal's group: passed on
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(light.pid, signal.SIGINT)
            continue
    return codes, seconds


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
