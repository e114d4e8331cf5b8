"""Sending from the trainer's own tensors (issue 10, speed): with a sender's `DirectArenas`
the refit plan copies only what needs a copy, and the payload (`BucketPayload`) carries the
same bytes and checksums as a packed one. The http receiver checksums while it reads; the
collective transport broadcasts large tensors one by one, straight into staging. The GPU
paths refuse clearly where there is no CUDA device (their own tests, `test_gpu_*`, need one)."""

from __future__ import annotations

import threading

import pytest
import torch

from transports.base import ChecksumError, TransportUnavailableError
from transports.collective import (
    DIRECT_MIN_BYTES,
    CollectiveReceiver,
    CollectiveSender,
    bucket_segments,
)
from transports.http import HttpReceiver, HttpSender
from transports.refit.plan import BucketPayload, DirectArenas, RefitPlan, Transpose
from transports.staging import StagingArea
from transports.wire import TensorMeta, checksum


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "big.weight": torch.randn(512, 300, generator=g),  # 600 KiB fp32: sent in place
        "small.bias": torch.randn(33, generator=g),
        "bf.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "other.weight": torch.randn(300, 512, generator=g),
    }


def meta_of(state):
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def test_direct_payloads_carry_the_packed_bytes_and_point_at_the_trainer_tensors():
    state = mixed_state()
    plan = RefitPlan.build(meta_of(state), wire_dtype=None, bucket_bytes=1 << 20)
    packed = list(plan.pack(state, version=3, prefetch=False))
    arenas = DirectArenas()
    direct = list(plan.pack(state, version=3, prefetch=False, arenas=arenas))
    assert len(arenas) == 2 and all(a.numel() == plan.arena_bytes for a in arenas)
    for (h1, p1), (h2, p2) in zip(packed, direct, strict=True):
        assert isinstance(p2, BucketPayload) and len(p2) == len(p1)
        assert h1 == h2  # same layout, same checksums
        # Every tensor's bytes agree; the alignment gaps between tensors are never written
        # (uninitialized arena memory), so they are not compared.
        b1, b2 = bytes(p1), bytes(p2)
        for m in h1.tensors:
            assert b2[m.offset:m.offset + m.nbytes] == b1[m.offset:m.offset + m.nbytes], m.name
        for name, flat in p2.direct.items():
            assert flat.data_ptr() == state[name].data_ptr()  # no copy was made
    assert any(p.direct for _, p in direct)


def test_a_view_that_needs_a_copy_is_packed_and_small_tensors_stay_packed_above_min_bytes():
    state = {"w": torch.randn(64, 32), "v": torch.randn(16, 16)}
    from transports.refit.maps import IdentityMap

    class TransposeW(IdentityMap):
        def refit(self, meta):
            return [(n, n, (Transpose(0, 1),) if n == "w" else ()) for n in meta]

    plan = RefitPlan.build(meta_of(state), TransposeW(), wire_dtype=None, bucket_bytes=1 << 20)
    (header, payload), = plan.pack(state, version=1, prefetch=False, arenas=DirectArenas())
    assert set(payload.direct) == {"v"}  # w's transpose is not contiguous: packed
    (_, payload2), = plan.pack(state, version=1, prefetch=False, arenas=DirectArenas(min_bytes=1 << 20))
    assert payload2.direct == {}
    arena = payload.arena
    w = next(m for m in header.tensors if m.name == "w")
    assert torch.equal(arena[w.offset:w.offset + w.nbytes].view(torch.float32).view(32, 64), state["w"].t())
    assert w.checksum == checksum(bytes(payload)[w.offset:w.offset + w.nbytes])


def test_a_truncated_direct_payload_keeps_its_prefix():
    state = mixed_state()
    plan = RefitPlan.build(meta_of(state), wire_dtype=None, bucket_bytes=8 << 20)
    (_, payload), = plan.pack(state, version=1, prefetch=False, arenas=DirectArenas())
    cut = payload[:1000]
    assert len(cut) == 1000 and bytes(cut) == bytes(payload)[:1000]
    assert sum(t.numel() for t in cut.segments()) == 1000


def test_bucket_segments_put_large_tensors_alone_and_merge_small_neighbours():
    big = DIRECT_MIN_BYTES
    metas = [TensorMeta("a", (1,), "uint8", 0, 10), TensorMeta("b", (1,), "uint8", 64, 10),
             TensorMeta("c", (1,), "uint8", 128, big), TensorMeta("d", (1,), "uint8", 128 + big, 5)]
    assert bucket_segments(metas) == [(0, 74, None), (128, 128 + big, "c"), (128 + big, 133 + big, None)]
    assert bucket_segments(list(reversed(metas))) == bucket_segments(metas)  # offset order, whatever the header's


