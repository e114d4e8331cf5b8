"""A push receiver that is receiving version v (attempt left open, as the swap stager does) and
sees the trainer move on (a retried attempt of v, or the next version) must not swallow those
buckets as "left over": before, http answered them 200 and ipc acknowledged them, so the
trainer's retry reported success while the engine dropped every bucket of it and its next
stage waited for buckets that had already come and gone. Now the receive of the abandoned
attempt fails at once, and the bucket is kept for the next receive, which stages the retry."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from transports.errors import TransportError, TransportTimeoutError
from transports.refit.plan import RefitPlan
from transports.staging import StagingArea

pytestmark = pytest.mark.timeout(60)


def state_and_plan():
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}.weight": torch.randn(8, 8, generator=g) for i in range(3)}  # Model below
    plan = RefitPlan.build({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, wire_dtype=None,
                           bucket_bytes=256)
    assert plan.bucket_count == 3
    return state, plan


def receive_in_thread(receiver, staging, version):
    out: dict = {}

    def run():
        started = time.monotonic()
        try:
            receiver.receive(version, staging)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            out["error"] = exc
        out["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _http():
    from transports.http import HttpReceiver, HttpSender

    state, plan = state_and_plan()
    receiver = HttpReceiver(host="127.0.0.1", port=0, arena_bytes=plan.arena_bytes, timeout_s=3)
    sender = HttpSender(endpoints=[("127.0.0.1", receiver.port)], timeout_s=5, token=receiver.token)
    return state, plan, receiver, sender, sender.arenas()


def _ipc():
    from transports.ipc import IpcReceiver, IpcSender

    state, plan = state_and_plan()
    sender = IpcSender(arena_bytes=plan.arena_bytes, engines=1, timeout_s=5)
    receiver = IpcReceiver(endpoint=sender.endpoint, segments=sender.engine_init_info(0)["segments"], timeout_s=3)
    sender.connect()
    return state, plan, receiver, sender, sender.arenas()


@pytest.mark.parametrize("make", [_http, _ipc], ids=["http", "ipc"])
def test_a_retried_attempt_ends_the_abandoned_one_and_is_staged_next(make):
    state, plan, receiver, sender, arenas = make()
    try:
        staging = StagingArea(plan)
        staging.begin(5, None)  # the swap stager: whichever attempt of version 5 comes first
        thread, out = receive_in_thread(receiver, staging, 5)

        # Attempt 1: the trainer sends bucket 0, then fails (another engine refused a bucket).
        sender.begin(5, plan.bucket_count)
        first = plan.pack(state, version=5, attempt=1, arenas=arenas, hold=1, prefetch=False)
        header, payload = next(first)
        sender.send(header, payload)
        wait_for(lambda: 0 in staging._buckets)  # accepted under attempt 1
        first.close()

        # Attempt 2 of the same version, complete: the trainer's retry.
        sender.begin(5, plan.bucket_count)
        retry_errors: list[BaseException] = []

        def retry():
            try:
                for header, payload in plan.pack(state, version=5, attempt=2, arenas=arenas, hold=1, prefetch=False):
                    sender.send(header, payload)
                sender.commit(5)
            except BaseException as exc:  # noqa: BLE001 - checked below
                retry_errors.append(exc)

        trainer = threading.Thread(target=retry, daemon=True)
        trainer.start()
        thread.join(20)
        assert not thread.is_alive()
        error = out.get("error")
        # The abandoned attempt fails at once, naming the newer attempt, not by a timeout.
        assert isinstance(error, TransportError) and not isinstance(error, TransportTimeoutError), error
        assert "attempt 2" in str(error)

        # The next stage of version 5 gets the whole retry, none of it lost.
        staging = StagingArea(plan)
        staging.begin(5, None)
        thread, out = receive_in_thread(receiver, staging, 5)
        thread.join(20)
        trainer.join(20)
        assert not out.get("error"), out
        assert not retry_errors, retry_errors
        assert staging.attempt == 2
        got = staging.finish()
        assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())
    finally:
        sender.close()
        receiver.close()


def test_a_failed_http_version_keeps_the_next_versions_queued_buckets():
    """`_drop_queued` after a failed version frees only its own (or older) buckets."""
    from transports.wire import BucketHeader

    _, plan, receiver, sender, _ = _http()
    try:
        staging = StagingArea(plan)
        staging.begin(5, 1)
        old = BucketHeader(5, 1, plan.bucket_count, 0, (), True, None, 1)
        new = BucketHeader(6, 0, plan.bucket_count, 0, (), True, None, 2)
        assert receiver._free[0].acquire(timeout=1) and receiver._free[1].acquire(timeout=1)
        receiver._arrived.put((0, old, memoryview(b""), {}))
        receiver._arrived.put((1, new, memoryview(b""), {}))
        receiver._drop_queued(staging)
        assert receiver._free[0].acquire(timeout=0.1)  # version 5's arena freed
        assert not receiver._free[1].acquire(timeout=0.1)  # version 6's kept, with its bucket
        assert [item[1].version for item in receiver._held] == [6]
    finally:
        sender.close()
        receiver.close()


def test_is_newer():
    from transports.wire import BucketHeader

    _, plan = state_and_plan()
    staging = StagingArea(plan)

    def header(version, attempt):
        return BucketHeader(version, 0, plan.bucket_count, 0, (), True, None, attempt)

    staging.begin(5, None)
    assert not staging.is_newer(header(5, 1)) and not staging.is_newer(header(4, 9))
    assert staging.is_newer(header(6, 0))
    assert staging.is_current(header(5, 2))  # fixes attempt 2
    assert staging.is_newer(header(5, 3)) and not staging.is_newer(header(5, 1))


def test_a_collective_trainer_that_restarts_mid_version_is_refused_as_out_of_step():
    """Before, the receiver took the retry's bucket 0 as bucket 2 and its receive returned as
    if complete: only the staging area's completeness check then failed the version, with a
    `MissingTensorError` (a refused bucket), so the swap link was kept as if the group were in
    step while the trainer still had two broadcasts of attempt 2 to make."""
    from transports.collective import CollectiveReceiver, CollectiveSender
    from transports.errors import RefitMismatchError

    state, plan = state_and_plan()
    sender = CollectiveSender(engine_workers=1, host="127.0.0.1", port=0, timeout_s=3, arena_bytes=plan.arena_bytes)
    receivers = []
    joiner = threading.Thread(target=lambda: receivers.append(CollectiveReceiver(
        host="127.0.0.1", port=sender.port, world_size=2, rank=1, arena_bytes=plan.arena_bytes, timeout_s=3)))
    joiner.start()
    sender.connect()
    joiner.join(30)
    try:
        staging = StagingArea(plan)
        staging.begin(5, None)
        thread, out = receive_in_thread(receivers[0], staging, 5)
        trainer_errors: list[BaseException] = []

        def trainer():
            try:
                sender.begin(5, plan.bucket_count)
                buckets = plan.pack(state, version=5, attempt=1, arenas=sender.arenas(), hold=1, prefetch=False)
                for _ in range(2):  # then a failure of the trainer's own
                    sender.send(*next(buckets))
                buckets.close()
                sender.begin(5, plan.bucket_count)
                for header, payload in plan.pack(state, version=5, attempt=2, arenas=sender.arenas(), hold=1,
                                                 prefetch=False):
                    sender.send(header, payload)
                sender.commit(5)
            except BaseException as exc:  # noqa: BLE001 - the receiver stopped: expected
                trainer_errors.append(exc)

        sending = threading.Thread(target=trainer, daemon=True)
        sending.start()
        thread.join(20)
        sending.join(20)
        error = out.get("error")
        assert isinstance(error, TransportError) and not isinstance(error, RefitMismatchError), error
        assert "out of step" in str(error) and "attempt 2" in str(error)
    finally:
        sender.close()


def test_an_http_connection_idle_between_versions_longer_than_the_timeout_still_carries_the_next():
    """The receiver bounds each body read by its timeout; that bound must not stay on the
    kept-alive connection while it waits for the next version's first request (a trainer step
    longer than `timeout_s` made the handler drop the connection, and the trainer's next
    `sync_weights` fail on it)."""
    from transports.http import HttpReceiver, HttpSender

    state, plan = state_and_plan()
    receiver = HttpReceiver(host="127.0.0.1", port=0, arena_bytes=plan.arena_bytes, timeout_s=0.5)
    sender = HttpSender(endpoints=[("127.0.0.1", receiver.port)], timeout_s=0.5, token=receiver.token)
    try:
        for version in (1, 2):
            staging = StagingArea(plan)
            staging.begin(version, None)
            thread, out = receive_in_thread(receiver, staging, version)
            sender.begin(version, plan.bucket_count)
            for header, payload in plan.pack(state, version=version, attempt=version, arenas=sender.arenas(),
                                             hold=1, prefetch=False):
                sender.send(header, payload)
            sender.commit(version)
            thread.join(10)
            assert not out.get("error"), out
            assert set(staging.finish()) == set(state)
            time.sleep(1.0)  # the trainer's next step: longer than the timeout
    finally:
        sender.close()
        receiver.close()


def test_a_leftover_bucket_of_an_abandoned_attempt_does_not_fix_the_open_attempt():
    """An ipc trainer announces bucket k+1 before it reads an engine's error on bucket k; that
    announcement is still queued when the next stage of the version opens. Taking its attempt
    made the next stage refuse the trainer's whole retry."""
    state, plan = state_and_plan()
    stale = list(plan.pack(state, version=5, attempt=1, prefetch=False))
    retry = [(h, bytes(p)) for h, p in plan.pack(state, version=5, attempt=2, prefetch=False)]
    staging = StagingArea(plan)
    staging.begin(5, None)
    assert not staging.is_current(stale[1][0])  # a leftover mid-version bucket
    assert staging.attempt is None
    for header, payload in retry:
        assert staging.is_current(header)
        staging.accept(header, memoryview(payload))
    assert staging.attempt == 2
    got = staging.finish()
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_closed_http_receiver_ends_its_kept_alive_connections():
    """`close()` (swap_init with new options) stopped accepting connections but left the handler
    of the trainer's kept-alive connection running: the trainer's next buckets were answered
    "queued" into a receiver nobody reads. Now the connection ends, so the trainer's send fails
    and its next attempt connects afresh."""
    from transports.http import HttpReceiver, HttpSender

    state, plan = state_and_plan()
    receiver = HttpReceiver(host="127.0.0.1", port=0, arena_bytes=plan.arena_bytes, timeout_s=3)
    sender = HttpSender(endpoints=[("127.0.0.1", receiver.port)], timeout_s=3, token=receiver.token)
    try:
        staging = StagingArea(plan)
        staging.begin(1, None)
        thread, out = receive_in_thread(receiver, staging, 1)
        sender.begin(1, plan.bucket_count)
        for header, payload in plan.pack(state, version=1, attempt=1, arenas=sender.arenas(), hold=1, prefetch=False):
            sender.send(header, payload)
        sender.commit(1)
        thread.join(10)
        assert not out.get("error"), out
        receiver.close()
        time.sleep(0.2)
        sender.begin(2, plan.bucket_count)
        header, payload = next(iter(plan.pack(state, version=2, attempt=2, arenas=sender.arenas(), prefetch=False)))
        with pytest.raises(TransportError):
            sender.send(header, payload)
            sender.commit(2)
    finally:
        sender.close()
        receiver.close()


