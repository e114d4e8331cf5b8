"""`orchestrator.bench.hosts`: hosts from namespaces reach each other and nothing else, see only
what they should, fail as told (cut, kill, cap) and leave nothing behind.

Needs root (network, PID and mount namespaces); skipped, with the kernel's reason, elsewhere.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator.bench.hosts import Hosts, HostsUnavailable, sweep

PREFIX = "ifltest"
PORT = 7000

# Reads each connection to its end, then sends all of it back.
SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    with c:
        data = b""
        while chunk := c.recv(65536):
            data += chunk
        c.sendall(data)
"""

# Prints "ok" when its payload came back whole, "fail <error>" when the connect failed.
CLIENT = r"""
import socket, sys
addr, port, size, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
payload = bytes(i % 251 for i in range(size))
try:
    s = socket.create_connection((addr, port), timeout=timeout)
except OSError as e:
    print("fail", type(e).__name__, e)
    sys.exit(0)
s.settimeout(120)
s.sendall(payload)
s.shutdown(socket.SHUT_WR)
got = b""
while chunk := s.recv(65536):
    got += chunk
print("ok" if got == payload else "mismatch %d" % len(got))
"""


def _hosts(n: int, **kwargs) -> Hosts:
    try:
        return Hosts(n, prefix=PREFIX, **kwargs)
    except HostsUnavailable as e:
        pytest.skip(f"namespaces unavailable here: {e}")


