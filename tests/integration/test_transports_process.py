"""Every transport, trainer process -> receiving process: versions arrive exactly, and a bad
bucket is an error naming the tensor while the receiver keeps its old weights."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import CorruptingSender
from transports.base import (
    ChecksumError,
    MissingTensorError,
    RefitMismatchError,
    TransportConfigError,
    TruncatedBucketError,
)
from transports.factory import TrainCluster, create_weight_synchronizer
from transports.local import ProcessEngine

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

TRANSPORTS = ["filesystem", "collective", "ipc", "http"]
# Limits against a hang, not a speed: in the light lane a receiver process can start on a tenth of a
# core while the main lane runs the cluster scenario (a 20 s limit failed there on 2026-12-06).
HANG_S = 600


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


class Trainer:
    """The trainer side of one test: its tensors (updated in place) and its synchronizer."""

    def __init__(self, transport: str, tmp_path, engine: ProcessEngine):
        self.state = make_state(0)
        self.sync = create_weight_synchronizer(
            state_dict=lambda: self.state, engines=[engine], colocated=transport in ("ipc", "http"),
            transport=transport, train_cluster=TrainCluster(), inference_world_size=1,
            filesystem_root=tmp_path / "weights", bucket_bytes=8 << 10, wire_dtype=None, timeout_s=HANG_S)
        self.sync.init_communicator()

    def step(self, seed: int) -> None:
        for name, tensor in make_state(seed).items():
            self.state[name].copy_(tensor)
        self.sync.mark_stale()


@pytest.fixture(scope="module", params=TRANSPORTS)
def rig(request, tmp_path_factory):
    engine = ProcessEngine(request.param, timeout_s=HANG_S)
    trainer = Trainer(request.param, tmp_path_factory.mktemp(request.param), engine)
    yield request.param, trainer, engine
    trainer.sync.shutdown()
    engine.stop()


def assert_live_equals(engine: ProcessEngine, state: dict[str, torch.Tensor]) -> None:
    live = engine.live()
    assert set(live) == set(state)
    for name, tensor in state.items():
        assert torch.equal(live[name], tensor), name


def test_versions_arrive_exactly(rig):
    transport, trainer, engine = rig
    trainer.step(1)
    assert trainer.sync.is_stale
    version = trainer.sync.sync_weights()
    assert not trainer.sync.is_stale
    assert engine.live_version() == version
    assert_live_equals(engine, trainer.state)
    trainer.step(2)
    version = trainer.sync.sync_weights()
    assert engine.live_version() == version
    assert_live_equals(engine, trainer.state)


@pytest.mark.parametrize("fault,error", [
    ("shape", RefitMismatchError), ("dtype", RefitMismatchError), ("missing", MissingTensorError),
    ("truncated", TruncatedBucketError), ("checksum", ChecksumError)])
def test_a_bad_bucket_names_the_tensor_and_keeps_the_old_weights(rig, fault, error):
    transport, trainer, engine = rig
    trainer.step(10)
    trainer.sync.sync_weights()
    before_version, before = engine.live_version(), engine.live()
    trainer.step(11)
    real = trainer.sync.sender
    trainer.sync.sender = CorruptingSender(real, fault)
    try:
        with pytest.raises(error) as err:
            trainer.sync.sync_weights()
    finally:
        trainer.sync.sender = real
    assert err.value.tensor in trainer.state  # names a real tensor
    assert trainer.sync.is_stale
    assert engine.live_version() == before_version
    assert_live_equals(engine, before)
    # The transport recovers: the next version goes through.
    trainer.sync.sync_weights()
    assert_live_equals(engine, trainer.state)


def test_only_the_collective_forwards_kv_scales(rig):
    transport, trainer, engine = rig
    trainer.step(20)
    if transport == "collective":
        trainer.sync.sync_weights(kv_scales={"model.layers.0.self_attn.attn.k_scale": 0.5})
        assert engine.kv_scales() == {"model.layers.0.self_attn.attn.k_scale": 0.5}
    else:
        with pytest.raises(TransportConfigError, match="kv_scales"):
            trainer.sync.sync_weights(kv_scales={"k": 0.5})


@pytest.mark.gpu
def test_gpu_ipc_moves_a_version_through_cuda_ipc_handles(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = ProcessEngine("ipc", timeout_s=120)
    state = {k: v.cuda() for k, v in make_state(3).items()}
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[engine], colocated=True, transport="ipc",
                                      bucket_bytes=8 << 10, wire_dtype=None, timeout_s=60, device="cuda")
    try:
        sync.init_communicator()
        sync.mark_stale()
        sync.sync_weights()
        live = engine.live()
        for name, tensor in state.items():
            assert torch.equal(live[name].cpu(), tensor.cpu()), name
    finally:
        sync.shutdown()
        engine.stop()


def test_bench_reports_every_transport_against_its_reference():
    from transports.bench.transports import run_bench

    results = run_bench(size=4 << 20, tensors=20, bucket_bytes=1 << 20,
                        transports=["filesystem", "ipc", "http", "collective"])
    assert results["tensors"] == 20
    for kind, figures in results["transports"].items():
        for key in ("gbps", "reference_gbps", "ratio", "peak_extra_bytes", "bucket_bytes"):
            assert figures[key] >= 0, (kind, key)
        assert figures["gbps"] > 0 and figures["reference_gbps"] > 0


def test_bench_json_on_stdout_is_pure_json(tmp_path):
    """Receiver processes log too: none of it may land on the stdout that carries the JSON."""
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.commands.cli", "bench", "transports", "--size", "4MiB",
         "--tensors", "10", "--bucket", "1MiB", "--transports", "filesystem,ipc", "--rounds", "2",
         "--no-checksums", "--save", str(tmp_path / "saved.json"), "--json"],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    assert set(figures["transports"]) == {"filesystem", "ipc"}
    assert figures["rounds"] == 2 and figures["checksums"] is False
    assert all(len(f["seconds_all"]) == 2 for f in figures["transports"].values())
