"""Hosts on one machine: n "machines" built from Linux namespaces, for tests and benchmarks.

A Ray cluster or a vLLM fleet behaves differently across machines than in one process tree: each
machine has its own address and view of the files, and can vanish or be cut off alone. `Hosts(n)`
gives that on one Linux machine (root needed) without touching the machine's own network:

- network: a "switch" network namespace holds a bridge `br0`; each host has a network namespace
  with a veth pair, `eth0` inside, `v{i}` on the bridge. Host i has 10.213.k.(i+1)/24, only inside
  its namespace: no default route, no NAT, nothing in the initial namespace, so a host reaches
  the other hosts and its loopback and nothing else (no IPv6 address is generated on these links:
  no neighbour discovery either). Each instance has its own switch; k only tells them apart.
- holder: each host has one process, PID 1 of a new PID namespace and a new private mount
  namespace (`ip netns exec NS unshare --mount --pid --fork --mount-proc`). Before it is ready it
  mounts an empty tmpfs over each `hide` path (not on the hosts of `hide_except`) and binds each
  `read_only` path read-only onto itself: mounts that exist only in that namespace, so nothing is
  mounted in, or left in, the machine's. Its /proc lists only the host's processes (what Ray or
  psutil look at there); it reaps the orphans reparented to it.
- processes: `host.popen` enters the holder's network, mount and PID namespaces with nsenter and
  runs argv with exactly `env` in `cwd`. SIGKILL to the holder makes the kernel kill every process
  of its PID namespace: that is `host.kill()`, and the clean-up of `close()`.
- faults: `cut()` sets the switch end of the host's veth down (unreachable, its processes keep
  running); `cap(mbit)` puts a tbf qdisc on both ends (netem is missing from some kernels).

Names carry the creator's pid (`{prefix}-{pid}-{tag}-{i}`, the switch `...-sw`, the scratch
directory `...-scratch-*`): `sweep()` removes what a creator that died before `close()` left.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

_TOOLS = ("ip", "tc", "unshare", "nsenter", "mount", "env")
_NAME = r"{prefix}-(\d+)-[0-9a-f]+"  # the part of every name of an instance before its suffix

# PID 1 of a host: mounts, says ready, then reaps the orphans that are reparented to it.
_HOLDER = r"""
import json, os, subprocess, sys, time
cfg = json.loads(sys.argv[1])
def mount(*args):
    r = subprocess.run([cfg["mount"], *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit("mount %s: %s" % (" ".join(args), r.stderr.strip()))
for path in cfg["hide"]:
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", path)
for path in cfg["read_only"]:
    mount("--bind", path, path)
    mount("-o", "remount,bind,ro", path)
print("ready", flush=True)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:  # none now: an orphan may be reparented to us later
        time.sleep(1)
"""


class HostsError(RuntimeError):
    """A command that builds, changes or removes hosts failed: its command line and stderr."""


class HostsUnavailable(HostsError):
    """The kernel or the machine refuses here (not root, no bridge, veth or tbf, no tool)."""


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise HostsUnavailable(f"{name} not found on PATH")
    return path


def _run(cmd: list[str], *, input: str | None = None, unavailable: bool = False,
         ok: tuple[str, ...] = ()) -> str:
    """Run a setup command; raise with its full command line, input and stderr unless the
    stderr says one of `ok` (e.g. "already gone" during a clean-up)."""
    r = subprocess.run(cmd, input=input or "", capture_output=True, text=True)
    if r.returncode and not any(s in r.stderr for s in ok):
        kind = HostsUnavailable if unavailable else HostsError
        batch = f" with input {input!r}" if input else ""
        raise kind(f"`{shlex.join(cmd)}`{batch} exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def _ip(netns: str, *lines: str, unavailable: bool = False) -> None:
    """Several `ip` commands in one namespace, one process: stops at the first that fails."""
    _run(["ip", "-n", netns, "-batch", "-"], input="\n".join(lines) + "\n",
         unavailable=unavailable)


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def _pidns(pid: int | str) -> str | None:
    """The PID namespace of a process ("pid:[inode]"); None once gone (or a zombie)."""
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/pid")
    return None


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _remove_netns(name: str) -> None:
    """Kill whatever is still in the namespace (holders, nsenter) until nothing is, then delete
    it. A process that entered it and outlives 10 s of SIGKILLs only delays the kernel's free."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = _run(["ip", "netns", "pids", name], ok=("No such file",)).split()
        if not pids:
            break
        for pid in pids:
            _kill(int(pid))
        time.sleep(0.01)
    _run(["ip", "netns", "del", name], ok=("No such file",))


def sweep(prefix: str = "ifl") -> list[str]:
    """Remove the namespaces (and their processes) and scratch directories of `prefix` whose
    creating process is gone: what an instance killed before its `close()` left. Returns the
    namespace names removed. A creator pid reused by a live process only delays the sweep."""
    name = _NAME.format(prefix=re.escape(prefix))

    def dead(suffix: str, s: str) -> bool:
        m = re.fullmatch(name + suffix, s)
        return m is not None and _pidns(m[1]) is None

    netns = [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]
    removed = [ns for ns in netns if dead(r"-(sw|\d+)", ns)]
    for ns in removed:
        _remove_netns(ns)
    for entry in Path(tempfile.gettempdir()).iterdir():
        if dead(r"-scratch.*", entry.name):
            shutil.rmtree(entry, ignore_errors=True)
    return removed


class HostProcess(subprocess.Popen):
    """A process started in a host. Its `pid` is nsenter's, which forks the program into the host's
    PID namespace and exits with its status (or its signal) but forwards no signal: so
    `send_signal`, `terminate` and `kill` signal the program itself (`program_pid()`)."""

    def program_pid(self, timeout: float = 5.0) -> int | None:
        """The program's pid (in this PID namespace); None once nsenter has exited."""
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            if children := _children(self.pid):
                return children[0]
            time.sleep(0.005)
        return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            _kill(self.program_pid() or self.pid, sig)


class Host:
    """One host of a `Hosts`: its address, its processes and its faults."""

    def __init__(self, hosts: Hosts, index: int, hide: list[str], read_only: list[str]):
        self.index = index
        self.name = f"{hosts.prefix}-{index}"
        self.netns = f"{hosts.tag}-{index}"
        self.address = f"{hosts.subnet_prefix}.{index + 1}"
        self.port = f"v{index}"  # the veth end in the switch namespace
        self.scratch = hosts.scratch_base / self.name
        self._switch = hosts.switch
        self._cfg = {"hide": hide, "read_only": read_only, "mount": _tool("mount")}
        self._unshare: subprocess.Popen | None = None
        self.holder_pid: int | None = None
        self._pidns: str | None = None  # kept after kill(): processes() then proves it empty
        self._capped = False

    def _build(self, cap_mbit: float | None) -> None:
        """Namespace, veth pair into the switch, address, then the holder."""
        self.scratch.mkdir()
        _run(["ip", "netns", "add", self.netns], unavailable=True)
        _ip(self.netns, f"link add eth0 type veth peer name {self.port} netns {self._switch}",
            "link set lo up", "link set eth0 addrgenmode none",
            f"addr add {self.address}/24 dev eth0", "link set eth0 up", unavailable=True)
        _ip(self._switch, f"link set {self.port} addrgenmode none",
            f"link set {self.port} master br0 up")
        self.restart()
        if cap_mbit is not None:
            self.cap(cap_mbit)

    @property
    def alive(self) -> bool:
        return self._unshare is not None and self._unshare.poll() is None

    def restart(self) -> None:
        """Kill the host's processes (if any) and start a fresh holder: new PID and mount
        namespaces with the same mounts; the network (address, cut, cap) is kept."""
        self.kill()
        cmd = ["ip", "netns", "exec", self.netns, _tool("unshare"), "--mount", "--pid", "--fork",
               "--kill-child", "--mount-proc", "--propagation", "private",
               sys.executable, "-I", "-S", "-c", _HOLDER, json.dumps(self._cfg)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        ready = select.select([proc.stdout], [], [], 60)[0]
        if not ready or proc.stdout.readline() != b"ready\n":
            proc.kill()
            err = proc.communicate()[1].decode(errors="replace").strip()
            shown = shlex.join([*cmd[:-2], "<holder script>", cmd[-1]])
            raise HostsUnavailable(f"`{shown}` did not start: {err}")
        proc.stdout.close()
        proc.stderr.close()
        if not (children := _children(proc.pid)):
            proc.kill()
            raise HostsUnavailable(f"no /proc/{proc.pid}/task/*/children (CONFIG_PROC_CHILDREN)")
        self._unshare, self.holder_pid = proc, children[0]
        self._pidns = _pidns(self.holder_pid)

    def popen(self, argv: list, *, env: dict | None = None, cwd: str | os.PathLike | None = None,
              **popen_kwargs) -> HostProcess:
        """Start argv in the host with exactly `env` (default os.environ) in `cwd` (default this
        process's cwd, as seen inside the host). argv[0] is looked up on env's PATH."""
        if not self.alive:
            raise HostsError(f"{self.name} is not running (killed; restart() it)")
        argv = [os.fspath(a) for a in argv]
        if "=" in argv[0]:
            raise ValueError(f"argv[0] {argv[0]!r} would be read by env(1) as a variable")
        cmd = [_tool("nsenter"), f"--target={self.holder_pid}", "--net", "--mount", "--pid",
               "--", _tool("env"), "-C", os.fspath(cwd or os.getcwd()), "--", *argv]
        env = dict(os.environ) if env is None else env
        return HostProcess(cmd, env=env, **popen_kwargs)

    def run(self, argv: list, *, input: bytes | str | None = None, timeout: float = 60.0,
            check: bool = False, capture_output: bool = False,
            **popen_kwargs) -> subprocess.CompletedProcess:
        """`subprocess.run` in the host; on a timeout the program is killed."""
        if capture_output:
            popen_kwargs["stdout"] = popen_kwargs["stderr"] = subprocess.PIPE
        if input is not None:
            popen_kwargs["stdin"] = subprocess.PIPE
        with self.popen(argv, **popen_kwargs) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except BaseException:
                proc.kill()
                raise
        done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def processes(self) -> list[int]:
        """Pids (in this PID namespace) of the host's processes, holder included."""
        pids = (p for p in os.listdir("/proc") if p.isdigit())
        return sorted(int(p) for p in pids if _pidns(p) == self._pidns)

    def kill(self) -> None:
        """SIGKILL the holder: the kernel kills every process of the host. Returns when they are
        gone. The network stays; `restart()` starts the host again, empty."""
        if self._unshare is None:
            return
        _kill(self.holder_pid)
        self._unshare.wait(timeout=30)
        self._unshare = None
        deadline = time.monotonic() + 30
        while self.processes():
            if time.monotonic() > deadline:
                raise HostsError(f"{self.name}: processes {self.processes()} outlived the holder")
            time.sleep(0.01)

    def cut(self) -> None:
        """Unplug the host from the switch: it is unreachable, its processes keep running."""
        _ip(self._switch, f"link set {self.port} down")

    def restore(self) -> None:
        _ip(self._switch, f"link set {self.port} up")

    def cap(self, mbit: float) -> None:
        """Limit both directions of the host's link to `mbit` Mbit/s: a tbf qdisc on each end
        (bursts of 10 ms of traffic, at least 32 KiB; at most 100 ms queued)."""
        burst = max(32 * 1024, int(mbit * 1e6 / 8 / 100))
        for ns, dev in ((self.netns, "eth0"), (self._switch, self.port)):
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                  f"{mbit}mbit", "burst", str(burst), "latency", "100ms"], unavailable=True)
        self._capped = True

    def uncap(self) -> None:
        for ns, dev in ((self.netns, "eth0"), (self._switch, self.port)) if self._capped else ():
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])
        self._capped = False

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address}, holder={self.holder_pid})"


