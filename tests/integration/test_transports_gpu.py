"""The GPU paths (issue 10, item 5): CUDA arenas filled with torch ops on the device, the CUDA
IPC receiver replaying straight out of the trainer's device arena (no host copy), and the
collective transport on NCCL with CUDA tensors. Every test here needs a CUDA device (NCCL two
of them: it refuses two ranks on one device); they are marked `gpu` and skip without one, as
`test_gpu_ipc_moves_a_version_through_cuda_ipc_handles` does. Written, not yet run on a GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from transports.refit.plan import DirectArenas, RefitPlan
from transports.staging import StagingArea


def needs_cuda(devices: int = 1) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} CUDA device(s)")


def cpu_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(256, 640, generator=g), "b.bias": torch.randn(40, generator=g),
            "c.weight": torch.randn(32, 32, generator=g)}


def meta_of(state):
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


@pytest.mark.gpu
def test_gpu_plan_fills_cuda_arenas_on_the_device():
    needs_cuda()
    state = {k: v.cuda() for k, v in cpu_state().items()}
    plan = RefitPlan.build(meta_of(state), wire_dtype=torch.bfloat16, bucket_bytes=64 << 10)
    arenas = [torch.empty(plan.arena_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    staging = StagingArea(plan)
    staging.begin(1)
    for header, payload in plan.pack(state, version=1, arenas=arenas, prefetch=False):
        assert isinstance(payload, torch.Tensor) and payload.device.type == "cuda"
        assert not header.checksums  # device buckets carry none (see docs/transports.md)
        staging.accept(header, payload)  # replayed on the device
    got = staging.finish()
    for name, tensor in state.items():
        assert got[name].device.type == "cuda", name
        assert torch.equal(got[name], tensor.to(torch.bfloat16).to(tensor.dtype)), name


@pytest.mark.gpu
def test_gpu_ipc_stages_on_the_device_without_a_host_copy():
    needs_cuda()
    from transports.factory import create_weight_synchronizer
    from transports.local import ProcessEngine

    engine = ProcessEngine("ipc", timeout_s=120)
    state = {k: v.cuda() for k, v in cpu_state(1).items()}
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[engine], colocated=True, transport="ipc",
                                      bucket_bytes=64 << 10, wire_dtype=None, timeout_s=60, device="cuda")
    try:
        sync.init_communicator()
        for step in range(2):  # the second version reuses both device arenas
            for tensor in state.values():
                tensor.add_(step)
            sync.mark_stale()
            sync.sync_weights()
            live = engine.live()
            for name, tensor in state.items():
                assert live[name].device.type == "cuda", name  # staged on the device
                assert torch.equal(live[name].cpu(), tensor.cpu()), name
    finally:
        sync.shutdown()
        engine.stop()


@pytest.mark.gpu
def test_gpu_collective_moves_cuda_tensors_over_nccl():
    needs_cuda(devices=2)
    from transports.collective import CollectiveReceiver, CollectiveSender

    torch.cuda.set_device(0)
    state = {k: v.cuda(0) for k, v in cpu_state(2).items()}
    plan = RefitPlan.build(meta_of(state), wire_dtype=None, bucket_bytes=256 << 10)
    sender = CollectiveSender(engine_workers=1, host="127.0.0.1", port=0, timeout_s=60, device="cuda")
    receivers, errors = [], []

    def engine_worker():
        try:
            torch.cuda.set_device(1)  # NCCL needs one device per rank
            receiver = CollectiveReceiver(host="127.0.0.1", port=sender.port, world_size=2, rank=1,
                                          arena_bytes=plan.arena_bytes, timeout_s=60)
            receivers.append(receiver)
            staging = StagingArea(plan)
            staging.begin(1, 1)
            receiver.receive(1, staging)
            receivers.append(staging.finish())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=engine_worker)
    thread.start()
    sender.connect()
    sender.begin(1, plan.bucket_count)
    for header, payload in plan.pack(state, version=1, attempt=1, arenas=sender.arenas(), hold=1):
        sender.send(header, payload)
    sender.commit(1)
    thread.join(120)
    assert not errors, errors
    receiver, got = receivers
    assert receiver.device.type == "cuda" and isinstance(sender.arenas(), DirectArenas)
    for name, tensor in state.items():
        assert got[name].device == torch.device("cuda", 1), name
        assert torch.equal(got[name].cpu(), tensor.cpu()), name
    sender.close()