def _http_rig(plan):
    receiver = HttpReceiver(host="127.0.0.1", port=0, arena_bytes=plan.arena_bytes, timeout_s=10)
    sender = HttpSender(endpoints=[("127.0.0.1", receiver.port)], timeout_s=10, token=receiver.token)
    return receiver, sender


def _receive_in_thread(receiver, staging, version):
    errors: list[BaseException] = []

    def run():
        try:
            receiver.receive(version, staging)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def test_http_moves_direct_payloads_into_the_destination_tensors():
    state = mixed_state()
    plan = RefitPlan.build(meta_of(state), wire_dtype=None, bucket_bytes=1 << 20)
    destination = {k: torch.zeros_like(v) for k, v in state.items()}
    receiver, sender = _http_rig(plan)
    try:
        staging = StagingArea(plan, destination=destination)
        staging.begin(1, 1)
        thread, errors = _receive_in_thread(receiver, staging, 1)
        sender.begin(1, plan.bucket_count)
        for header, payload in plan.pack(state, version=1, attempt=1, arenas=sender.arenas(), hold=1):
            sender.send(header, payload)
        sender.commit(1)
        thread.join(30)
        assert not errors, errors
        got = staging.finish()
        for name, tensor in state.items():
            assert torch.equal(got[name], tensor), name
            assert got[name].data_ptr() == destination[name].data_ptr()  # landed in place
    finally:
        sender.close()
        receiver.close()


def test_http_names_a_tensor_damaged_after_its_checksum_was_taken():
    """The receiver's one-pass checksum finds the damage; the staging area's own check then
    names the tensor, as before."""
    state = mixed_state()
    plan = RefitPlan.build(meta_of(state), wire_dtype=None, bucket_bytes=8 << 20)
    receiver, sender = _http_rig(plan)
    try:
        staging = StagingArea(plan)
        staging.begin(1, 1)
        thread, errors = _receive_in_thread(receiver, staging, 1)
        (header, payload), = plan.pack(state, version=1, attempt=1, prefetch=False, arenas=sender.arenas())
        state["other.weight"][3, 3] += 1.0  # the trainer's tensor changes under a direct send
        sender.begin(1, plan.bucket_count)
        sender.send(header, payload)
        sender.commit(1)
        thread.join(30)
        assert len(errors) == 1 and isinstance(errors[0], ChecksumError)
        assert errors[0].tensor == "other.weight"
    finally:
        sender.close()
        receiver.close()


def test_collective_broadcasts_large_tensors_straight_into_staging():
    state = mixed_state()
    plan = RefitPlan.build(meta_of(state), wire_dtype=None, bucket_bytes=1 << 20)
    assert plan.bucket_count >= 2
    destination = {k: torch.zeros_like(v) for k, v in state.items()}
    sender = CollectiveSender(engine_workers=1, host="127.0.0.1", port=0, timeout_s=20,
                              arena_bytes=plan.arena_bytes)
    receivers = []
    joiner = threading.Thread(target=lambda: receivers.append(CollectiveReceiver(
        host="127.0.0.1", port=sender.port, world_size=2, rank=1, arena_bytes=plan.arena_bytes, timeout_s=20)))
    joiner.start()
    sender.connect()
    joiner.join(30)
    try:
        for version in (1, 2):
            staging = StagingArea(plan, destination=destination)
            staging.begin(version, version)
            thread, errors = _receive_in_thread(receivers[0], staging, version)
            sender.begin(version, plan.bucket_count)
            buckets = plan.pack(state, version=version, attempt=version, arenas=sender.arenas(), hold=1)
            sent_directly = set()
            for header, payload in buckets:
                sent_directly |= set(payload.direct)
                sender.send(header, payload)
            sender.commit(version)
            thread.join(30)
            assert not errors, errors
            assert sent_directly == {"big.weight", "other.weight"}  # the two over DIRECT_MIN_BYTES
            got = staging.finish()
            for name, tensor in state.items():
                assert torch.equal(got[name], tensor), name
            state["big.weight"].mul_(2)
        # the large tensors never touched the receiver's arenas: they landed in the destination
        assert got["big.weight"].data_ptr() == destination["big.weight"].data_ptr()
    finally:
        sender.close()


def test_gpu_paths_refuse_clearly_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TransportUnavailableError, match="no CUDA device"):
        CollectiveSender(engine_workers=1, device="cuda")
    from transports.ipc import IpcSender

    with pytest.raises(TransportUnavailableError, match="no CUDA device"):
        IpcSender(arena_bytes=1024, device="cuda")