class Hosts:
    """n hosts on one switch; a context manager. `hide` paths are empty tmpfs in every host but
    those in `hide_except`; `read_only` paths are read-only in every host. Leftovers of crashed
    instances with the same prefix are swept first."""

    def __init__(self, n: int, *, prefix: str = "ifl", subnet_index: int | None = None,
                 cap_mbit: float | None = None, hide: Iterable[str | os.PathLike] = (),
                 hide_except: Iterable[int] = (), read_only: Iterable[str | os.PathLike] = (),
                 scratch_root: str | os.PathLike | None = None):
        if not 1 <= n <= 254:
            raise ValueError(f"n={n}: one /24 holds 1 to 254 hosts")
        for tool in _TOOLS:
            _tool(tool)
        read_only = [os.path.realpath(p) for p in read_only]
        if missing := [p for p in read_only if not os.path.exists(p)]:
            raise ValueError(f"read_only paths {missing} do not exist")
        self.prefix = prefix
        self.tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        k = secrets.randbelow(254) + 1 if subnet_index is None else subnet_index
        self.subnet_prefix = f"10.213.{k}"
        self.subnet = f"{self.subnet_prefix}.0/24"
        self._closed = False
        self._made: list[str] = []  # namespaces created, in order
        self.scratch_base = Path(tempfile.mkdtemp(prefix=f"{self.tag}-scratch-", dir=scratch_root))
        hide, hide_except = [os.path.realpath(p) for p in hide], set(hide_except)
        self.hosts = [Host(self, i, [] if i in hide_except else hide, read_only) for i in range(n)]
        atexit.register(self.close)
        try:
            for path in hide:
                os.makedirs(path, exist_ok=True)
            sweep(prefix)
            self._build_switch()
            for host in self.hosts:
                self._made.append(host.netns)
                host._build(cap_mbit)
        except BaseException:
            self.close()
            raise

    def _build_switch(self) -> None:
        _run(["ip", "netns", "add", self.switch], unavailable=True)
        self._made.append(self.switch)
        _ip(self.switch, "link set lo up", "link add br0 type bridge",
            "link set br0 addrgenmode none", "link set br0 up", unavailable=True)

    def close(self) -> None:
        """Kill every host's processes, delete veths and namespaces, remove the scratch
        directories. Idempotent; goes on past a failing step and raises the first error."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        errors: list[BaseException] = []
        steps = [host.kill for host in self.hosts]
        steps += [lambda h=h: _run(["ip", "-n", self.switch, "link", "del", h.port],
                                   ok=("Cannot find device", "No such file"))
                  for h in self.hosts if h.netns in self._made]
        steps += [lambda name=name: _remove_netns(name) for name in reversed(self._made)]
        steps.append(lambda: shutil.rmtree(self.scratch_base))
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the rest of the clean-up must still run
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self):
        return iter(self.hosts)
