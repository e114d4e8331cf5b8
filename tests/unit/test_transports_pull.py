"""Versions pulled over HTTP (`transports.pull`, `orchestrator.cluster.weights`): what an engine on
another host than the run directory stages. A real weight server (the run's Starlette route on
uvicorn, 127.0.0.1), a real filesystem publish, the worker-side stager with a pull config."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from orchestrator.cluster.weights import weights_routes
from tests.unit.test_transports_swap import (  # noqa: F401 - swap: the stager fixture
    extension,
    live_equals,
    swap,
    synchronizer,
    version_state,
    wait_state,
)
from transports.errors import TransportError, TransportTimeoutError
from transports.filesystem import version_dir
from transports.pull import mirror_version, serve_path

TOKEN = "s3cret-token"


@pytest.fixture
def server(tmp_path):
    """The weight server over `tmp_path / "weights"`: yields (url, root)."""
    import uvicorn
    from starlette.applications import Starlette

    root = tmp_path / "weights"
    root.mkdir()
    app = Starlette(routes=weights_routes(root, TOKEN))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", root
    srv.should_exit = True
    thread.join(10)


def published(root, versions=(1,)):
    state = None
    sync = synchronizer(root, version_state(1))
    for v in versions:
        state = version_state(v)
        sync._state_dict = lambda s=state: s  # noqa: SLF001 - the next publish's weights
        sync.mark_stale()
        assert sync.sync_weights() == v
    return sync, state


def test_a_mirrored_version_is_the_published_one_byte_for_byte(server, tmp_path):
    url, root = server
    sync, _ = published(root)
    mirror = mirror_version(url, TOKEN, 1, tmp_path / "mirror", timeout_s=10)
    source = version_dir(root, 1)
    assert sorted(p.name for p in mirror.iterdir()) == sorted(p.name for p in source.iterdir())
    for path in source.iterdir():
        assert (mirror / path.name).read_bytes() == path.read_bytes(), path.name
    sync.shutdown()


def test_a_worker_with_a_pull_config_stages_and_applies_the_version_from_the_server(swap, server):  # noqa: F811
    url, root = server
    state = version_state(1)
    sync = synchronizer(root, state)
    sync.mark_stale()
    sync.sync_weights()
    ext, model = extension(swap, "/nonexistent-run-dir", sync.plan, strategy="pause_swap",
                           pull={"url": url, "token": TOKEN})
    ext.swap_stage(json.dumps({"version": 1}))
    status = wait_state(ext, "staged", "failed")
    assert status["state"] == "staged", status
    ext.swap_apply()
    assert live_equals(model, state)
    sync.shutdown()


def test_a_wrong_token_is_refused_by_name(server, tmp_path):
    url, root = server
    sync, _ = published(root)
    with pytest.raises(TransportError, match="HTTP 401"):
        mirror_version(url, "wrong", 1, tmp_path / "mirror", timeout_s=5)
    assert not (tmp_path / "mirror" / "v00000001").exists()
    sync.shutdown()


def test_an_uncommitted_version_is_waited_for_within_the_timeout_then_named(server, tmp_path):
    url, root = server
    with pytest.raises(TransportTimeoutError, match="v00000007/manifest.json"):
        mirror_version(url, TOKEN, 7, tmp_path / "mirror", timeout_s=0.6)
    assert [p.name for p in (tmp_path / "mirror").iterdir()] == []  # no partial mirror left


def test_the_server_serves_only_committed_version_files(tmp_path):
    root = tmp_path
    (root / "v00000001").mkdir()
    (root / "v00000001" / "manifest.json").write_text("{}")
    assert serve_path(root, "v00000001", "manifest.json") is None  # no COMPLETE yet
    (root / "v00000001" / "COMPLETE").write_text("")
    assert serve_path(root, "v00000001", "manifest.json") == root / "v00000001" / "manifest.json"
    (root / "secret.txt").write_text("x")
    for version, name in (("v00000001", "../secret.txt"), ("..", "secret.txt"), ("v00000001", "other.bin"),
                          (".tmp-v00000001", "manifest.json")):
        assert serve_path(root, version, name) is None, (version, name)


def test_a_file_shorter_than_its_manifest_says_is_named(server, tmp_path):
    url, root = server
    sync, _ = published(root)
    bucket = next(version_dir(root, 1).glob("bucket-*.safetensors"))
    bucket.write_bytes(bucket.read_bytes()[:-8])
    with pytest.raises(TransportError, match=f"{bucket.name} has .* bytes, the manifest says"):
        mirror_version(url, TOKEN, 1, tmp_path / "mirror", timeout_s=5)
    sync.shutdown()


def test_older_mirrors_are_pruned_to_the_newest_two(server, tmp_path):
    url, root = server
    sync, _ = published(root, versions=(1, 2, 3))
    for v in (1, 2, 3):
        mirror_version(url, TOKEN, v, tmp_path / "mirror", timeout_s=5)
    assert sorted(p.name for p in (tmp_path / "mirror").iterdir()) == ["v00000002", "v00000003"]
    sync.shutdown()