def test_a_timed_out_http_receive_keeps_the_first_bucket_of_its_version_that_comes_after():
    from transports.wire import BucketHeader

    _, plan, receiver, sender, _ = _http()
    try:
        staging = StagingArea(plan)
        staging.begin(5, None)  # nothing of version 5 arrived: the receive timed out
        first = BucketHeader(5, 0, plan.bucket_count, 0, (), True, None, 1)
        assert receiver._free[0].acquire(timeout=1)
        receiver._arrived.put((0, first, memoryview(b""), {}))
        receiver._drop_queued(staging)
        assert [item[1].index for item in receiver._held] == [0]
        assert not receiver._free[0].acquire(timeout=0.1)  # still holding its bucket
    finally:
        sender.close()
        receiver.close()


def test_a_failed_http_send_leaves_no_unread_answer_on_a_kept_connection():
    """Bucket 0 went out to engine A, then engine B failed: A's answer to it stayed unread on
    the kept-alive connection (nothing counted it), so every later answer on it was taken for
    the bucket before, and the last one of the next version stayed unread: an engine's refusal
    of that version's last bucket would have gone unseen by the trainer."""
    import socket as socket_module

    from transports.http import HttpReceiver, HttpSender

    state, plan = state_and_plan()
    good = HttpReceiver(host="127.0.0.1", port=0, arena_bytes=plan.arena_bytes, timeout_s=3)
    probe = socket_module.socket()
    probe.bind(("127.0.0.1", 0))
    dead = probe.getsockname()[1]
    probe.close()  # nothing listens there
    sender = HttpSender(endpoints=[("127.0.0.1", good.port), ("127.0.0.1", dead)], timeout_s=3, token=good.token)
    try:
        sender.begin(1, plan.bucket_count)
        header, payload = next(iter(plan.pack(state, version=1, attempt=1, arenas=sender.arenas(), prefetch=False)))
        with pytest.raises(TransportError):
            sender.send(header, payload)  # written to the good engine, refused by the dead one
        sender.endpoints = [("127.0.0.1", good.port)]  # the trainer goes on with the engine it has

        staging = StagingArea(plan)
        staging.begin(2, None)
        thread, out = receive_in_thread(good, staging, 2)
        sender.begin(2, plan.bucket_count)
        for header, payload in plan.pack(state, version=2, attempt=2, arenas=sender.arenas(), hold=1, prefetch=False):
            sender.send(header, payload)
        sender.commit(2)
        thread.join(10)
        assert not out.get("error"), out
        time.sleep(0.2)
        for conn in sender._connections.values():  # every answer sent was read
            conn.sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                conn.sock.recv(1, socket_module.MSG_PEEK)
            assert not conn._buffer
    finally:
        sender.close()
        good.close()


