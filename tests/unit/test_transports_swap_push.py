"""The worker-side stager fed by push transports (ipc, http, collective) without a vLLM
engine: a sending-only synchronizer (`engines=[]`, `engine_count=1`) sends, the extension's
staging thread receives through the same staging path as the filesystem, and the flip makes
exactly that version live. A refused bucket fails the stage, the old weights stay, and the next
version stages through the same receiver. The staging area's open attempt and bucket sink are
tested on their own. (vLLM's layerwise reload is replaced by a plain copy, as in
`test_transports_swap.py`; the engine path runs in `tests/integration/test_activation_transports.py`.)
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import tiny_model, tiny_plan, tiny_state
from transports.factory import TrainCluster, create_weight_synchronizer
from transports.staging import StagingArea

pytestmark = pytest.mark.timeout(120)


version_state = tiny_state
make_plan = tiny_plan


@pytest.fixture
def fake_reload(monkeypatch):
    import transports.swap as swap_module

    def reload_into(model, weights, model_config):
        params = dict(model.named_parameters())
        for name, tensor in weights.items():
            params[name].data.copy_(tensor)

    monkeypatch.setattr(swap_module, "reload_into", reload_into)
    monkeypatch.setattr(swap_module, "share_reload_metadata", lambda live, shadow: None)
    return swap_module


def wait_state(ext, *states: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while (status := ext.swap_status())["state"] not in states:
        assert time.monotonic() < deadline, status
        time.sleep(0.01)
    return status


class Corrupting:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, header, payload):
        if header.index == 0:
            damaged = bytearray(bytes(payload))
            damaged[header.tensors[0].offset] ^= 0x10
            payload = memoryview(damaged)
        self.inner.send(header, payload)


def worker(swap_module, plan, transport: str, options: dict):
    """One engine worker's extension over a fresh tiny model, with its push receiver built;
    returns (extension, model, swap_init's answer)."""
    torch.manual_seed(0)
    model = tiny_model()
    ext = swap_module.SwapWorkerExtension()
    ext.model_runner = SimpleNamespace(get_model=lambda: model, model_config=SimpleNamespace(dtype=torch.float32),
                                       requests={})
    answer = ext.swap_init(json.dumps({"plan": plan.encode().decode(), "strategy": "double_buffer", "timeout_s": 5,
                                       "transport": transport, "options": options}))
    return ext, model, answer


def stage_on(exts, sync, version: int) -> tuple[list[dict], list[BaseException]]:
    """The trainer sends `version` while every worker in `exts` stages it."""
    errors: list[BaseException] = []

    def send() -> None:
        try:
            sync.sync_weights()
        except BaseException as exc:  # noqa: BLE001 - checked by the caller
            errors.append(exc)

    for ext in exts:
        ext.swap_stage(json.dumps({"version": version}))
    thread = threading.Thread(target=send)
    thread.start()
    statuses = [wait_state(ext, "staged", "failed") for ext in exts]
    thread.join(30)
    assert not thread.is_alive()
    return statuses, errors


def sync_and_stage(ext, sync, version: int) -> dict:
    """One worker: its stage status, with the trainer's errors under "sender_errors"."""
    (status,), errors = stage_on([ext], sync, version)
    return {**status, "sender_errors": errors}


@pytest.mark.parametrize("transport", ["ipc", "http", "collective"])
def test_a_push_transport_stages_into_the_swap_extension(fake_reload, transport):
    plan = make_plan()
    state = version_state(1)
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[], engine_count=1,
                                      colocated=transport != "collective", transport=transport,
                                      train_cluster=TrainCluster(), inference_world_size=1, plan=plan, timeout_s=5)
    connect = threading.Thread(target=sync.init_communicator)
    connect.start()  # the collective rendezvous waits for the worker's receiver, built by swap_init
    ext, model, answer = worker(fake_reload, plan, transport, sync.engine_init_info(0)["options"])
    assert answer["transport"] == transport
    connect.join(30)
    try:
        sync.mark_stale()
        status = sync_and_stage(ext, sync, 1)
        assert status["state"] == "staged", status
        assert ext.swap_apply()["version"] == 1
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())

        # A corrupted bucket: the stage fails naming the tensor, the live weights stay.
        served = {k: v.clone() for k, v in state.items()}
        state.update(version_state(2))
        sync.mark_stale()
        real = sync.sender
        sync.sender = Corrupting(real)
        try:
            status = sync_and_stage(ext, sync, 2)
        finally:
            sync.sender = real
        assert status["state"] == "failed" and "ChecksumError" in status["error"], status
        ext.swap_drop("2")
        assert all(torch.equal(model.state_dict()[k], v) for k, v in served.items())

        # Same receiver (same swap_init options kept it), next version.
        ext.swap_init(json.dumps({"plan": plan.encode().decode(), "strategy": "double_buffer", "timeout_s": 5,
                                  "transport": transport, "options": sync.engine_init_info(0)["options"]}))
        state.update(version_state(3))
        sync.mark_stale()
        status = sync_and_stage(ext, sync, 3)
        assert status["state"] == "staged", status
        assert ext.swap_apply()["version"] == 3
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    finally:
        sync.shutdown()
        link = ext._swap()["link"]
        if link is not None:
            link.close()


