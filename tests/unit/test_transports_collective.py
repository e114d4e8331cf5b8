"""The collective transport's rendezvous is reachable only on the configured host (issue 11,
security): torch's `TCPStore` server would listen on every interface, so the trainer binds the
socket itself and hands it to the store; gloo's sockets follow the same loopback host."""

from __future__ import annotations

import threading

import pytest
import torch

from transports.collective import CollectiveReceiver, CollectiveSender, is_loopback
from transports.refit.plan import RefitPlan
from transports.staging import StagingArea


def listening_addresses(port: int) -> set[str]:
    """Local addresses in LISTEN state on `port`, from /proc/net/tcp{,6} (hex as the kernel writes it)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


LOOPBACK_V4 = "0100007F"  # 127.0.0.1, little-endian hex


def test_the_store_listens_on_loopback_only():
    sender = CollectiveSender(engine_workers=1, host="127.0.0.1", port=0, timeout_s=5)
    try:
        assert listening_addresses(sender.port) == {LOOPBACK_V4}
    finally:
        sender.close()


def test_torch_alone_would_listen_everywhere():
    """Why the socket is bound by hand: the plain store ignores `host_name` for listening."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=5),
                          wait_for_workers=False)
    addresses = listening_addresses(store.port)
    del store
    if addresses == {LOOPBACK_V4}:
        pytest.skip("this torch build binds the store to host_name already")
    assert addresses - {LOOPBACK_V4}


def test_a_version_moves_over_the_loopback_bound_group():
    state = {f"w{i}": torch.randn(32, 32) for i in range(3)}
    plan = RefitPlan.build({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, wire_dtype=None,
                           bucket_bytes=8 << 10)
    sender = CollectiveSender(engine_workers=1, host="127.0.0.1", port=0, timeout_s=10)
    receivers = []
    joiner = threading.Thread(target=lambda: receivers.append(CollectiveReceiver(
        host="127.0.0.1", port=sender.port, world_size=2, rank=1, arena_bytes=plan.arena_bytes, timeout_s=10)))
    joiner.start()
    sender.connect()
    joiner.join(20)
    staging = StagingArea(plan)
    staging.begin(1, 1)
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, receivers[0].receive, 1, staging))
    thread.start()
    sender.begin(1, plan.bucket_count)
    for header, payload in plan.pack(state, version=1, attempt=1, prefetch=False):
        sender.send(header, payload)
    sender.commit(1)
    thread.join(20)
    assert not errors, errors
    got = staging.finish()
    assert all(torch.equal(got[k], state[k]) for k in state)
    sender.close()


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as exc:
        errors.append(exc)


def test_loopback_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.2") and not is_loopback("0.0.0.0") and not is_loopback("trainer-0")