def test_a_swap_init_during_a_stage_fails_the_stage_instead_of_labelling_old_weights(tmp_path, monkeypatch):
    """A double-buffer stage loads bucket by bucket into the shadow and keeps nothing else; a
    `swap_init` switching to pause_swap meanwhile made the stage report "staged" with nothing
    staged, and `swap_apply` then labelled the unchanged live weights with the new version."""
    import json
    from types import SimpleNamespace

    import transports.swap as swap_module
    from transports.filesystem import FilesystemSender

    gate, inside = threading.Event(), threading.Event()

    class Loader:  # stands in for vLLM's layerwise reload (BucketwiseReload)
        def __init__(self, model, model_config, cancel=None):
            self.params = dict(model.named_parameters())

        def load(self, tensors):
            inside.set()
            gate.wait(10)
            for name, tensor in tensors.items():
                self.params[name].data.copy_(tensor)

        def finish(self):
            pass

        def abort(self):
            pass

    monkeypatch.setattr(swap_module, "BucketwiseReload", Loader)
    monkeypatch.setattr(swap_module, "share_reload_metadata", lambda live, shadow: None)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer0 = torch.nn.Linear(8, 8, bias=False)
            self.layer1 = torch.nn.Linear(8, 8, bias=False)
            self.layer2 = torch.nn.Linear(8, 8, bias=False)

        def load_weights(self, weights):  # the live model has one, so the bucketwise path runs
            raise AssertionError("not called: the loader above is")

    state, plan = state_and_plan()
    sender = FilesystemSender(tmp_path, keep_last=5, fsync=False)
    sender.begin(1, plan.bucket_count)
    for header, payload in plan.pack(state, version=1, attempt=1, prefetch=False):
        sender.send(header, payload)
    sender.commit(1)

    model = Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ext = swap_module.SwapWorkerExtension()
    ext.model_runner = SimpleNamespace(get_model=lambda: model, model_config=SimpleNamespace(dtype=torch.float32),
                                       requests={})
    cfg = {"plan": plan.encode().decode(), "root": str(tmp_path), "strategy": "double_buffer", "timeout_s": 5}
    ext.swap_init(json.dumps(cfg))
    ext.swap_stage(json.dumps({"version": 1}))
    assert inside.wait(10)  # loading bucket 0 into the shadow
    ext.swap_init(json.dumps({**cfg, "strategy": "pause_swap"}))
    gate.set()
    deadline = time.monotonic() + 10
    while (status := ext.swap_status())["state"] not in ("staged", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert status["state"] == "failed" and "swap_init changed" in status["error"], status
    with pytest.raises(RuntimeError, match="nothing staged"):
        ext.swap_apply()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    sender.close()