def test_an_open_attempt_is_fixed_by_the_first_bucket_and_buckets_go_to_the_sink():
    plan = make_plan()
    state = version_state(4)
    staging = StagingArea(plan)
    got: list[dict[str, torch.Tensor]] = []
    staging.begin(7, None, on_bucket=lambda bucket: got.append(dict(bucket)), retain=False)
    stale = list(plan.pack(state, version=7, attempt=1, prefetch=False))
    fresh = [(h, bytes(p)) for h, p in plan.pack(state, version=7, attempt=2, prefetch=False)]
    assert staging.is_current(fresh[0][0])  # the first bucket of version 7 seen: attempt 2
    assert not staging.is_current(stale[0][0])  # attempt 1 is now left over
    for header, payload in fresh:
        staging.accept(header, memoryview(payload))
    assert staging.finish() == {}  # the sink took every bucket
    assert len(got) == plan.bucket_count > 1
    merged = {k: v for bucket in got for k, v in bucket.items()}
    assert set(merged) == set(state) and all(torch.equal(merged[k], v) for k, v in state.items())


@pytest.mark.parametrize("transport", ["ipc", "http"])
def test_a_fenced_engine_left_out_does_not_fail_the_others_and_can_come_back(fake_reload, transport):
    plan = make_plan()
    state = version_state(1)
    # timeout_s: how long the version sent to the dead engine waits before it fails; 3 s once
    # failed the restarted engine's first bucket too, on a loaded machine (the full suite, stop 39).
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[], engine_count=2, colocated=True,
                                      transport=transport, plan=plan, timeout_s=8)
    connect = threading.Thread(target=sync.init_communicator)
    connect.start()
    workers = [worker(fake_reload, plan, transport, sync.engine_init_info(i)["options"]) for i in range(2)]
    connect.join(30)
    exts = [ext for ext, _, _ in workers]
    try:
        sync.mark_stale()
        statuses, errors = stage_on(exts, sync, 1)
        assert [s["state"] for s in statuses] == ["staged", "staged"] and not errors
        for ext in exts:
            ext.swap_apply()

        exts[1]._swap()["link"].close()  # engine 1 dies: its receiver is gone
        state.update(version_state(2))
        sync.mark_stale()
        statuses, errors = stage_on(exts[:1], sync, 2)
        assert errors, "a version sent to a dead engine should fail"
        exts[0].swap_drop("2")

        sync.exclude_engine(1)  # what a fleet that fenced engine 1 tells its trainer
        state.update(version_state(3))
        sync.mark_stale()
        statuses, errors = stage_on(exts[:1], sync, 3)
        assert statuses[0]["state"] == "staged" and not errors, (statuses, errors)
        assert exts[0].swap_apply()["version"] == 3
        assert all(torch.equal(workers[0][1].state_dict()[k], v) for k, v in state.items())

        # engine 1 restarts with the same init info and is sent versions again
        exts[1], model1, _ = worker(fake_reload, plan, transport, sync.engine_init_info(1)["options"])
        sync.include_engine(1)
        state.update(version_state(4))
        sync.mark_stale()
        statuses, errors = stage_on(exts, sync, 4)
        assert [s["state"] for s in statuses] == ["staged", "staged"] and not errors, (statuses, errors)
        exts[1].swap_apply()
        assert all(torch.equal(model1.state_dict()[k], v) for k, v in state.items())
    finally:
        sync.shutdown()
        for ext in exts:
            link = ext._swap()["link"]
            if link is not None:
                link.close()


def test_the_collective_refuses_to_leave_an_engine_out():
    from transports.errors import TransportConfigError

    state = version_state(1)
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[], engine_count=2, colocated=False,
                                      transport="collective", train_cluster=TrainCluster(), inference_world_size=2,
                                      plan=make_plan(), timeout_s=3)
    try:
        with pytest.raises(TransportConfigError, match="reconnect"):
            sync.exclude_engine(1)
    finally:
        sync.shutdown()
