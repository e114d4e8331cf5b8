"""The factory's decision table, its errors, and the synchronizer contract."""

from __future__ import annotations

import pytest
import torch

from transports.base import (
    DeviceHandoverHooks,
    TransportConfigError,
    TransportError,
    TransportUnavailableError,
    WeightSynchronizer,
    engine_memory_fraction,
)
from transports.factory import TrainCluster, choose_transport, create_weight_synchronizer
from transports.nixl import nixl_unavailable_reason

CLUSTER = TrainCluster()


@pytest.mark.parametrize("backend,colocated,expected", [
    ("vllm", False, "collective"), ("vllm", True, "ipc"), ("sglang", True, "http")])
def test_table(backend, colocated, expected):
    choice = choose_transport(backend=backend, colocated=colocated, train_cluster=CLUSTER, inference_world_size=2)
    assert choice.transport == expected


def test_non_colocated_sglang_is_not_implemented():
    with pytest.raises(NotImplementedError, match="SGLang"):
        choose_transport(backend="sglang", colocated=False, train_cluster=CLUSTER, inference_world_size=1)


@pytest.mark.parametrize("kwargs,missing", [
    ({}, "train_cluster and inference_world_size"),
    ({"train_cluster": CLUSTER}, "inference_world_size"),
    ({"inference_world_size": 2}, "train_cluster")])
def test_non_colocated_needs_cluster_and_world_size(kwargs, missing):
    with pytest.raises(TransportConfigError, match=f"needs {missing}"):
        choose_transport(backend="vllm", colocated=False, **kwargs)


def test_lora_picks_filesystem_by_itself():
    for colocated in (True, False):
        assert choose_transport(colocated=colocated, lora=True).transport == "filesystem"


@pytest.mark.parametrize("asked", ["collective", "nixl"])
def test_lora_refuses_an_explicit_full_weight_transport(asked):
    with pytest.raises(TransportConfigError, match=f"LoRA.*{asked}"):
        choose_transport(colocated=False, lora=True, transport=asked, train_cluster=CLUSTER, inference_world_size=1)


def test_unknown_transport_is_refused():
    with pytest.raises(TransportConfigError, match="unknown transport 'carrier-pigeon'"):
        choose_transport(colocated=True, transport="carrier-pigeon")


def test_nixl_reports_why_it_is_unavailable():
    reason = nixl_unavailable_reason()
    if reason is None:  # a machine with nixl: the choice goes through
        assert choose_transport(colocated=True, transport="nixl").transport == "nixl"
    else:
        with pytest.raises(TransportUnavailableError, match="nixl"):
            choose_transport(colocated=True, transport="nixl")


def test_device_share():
    assert engine_memory_fraction(colocated=False, max_colocated_worker_groups=4) == 1.0
    assert engine_memory_fraction(colocated=True, max_colocated_worker_groups=1) == 0.2
    assert engine_memory_fraction(colocated=True, max_colocated_worker_groups=8) == 0.125
    assert choose_transport(colocated=True, max_colocated_worker_groups=10).engine_memory_fraction == 0.1


class RecordingEngine:
    """A hand-written fake engine for the colocated filesystem path: it only records calls
    (the real receiving ends are tested process-to-process and against vLLM)."""

    def __init__(self):
        self.calls = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append(("update", update_info["version"]))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


def test_synchronizer_contract_and_colocated_hand_over(tmp_path):
    state = {"w": torch.ones(4, 4)}
    hooks = DeviceHandoverHooks()
    engine = RecordingEngine()
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[engine], colocated=True,
                                      transport="filesystem", filesystem_root=tmp_path, hooks=hooks, timeout_s=5)
    assert isinstance(sync, WeightSynchronizer)
    assert sync.prepare_refit_info() == {"w": ((4, 4), torch.float32)}
    with pytest.raises(TransportError, match="init_communicator"):
        sync.sync_weights()
    sync.init_communicator()
    assert not sync.is_stale
    sync.mark_stale()
    assert sync.is_stale
    assert sync.sync_weights() == 1
    assert not sync.is_stale
    assert hooks.calls == ["offload_optimizer", "prepare_for_generation", "offload_after_refit"]
    assert engine.calls == ["init", "start", ("update", 1), ("finish", "1")]
    assert (tmp_path / "v00000001" / "COMPLETE").exists()
    sync.shutdown()


