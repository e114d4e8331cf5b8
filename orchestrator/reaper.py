"""No process outlives a run: a watchdog process, and a parent-death signal for our children.

vLLM's in-process engine runs its engine core and worker as child processes that nothing
watches: when the orchestrator dies (SIGKILL, the OOM killer, a crash in native code) they are
re-parented to init and keep running, with their memory, for minutes. A server engine runs in
a session of its own (a terminal's Ctrl-C must reach the orchestrator only), and torchrun gives
every trainer rank a session of its own: no one process group holds the run.

So every run has a token: `INFLIGHT_RUN_TOKEN`, put in the orchestrator's environment before it
starts any child, is inherited by every process started from then on — by us, by vLLM, by
torchrun — wherever it is re-parented. `Reaper.start()` also starts a watchdog (`python -m
orchestrator.reaper PARENT_PID TOKEN`) in a session of its own, so that neither a terminal's
SIGINT nor a SIGKILL of the orchestrator's process group reaches it. It waits until the
orchestrator ends (its stdin pipe says so or closes, or its parent changes) and then SIGKILLs
every process carrying the token until none is left. At a normal end `Reaper.stop()` has it
sweep what the teardown left and waits for it. /proc does not always show a process's token: a
process that retitles itself (vLLM's engine core calls setproctitle) overwrites the memory /proc
reads its environment from, and one forked without exec shows the environment its parent started
with (found trying a double Ctrl-C from a plain shell: the engine core outlived the run, its /proc
environment 2 KB of mostly zeros). So the watchdog also notes the orchestrator's descendants while
it lives (`descendants`, every TRACK_EVERY_S) and sweeps those too, each known by its start time.

Children we start ourselves also get a parent-death signal (`die_with_parent`, Linux's
`PR_SET_PDEATHSIG`): SIGKILL as soon as the orchestrator thread that started them ends.

multiprocessing's resource tracker is spared while the orchestrator lives (it belongs to the
orchestrator and frees its shared memory when it ends) and given a moment to do so after.

Light on purpose: the watchdog imports only the standard library.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

RUN_TOKEN = "INFLIGHT_RUN_TOKEN"
PR_SET_PDEATHSIG = 1
SWEEP_LIMIT_S = 30.0
TRACKER_GRACE_S = 3.0
TRACK_EVERY_S = 0.5  # how often the watchdog notes the orchestrator's descendants


class Reaper:
    """The run's token and its watchdog process (see the module docstring)."""

    def __init__(self, token: str, process: subprocess.Popen, pipe: int) -> None:
        self.token, self.process, self._pipe = token, process, pipe

    @classmethod
    def start(cls) -> Reaper:
        token = uuid.uuid4().hex
        os.environ[RUN_TOKEN] = token
        read_end, write_end = os.pipe()  # not inheritable: only the watchdog gets an end of it
        env = {k: v for k, v in os.environ.items() if k != RUN_TOKEN}  # it must not sweep itself
        try:
            process = subprocess.Popen([sys.executable, "-m", "orchestrator.reaper", str(os.getpid()), token],
                                       stdin=read_end, stdout=subprocess.DEVNULL, env=env,
                                       start_new_session=True)
        finally:
            os.close(read_end)
        return cls(token, process, write_end)

    def stop(self, timeout_s: float = SWEEP_LIMIT_S + 10) -> None:
        """The run is over: the watchdog kills what is left of it (what a forked child that
        kept the pipe open could not stop) and exits; blocking."""
        try:
            os.write(self._pipe, b"x")
        except OSError:
            pass  # the watchdog is gone already
        os.close(self._pipe)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if os.environ.get(RUN_TOKEN) == self.token:
            del os.environ[RUN_TOKEN]


