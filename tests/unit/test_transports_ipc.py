"""The IPC transport never runs code a ZMQ peer sends: a CUDA IPC handle is loaded with a
restricted unpickler that resolves only `rebuild_cuda_tensor` and the plain types of its
arguments (issue 11, security). And a restarted engine whose hello reaches the trainer after a
version began is sent that version from bucket 0, or the version fails at once by name (not at
the timeout)."""

from __future__ import annotations

import os
import pickle
import threading
import uuid

import pytest
import torch

from transports.errors import TransportError
from transports.ipc import IpcReceiver, IpcSender, UnsafeHandleError, load_cuda_handle
from transports.wire import BucketHeader, decode_header


class Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def cuda_shaped_handle() -> bytes:
    """What `reduce_tensor` pickles for a CUDA tensor, built on a CPU (same types and arity)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    t = torch.empty(4, dtype=torch.uint8)
    return pickle.dumps((rebuild_cuda_tensor, (type(t), t.size(), t.stride(), 0, type(t._typed_storage()), t.dtype,
                                               0, b"handle", 4, 0, False, b"refcount", 0, b"event", True)))


def test_a_real_handle_shape_is_accepted():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    func, args = load_cuda_handle(cuda_shaped_handle())
    assert func is rebuild_cuda_tensor and args[0] is torch.Tensor and args[1] == torch.Size([4])
    assert args[5] is torch.uint8


@pytest.mark.parametrize("payload", [
    lambda m: pickle.dumps(Evil(m)),                                  # os.system at load time
    lambda m: pickle.dumps((os.system, (f"touch {m}",))),             # os.system handed back to be called
    lambda m: pickle.dumps((eval, ("1",))),
    lambda m: pickle.dumps((torch.Size, ((1, 2),))),                  # allowed types, wrong function
    lambda m: pickle.dumps("not a handle"),
    lambda m: b"\x80\x05garbage",
])
def test_anything_else_is_refused_by_name_before_it_runs(payload, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(UnsafeHandleError, match="CUDA IPC handle refused") as info:
        load_cuda_handle(payload(str(marker)))
    assert isinstance(info.value, TransportError)
    assert not marker.exists()


def test_the_refusal_names_what_the_handle_asked_for(tmp_path):
    with pytest.raises(UnsafeHandleError, match=r"posix\.system|os\.system"):
        load_cuda_handle(pickle.dumps(Evil(str(tmp_path / "ran"))))


def test_the_receiver_refuses_an_evil_handle_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    receiver = IpcReceiver(endpoint=f"ipc://{tmp_path}/nobody-{uuid.uuid4().hex[:6]}", timeout_s=1)
    try:
        with pytest.raises(UnsafeHandleError):
            receiver._payload(0, 4, pickle.dumps(Evil(str(marker))))
        assert not marker.exists()
    finally:
        receiver.close()


class Engine:
    """One engine's receiving socket, raw: says hello with its index, then acknowledges every
    bucket announced to it, on a thread of its own; `received` is the bucket indices in order."""

    def __init__(self, endpoint: str, index: int, withhold: int | None = None) -> None:
        import zmq

        self.withhold, self.release = withhold, threading.Event()  # bucket `withhold`: acked once released

        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send_multipart([b"hello", str(index).encode()])
        self.received: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._ack, daemon=True)
        self.thread.start()

    def _ack(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(20):
                _, _slot, raw, _length, _handle = self.sock.recv_multipart()
                header = decode_header(raw)
                self.received.append(header.index)
                if header.index == self.withhold:
                    self.release.wait(10)
                self.sock.send_multipart([b"ack", str(header.index).encode(), str(header.attempt).encode()])

    def die(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)


def announce(sender: IpcSender, index: int, count: int) -> None:
    header = BucketHeader(version=1, index=index, count=count, nbytes=8, tensors=(), attempt=1)
    sender.send(header, sender.arenas()[index % 2][:8])


@pytest.fixture
def sender():
    sender = IpcSender(arena_bytes=64, engines=2, timeout_s=10)
    yield sender
    sender.close()


def test_an_engine_restarted_before_its_first_ack_is_sent_the_version_from_bucket_0(sender):
    engines = [Engine(sender.endpoint, 0), Engine(sender.endpoint, 1)]
    sender.connect()
    sender.begin(1, 2)
    engines[1].die()  # engine 1 is gone before it read bucket 0 ...
    announce(sender, 0, 2)
    restarted = Engine(sender.endpoint, 1)  # ... and back: its hello reaches the trainer after the version began
    announce(sender, 1, 2)  # waits on bucket 0: engine 0's ack, the restarted engine's hello
    sender.commit(1)  # before: "waiting for engines to apply bucket 0", at the timeout
    assert restarted.received == [0, 1] and engines[0].received == [0, 1]
    for engine in (engines[0], restarted):
        engine.die()


def test_an_engine_restarted_past_bucket_0_fails_the_version_at_once_naming_it(sender):
    engines = [Engine(sender.endpoint, 0), Engine(sender.endpoint, 1)]
    sender.connect()
    sender.begin(1, 3)
    announce(sender, 0, 3)
    announce(sender, 1, 3)  # bucket 0 acknowledged by both
    engines[1].die()
    restarted = Engine(sender.endpoint, 1)  # bucket 0's arena is being refilled: it cannot be sent again
    with pytest.raises(TransportError, match="engine 1 restarted while version buckets were sent") as info:
        announce(sender, 2, 3)
        sender.commit(1)
    assert not isinstance(info.value, TimeoutError)
    assert restarted.received == []
    for engine in (engines[0], restarted):
        engine.die()


def test_an_engine_restarted_after_acknowledging_every_bucket_leaves_the_version_to_commit(sender):
    """Its hello read while the trainer waits on another engine's last acknowledgement: the version
    commits as it did before a hello mid-version was acted on; the new socket takes part from the next."""
    import time

    engines = [Engine(sender.endpoint, 0, withhold=2), Engine(sender.endpoint, 1)]
    sender.connect()
    sender.begin(1, 3)
    for index in range(3):
        announce(sender, index, 3)
    old = sender._peer_of[1]
    errors: list[BaseException] = []
    commit = threading.Thread(target=lambda: _catching(lambda: sender.commit(1), errors))
    commit.start()
    deadline = time.monotonic() + 10
    while sender._acked.get(old) != 2:  # engine 1's acknowledgement of the last bucket, counted
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engines[1].die()
    restarted = Engine(sender.endpoint, 1)
    while sender._peer_of[1] == old:  # its hello, read by the waiting commit
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engines[0].release.set()
    commit.join(10)
    assert not commit.is_alive() and not errors, errors
    assert restarted.received == []
    for engine in (engines[0], restarted):
        engine.die()


def _catching(call, errors: list) -> None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - asserted by the caller
        errors.append(exc)