def test_collective_only_moves_bytes():
    sync = create_weight_synchronizer(state_dict=lambda: {"w": torch.ones(2)}, engines=[], colocated=False,
                                      train_cluster=CLUSTER, inference_world_size=1, hooks=DeviceHandoverHooks())
    try:
        assert sync.transport_name == "collective"
        assert sync.hooks is None and sync.forwards_kv_scales
    finally:
        sync.shutdown()


def test_filesystem_keeps_the_last_k_versions(tmp_path):
    state = {"w": torch.zeros(8)}
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[], colocated=True, transport="filesystem",
                                      filesystem_root=tmp_path, keep_last=2, timeout_s=5)
    sync.init_communicator()
    for _ in range(4):
        sync.mark_stale()
        sync.sync_weights()
    sync.shutdown()  # old versions are removed in the background; shutdown waits for that
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003", "v00000004"]
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "v00000004" / "bucket-00000.safetensors")["w"], torch.zeros(8))


def test_filesystem_engine_stages_a_version_while_it_is_written(tmp_path):
    """Bucket files are self-describing: an engine stages every bucket from the directory
    being written, before the version is published, and ignores files of another attempt."""
    from transports.base import TransportTimeoutError
    from transports.filesystem import FilesystemReceiver, FilesystemSender, parse_bucket_file, published_versions
    from transports.refit.plan import RefitPlan
    from transports.staging import StagingArea

    state = {f"w{i}": torch.randn(32, 32) for i in range(4)}
    plan = RefitPlan.build({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, wire_dtype=None,
                           bucket_bytes=8 << 10)
    assert plan.bucket_count >= 2
    sender = FilesystemSender(tmp_path)
    receiver = FilesystemReceiver(tmp_path, arena_bytes=plan.arena_bytes, timeout_s=1.0)
    try:
        sender.begin(5, plan.bucket_count)
        for header, payload in plan.pack(state, version=5, attempt=2, prefetch=False):
            sender.send(header, payload)
        assert published_versions(tmp_path) == []  # not committed
        first = next((tmp_path / ".tmp-v00000005").glob("bucket-*.safetensors"))
        meta, tensors = parse_bucket_file(memoryview(first.read_bytes()))
        assert (meta.version, meta.attempt, meta.count) == (5, 2, plan.bucket_count)
        assert all(meta.crc[t.name] == t.checksum != 0 for t in tensors)

        staging = StagingArea(plan)
        staging.begin(5, attempt=2)
        receiver.receive(5, staging)
        staged = staging.finish()
        assert all(torch.equal(staged[k], v) for k, v in state.items())

        stale = StagingArea(plan)
        stale.begin(5, attempt=3)  # a retry: attempt 2's files must not be taken for it
        with pytest.raises(TransportTimeoutError, match="attempt 3"):
            receiver.receive(5, stale)
        sender.commit(5)
        assert published_versions(tmp_path) == [5]
    finally:
        sender.close()
        receiver.close()


def test_errors_cross_a_text_only_boundary_with_their_type():
    """What `HttpEngineControl` relies on: a worker's error, described as JSON, comes back as
    the same class naming the same tensor."""
    import json

    from transports.base import (
        ChecksumError,
        MissingTensorError,
        TransportError,
        TransportTimeoutError,
        describe_error,
        rebuild_error,
    )

    for error in (ChecksumError("model.norm.weight", "checksum 0x1 != sent 0x2"),
                  MissingTensorError("lm_head.weight"), TransportTimeoutError("bucket 3", 2.5)):
        back = rebuild_error(json.loads(json.dumps(describe_error(error))))
        assert type(back) is type(error) and str(back) == str(error)
    assert rebuild_error(json.loads(json.dumps(describe_error(ChecksumError("w", "bad"))))).tensor == "w"
    other = rebuild_error(describe_error(RuntimeError("boom")))
    assert type(other) is TransportError and "RuntimeError: boom" in str(other)
