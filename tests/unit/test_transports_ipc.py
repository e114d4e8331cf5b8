"""The IPC transport never runs code a ZMQ peer sends: a CUDA IPC handle is loaded with a
restricted unpickler that resolves only `rebuild_cuda_tensor` and the plain types of its
arguments (issue 11, security)."""

from __future__ import annotations

import os
import pickle
import uuid

import pytest
import torch

from transports.errors import TransportError
from transports.ipc import IpcReceiver, UnsafeHandleError, load_cuda_handle


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