def die_with_parent(ignore_sigint: bool = False,
                    death_signal: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` (None where Linux's prctl is missing): the child
    gets `death_signal` (SIGKILL unless said) when the thread that started it ends, and exits
    at once if its parent is already gone. `ignore_sigint`: a terminal's Ctrl-C is the
    orchestrator's to handle (it stops the child itself, after a graceful stop); an ignored
    SIGINT stays ignored across exec, and Python then installs no KeyboardInterrupt handler.
    A SIGINT as `death_signal` lets a child that handles it (a pytest run) end its own way."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child only calls
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if ignore_sigint:
            libc.signal(signal.SIGINT, 1)  # SIG_IGN
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return preexec


# -- the watchdog process ----------------------------------------------------------------------
def run_processes(token: str, exclude: set[int]) -> list[tuple[int, bool]]:
    """(pid, is a multiprocessing resource tracker) of every live process whose environment
    carries the run's token; zombies are gone already (and show no environment)."""
    entry = f"{RUN_TOKEN}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                tracker = b"resource_tracker" in f.read()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        found.append((int(name), tracker))
    return found


def _stat(pid: int) -> tuple[int, bytes] | None:
    """(parent pid, start time) of a live process, from /proc/PID/stat; None for one that is
    gone or a zombie (dead, waiting for its parent to reap it: nothing left to kill)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after the command name, which may hold spaces
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), fields[19]


def descendants(root: int, since: int = 0) -> dict[int, bytes]:
    """pid -> start time of every live descendant of `root` started at or after `since` (clock
    ticks since boot, as /proc says)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, bytes] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            children.setdefault(stat[0], []).append(int(name))
            starts[int(name)] = stat[1]
    found: dict[int, bytes] = {}
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if int(starts[child]) >= since:
                found[child] = starts[child]
            stack.append(child)
    return found


def tracked_processes(tracked: dict[int, bytes], exclude: set[int]) -> list[tuple[int, bool]]:
    """(pid, is a resource tracker) of the descendants seen earlier that still live (the same
    process: its start time unchanged, so a reused pid is never taken for one)."""
    found = []
    for pid, start in tracked.items():
        stat = _stat(pid)
        if pid in exclude or stat is None or stat[1] != start:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                tracker = b"resource_tracker" in f.read()
        except OSError:
            continue
        found.append((pid, tracker))
    return found


def sweep(token: str, exclude: set[int], spare_trackers: bool, limit_s: float = SWEEP_LIMIT_S,
          tracked: dict[int, bytes] | None = None) -> int:
    """SIGKILL every process of the run until none is left (bounded by `limit_s`): those whose
    environment carries the token, and the orchestrator's descendants the watchdog saw
    (`tracked`); resource trackers last, after a grace to free shared memory, or never when
    `spare_trackers`. Returns how many kills were sent."""
    deadline = time.monotonic() + limit_s
    trackers_due: float | None = None
    kills = 0
    while time.monotonic() < deadline:
        found = list(dict(run_processes(token, exclude) + tracked_processes(tracked or {}, exclude)).items())
        targets = [pid for pid, tracker in found if not tracker]
        trackers = [pid for pid, tracker in found if tracker]
        if not targets:
            if spare_trackers or not trackers:
                return kills
            trackers_due = trackers_due or time.monotonic() + TRACKER_GRACE_S
            targets = trackers if time.monotonic() >= trackers_due else []
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
                kills += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
    return kills


def watch(parent: int, token: str, poll_s: float = 0.2) -> int:
    """Wait for the orchestrator's end, then sweep its run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.fileno()
    normal_end = False
    # The orchestrator's descendants, as seen while it lives: one whose /proc environment shows no
    # token (retitled, or forked without exec: see the module docstring) has nothing else tying
    # it to the run once re-parented to init.
    # Only those started after this watchdog: what the orchestrator's process held before the
    # run began (a test session's engines, a notebook's) is not the run's.
    own = _stat(os.getpid())
    since = int(own[1]) if own is not None else 0
    tracked: dict[int, bytes] = {}
    next_scan = 0.0
    while os.getppid() == parent:
        if time.monotonic() >= next_scan:
            tracked.update(descendants(parent, since))
            next_scan = time.monotonic() + TRACK_EVERY_S
        if select.select([stdin], [], [], poll_s)[0]:
            # A byte: `Reaper.stop` (the orchestrator lives on a moment). EOF: it is gone (its
            # descriptors close before its children are re-parented, so getppid cannot tell yet).
            normal_end = os.read(stdin, 1) == b"x"
            break
    if normal_end:
        tracked.update(descendants(parent, since))
    sweep(token, exclude={os.getpid(), parent}, spare_trackers=normal_end, tracked=tracked)
    return 0


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), sys.argv[2]))
