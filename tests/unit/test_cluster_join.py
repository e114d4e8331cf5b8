"""Joining the Ray cluster at `[cluster] address`: an address where no Ray cluster answers is refused
by name, at once, before `ray.init` (which retries a closed or silent port for minutes, printing
nothing), and `ray.init` itself is bounded; the engine actor as a plain object. Loopback only; no Ray
cluster needed."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from orchestrator.cluster.ray_engines import EngineHost, RayPlacement, gcs_endpoint, probe_gcs, within
from orchestrator.commands import cli
from orchestrator.config.cluster import ClusterConfig
from orchestrator.errors import ConfigError
from orchestrator.reaper import RUN_TOKEN
from tests.helpers import free_port


def test_an_address_where_nothing_listens_is_refused_by_name_before_ray_init(capsys):
    ray = pytest.importorskip("ray")
    port = free_port()  # bound, then closed: nothing listens on it
    config = ClusterConfig(address=f"127.0.0.1:{port}").validate()
    with pytest.raises(ConfigError) as info:
        RayPlacement(config, "join-test", node_ip="127.0.0.1").connect()
    assert info.value.field == "cluster.address"
    assert info.value.reason.startswith(f"no Ray cluster answers at 127.0.0.1:{port} ("), info.value.reason
    assert not ray.is_initialized()  # refused by the probe: ray.init never ran
    # `inflight run` reports it as one line and exits 2
    assert cli.exit_code(BaseExceptionGroup("setup", [info.value])) == 2
    assert capsys.readouterr().err.splitlines() == [f"inflight: error: {info.value}"]


def test_a_port_that_accepts_passes_the_probe():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        probe_gcs("127.0.0.1", listening.getsockname()[1])  # no error: the bounded ray.init decides


def test_the_probe_reads_host_and_port_from_every_address_form():
    assert gcs_endpoint("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert gcs_endpoint("[::1]:6379") == ("::1", 6379)
    assert gcs_endpoint("ray://head:10001") == ("head", 10001)
    assert gcs_endpoint("auto") is None and gcs_endpoint("head:port") is None  # Ray's to resolve or refuse


def test_within_hands_back_the_result_or_the_exception_of_the_call():
    assert within(30, lambda: 42) == 42

    def refused():
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError, match="refused"):
        within(30, refused)


def test_within_gives_up_on_a_call_that_never_returns():
    release, returned = threading.Event(), threading.Event()

    def hangs():
        release.wait()
        returned.set()

    with pytest.raises(TimeoutError):
        within(0.2, hangs)
    assert not returned.is_set()  # it gave up while the call still hung
    release.set()
    assert returned.wait(30)  # the abandoned call is left to finish on its own thread


def test_the_engine_actor_starts_no_watchdog(monkeypatch):
    """Ray would kill it with the actor before it could sweep: the server's parent-death signals
    end it instead (see `EngineHost`)."""
    monkeypatch.delenv(RUN_TOKEN, raising=False)
    host = EngineHost("engine-0")
    assert RUN_TOKEN not in os.environ  # a watchdog's token, which every child would inherit
    assert not hasattr(host, "reaper")
    assert host.stop() is None  # no server started: nothing to stop, nothing to wait for
