"""transports.server_main: what a forked engine child does first (close the API server's socket, run
vLLM's plugins again), and the command and bench that choose it. The forked servers themselves
run in every server test (engine.start_method defaults to "fork"); tests/integration/test_engines.py
kills a server's API process and asserts its in-flight and later calls fail at once as dead, which
needs the children to have closed the inherited socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from transports.server_main import close_server_sockets


def test_a_forked_child_closes_the_sockets_of_the_served_port_and_keeps_the_others():
    served, other = socket.socket(), socket.socket()
    served.bind(("127.0.0.1", 0))  # bound, not listening yet: how the API server holds it when it forks
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = served.getsockname()[1]
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: what the at-fork hook does
            closed = close_server_sockets(port)
            alive = []
            for fd in (served.fileno(), other.fileno()):
                try:
                    os.fstat(fd)
                    alive.append(fd)
                except OSError:
                    pass
            os.write(write, repr((closed, alive)).encode())
            os._exit(0)
        os.close(write)
        closed, alive = eval(os.read(read, 1000).decode())  # noqa: S307 - our own child's repr
        os.waitpid(pid, 0)
        assert closed == [served.fileno()] and alive == [other.fileno()]
        served.getsockname()  # the parent's copy is untouched
        served.listen()
    finally:
        served.close()
        other.close()


def test_no_port_closes_nothing():
    assert close_server_sockets(None) == []


@pytest.mark.parametrize("method, entry", [("fork", "transports.server_main"),
                                           ("spawn", "vllm.entrypoints.openai.api_server")])
def test_the_start_method_picks_the_servers_entry(method, entry):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.server import server_command

    command = server_command(EngineConfig(kind="server", start_method=method), 8000)
    assert command[1:3] == ["-m", entry]


def test_an_unknown_start_method_is_refused_naming_the_field(tmp_path):
    from orchestrator.config.run import load_config
    from orchestrator.errors import ConfigError

    path = tmp_path / "run.toml"
    path.write_text('[engine]\nkind = "server"\nstart_method = "forkserver"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "start_method" in str(err.value)


def test_the_bench_refuses_an_unknown_kind_by_name():
    out = subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", "bench", "engine-start", "--kinds",
                          "server,gpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--kinds" in out.stderr and "'gpu'" in out.stderr, out.stderr