def _connect(host, address: str, *, size: int = 1000, timeout: float = 2.0) -> str:
    done = host.run([sys.executable, "-c", CLIENT, address, str(PORT), str(size), str(timeout)],
                    capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _root_addresses() -> str:
    return subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    base = tmp_path_factory.mktemp("hosts")
    (base / "store").mkdir()
    (base / "store" / "weights").write_text("w")
    return {"run": base / "run", "store": base / "store", "links": _root_links()}


@pytest.fixture(scope="module")
def hosts(layout):
    """Three hosts: 0 sees the run directory, 1 serves, 2 is killed and restarted."""
    with _hosts(3, hide=[layout["run"]], hide_except=(0,), read_only=[layout["store"]]) as hs:
        yield hs


@pytest.fixture(scope="module")
def server(hosts):
    proc = hosts[1].popen([sys.executable, "-c", SERVER, hosts[1].address, str(PORT)],
                          stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    yield proc
    proc.kill()
    proc.wait()


def test_a_host_reaches_another_over_tcp(hosts, server):
    assert _connect(hosts[0], hosts[1].address) == "ok"


def test_environment_and_cwd_are_exactly_the_given_ones(hosts, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "ONLY": "this"}
    out = hosts[1].run(["env", "-0"], env=env, cwd=tmp_path, capture_output=True, check=True)
    assert dict(v.split("=", 1) for v in out.stdout.decode().split("\0") if v) == env
    pwd = hosts[1].run(["pwd"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert pwd.stdout.strip() == str(tmp_path)


def test_network_isolation(hosts, server, layout):
    for host in hosts:
        routes = host.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
        assert "default" not in routes and routes.strip() != ""
    assert hosts.subnet_prefix + "." not in _root_addresses()
    root_routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    assert hosts.subnet_prefix + "." not in root_routes
    assert _root_links() == layout["links"]
    unassigned = f"{hosts.subnet_prefix}.200"
    assert _connect(hosts[0], unassigned, timeout=1.0).startswith("fail")


def test_hidden_directory_and_read_only_store(hosts, layout):
    (layout["run"] / "marker").write_text("run")
    ls = "import json, os, sys; print(json.dumps(sorted(os.listdir(sys.argv[1]))))"
    listing = [sys.executable, "-c", ls, str(layout["run"])]
    seen = [json.loads(h.run(listing, capture_output=True, check=True).stdout) for h in hosts]
    assert seen == [["marker"], [], []]
    hosts[1].run(["touch", str(layout["run"] / "from-host-1")], check=True)
    assert sorted(os.listdir(layout["run"])) == ["marker"]

    write = ("import sys\ntry:\n    open(sys.argv[1], 'w')\nexcept OSError as e:\n"
             "    print(e.errno)\nelse:\n    print('wrote')")
    new = str(layout["store"] / "new")
    for host in hosts:
        out = host.run([sys.executable, "-c", write, new], capture_output=True, text=True)
        assert out.stdout.strip() == str(errno.EROFS)
        cat = host.run(["cat", str(layout["store"] / "weights")], capture_output=True, text=True)
        assert cat.stdout == "w"
    assert not Path(new).exists()


def test_each_host_has_its_own_scratch(hosts):
    assert len({h.scratch for h in hosts}) == len(hosts)
    for host in hosts:
        assert host.scratch.is_dir()
        host.run(["sh", "-c", f"echo {host.name} > {host.scratch}/who"], check=True)
        assert (host.scratch / "who").read_text().strip() == host.name


def test_cut_and_restore(hosts, server):
    hosts[1].cut()
    try:
        assert _connect(hosts[0], hosts[1].address, timeout=1.0).startswith("fail")
        assert server.poll() is None
    finally:
        hosts[1].restore()
    assert _connect(hosts[0], hosts[1].address) == "ok"


def test_kill_ends_every_process_of_the_host_only(hosts, server):
    sleeper = hosts[2].popen(["sleep", "600"])
    inner = sleeper.program_pid()
    assert inner in hosts[2].processes()
    hosts[2].kill()
    assert sleeper.wait(timeout=30) == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{inner}")
    assert hosts[2].processes() == []
    assert server.poll() is None
    assert _connect(hosts[0], hosts[1].address) == "ok"
    hosts[2].restart()
    assert hosts[2].run(["true"]).returncode == 0


def test_signals_reach_the_program(hosts):
    proc = hosts[1].popen(["sleep", "600"])
    inner = proc.program_pid()
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not os.path.exists(f"/proc/{inner}")


def test_cap_sets_and_removes_tbf(hosts, server):
    hosts[0].cap(8)
    try:
        shown = hosts[0].run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True,
                             text=True, check=True).stdout
        assert "tbf" in shown and "rate 8Mbit" in shown
        assert _connect(hosts[0], hosts[1].address, size=1_000_000) == "ok"
        stats = hosts[0].run(["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True,
                             text=True, check=True).stdout
        assert int(stats.split("overlimits ")[1].split()[0]) > 0  # tbf held packets back
    finally:
        hosts[0].uncap()
    shown = hosts[0].run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True)
    assert "tbf" not in shown.stdout


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_cleanup_after_an_exception_and_twice(tmp_path):
    links = _root_links()
    with pytest.raises(RuntimeError, match="halfway"):
        with _hosts(2, scratch_root=tmp_path, hide=[tmp_path / "run"]) as hs:
            sleepers = [h.popen(["sleep", "600"]) for h in hs]
            pids = [p for h in hs for p in h.processes()] + [s.program_pid() for s in sleepers]
            names = [h.netns for h in hs] + [hs.switch]
            assert all(n in _netns() for n in names)
            scratches = [h.scratch for h in hs]
            raise RuntimeError("halfway")
    assert not any(n in _netns() for n in names)
    assert _root_links() == links and hs.subnet_prefix + "." not in _root_addresses()
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)
    assert all(s.wait(timeout=30) == -signal.SIGKILL for s in sleepers)
    assert not any(s.exists() for s in scratches) and os.listdir(tmp_path) == ["run"]
    hs.close()
    assert hs[0].processes() == []


def _leftover() -> tuple[str, subprocess.Popen]:
    """A namespace named as by a creator that died, with a process still in it."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{PREFIX}-{dead.pid}-abc-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    stray = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "600"])
    while not subprocess.run(["ip", "netns", "pids", name], capture_output=True).stdout:
        assert stray.poll() is None
    return name, stray


def test_sweep_removes_the_leftovers_of_a_dead_creator():
    mine = _hosts(1)
    name = stray = None
    try:
        name, stray = _leftover()
        scratch = Path(tempfile.gettempdir()) / (name.removesuffix("-0") + "-scratch-x")
        scratch.mkdir()
        assert sweep(PREFIX) == [name]
        assert name not in _netns() and stray.wait(timeout=30) == -signal.SIGKILL
        assert not scratch.exists()
        assert mine.switch in _netns()  # a live creator's namespaces stay
        name, stray = _leftover()
        _hosts(1).close()  # a new instance sweeps first
        assert name not in _netns() and stray.wait(timeout=30) == -signal.SIGKILL
    finally:
        mine.close()
        if stray:
            stray.kill()
            stray.wait()
        if name:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
