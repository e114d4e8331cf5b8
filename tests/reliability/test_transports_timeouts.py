"""A peer that never joins, or stalls mid-transfer, is a `TransportTimeoutError`, never a hang.
(No wall-clock assertions: pytest-timeout guards against hangs.)"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from tests.helpers import free_port
from transports.base import TransportTimeoutError
from transports.refit.plan import RefitPlan
from transports.staging import StagingArea

TIMEOUT = 1.5


@pytest.fixture()
def plan_and_state():
    state = {f"w{i}": torch.randn(64, 64) for i in range(4)}
    plan = RefitPlan.build({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, wire_dtype=None,
                           bucket_bytes=20 << 10)
    assert plan.bucket_count >= 2
    return plan, state


def staging_for(plan, version=1):
    staging = StagingArea(plan)
    staging.begin(version)
    return staging


def test_collective_trainer_times_out_when_no_engine_joins():
    from transports.collective import CollectiveSender

    sender = CollectiveSender(engine_workers=1, timeout_s=TIMEOUT)
    with pytest.raises(TransportTimeoutError, match="forming the weight group"):
        sender.connect()


def test_collective_engine_times_out_when_the_trainer_stalls_mid_transfer(plan_and_state):
    from transports.collective import CollectiveReceiver, CollectiveSender

    plan, state = plan_and_state
    sender = CollectiveSender(engine_workers=1, timeout_s=TIMEOUT)
    receivers = []
    joiner = threading.Thread(target=lambda: receivers.append(CollectiveReceiver(
        host="127.0.0.1", port=sender.port, world_size=2, rank=1, arena_bytes=plan.arena_bytes, timeout_s=TIMEOUT)))
    joiner.start()
    sender.connect()
    joiner.join()
    errors = []

    def receive():
        try:
            receivers[0].receive(1, staging_for(plan))
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    header, payload = next(iter(plan.pack(state, version=1, prefetch=False)))
    sender.send(header, payload)  # bucket 0 of several, then the trainer stalls
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], TransportTimeoutError)
    assert "bucket 1 of version 1" in str(errors[0])


def test_collective_engine_times_out_when_no_trainer_hosts_the_store():
    from transports.collective import CollectiveReceiver

    port = free_port()
    with pytest.raises(TransportTimeoutError):
        CollectiveReceiver(host="127.0.0.1", port=port, world_size=2, rank=1, arena_bytes=64, timeout_s=TIMEOUT)


def test_ipc_trainer_times_out_when_no_engine_connects():
    from transports.ipc import IpcSender

    sender = IpcSender(arena_bytes=1024, engines=1, timeout_s=TIMEOUT)
    try:
        with pytest.raises(TransportTimeoutError, match="an engine to connect"):
            sender.connect()
    finally:
        sender.close()


def test_ipc_trainer_times_out_when_the_engine_stalls(plan_and_state):
    from transports.ipc import IpcReceiver, IpcSender

    plan, state = plan_and_state
    sender = IpcSender(arena_bytes=plan.arena_bytes, engines=1, timeout_s=TIMEOUT)
    info = sender.engine_init_info(0)
    stalled = IpcReceiver(endpoint=info["endpoint"], segments=info["segments"], timeout_s=TIMEOUT)  # never receives
    try:
        sender.connect()
        sender.begin(1, plan.bucket_count)
        header, payload = next(iter(plan.pack(state, version=1, prefetch=False, arenas=sender.arenas())))
        with pytest.raises(TransportTimeoutError, match="apply bucket 0"):
            # send() returns while bucket 0 is still being applied (bucket 1 is packed
            # meanwhile); the wait for it, bounded, comes with the next send or commit().
            sender.send(header, payload)
            sender.commit(1)
    finally:
        stalled.close()
        sender.close()


def test_ipc_engine_times_out_when_the_trainer_never_sends(plan_and_state):
    from transports.ipc import IpcReceiver, IpcSender

    plan, _ = plan_and_state
    sender = IpcSender(arena_bytes=plan.arena_bytes, engines=1, timeout_s=TIMEOUT)
    info = sender.engine_init_info(0)
    receiver = IpcReceiver(endpoint=info["endpoint"], segments=info["segments"], timeout_s=TIMEOUT)
    try:
        with pytest.raises(TransportTimeoutError, match="bucket 0 of version 1"):
            receiver.receive(1, staging_for(plan))
    finally:
        receiver.close()
        sender.close()


def test_http_trainer_times_out_on_an_engine_that_never_answers(plan_and_state):
    from transports.http import HttpSender

    plan, state = plan_and_state
    silent = socket.socket()  # accepts connections (backlog) but never reads or answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    sender = HttpSender(endpoints=[("127.0.0.1", silent.getsockname()[1])], timeout_s=TIMEOUT)
    try:
        header, payload = next(iter(plan.pack(state, version=1, prefetch=False)))
        with pytest.raises(TransportTimeoutError):
            # The answer to a bucket is read after the next bucket was written, or by commit().
            sender.send(header, payload)
            sender.commit(1)
    finally:
        sender.close()
        silent.close()


def test_http_engine_times_out_when_buckets_stop_coming(plan_and_state):
    from transports.http import HttpReceiver, HttpSender

    plan, state = plan_and_state
    receiver = HttpReceiver(host="127.0.0.1", port=0, arena_bytes=plan.arena_bytes, timeout_s=TIMEOUT)
    sender = HttpSender(endpoints=[("127.0.0.1", receiver.port)], timeout_s=10, token=receiver.token)
    try:
        header, payload = next(iter(plan.pack(state, version=1, prefetch=False)))
        sender.send(header, payload)  # one bucket of several, then nothing
        with pytest.raises(TransportTimeoutError, match="bucket 1 of version 1"):
            receiver.receive(1, staging_for(plan))
    finally:
        sender.close()
        receiver.close()


def test_filesystem_engine_times_out_on_a_version_never_published(plan_and_state, tmp_path):
    from transports.filesystem import FilesystemReceiver

    plan, _ = plan_and_state
    receiver = FilesystemReceiver(tmp_path, arena_bytes=plan.arena_bytes, timeout_s=TIMEOUT)
    with pytest.raises(TransportTimeoutError, match="version 7"):
        receiver.receive(7, staging_for(plan, 7))
