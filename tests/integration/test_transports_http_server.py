"""Transports driven over HTTP: a real vLLM OpenAI server process (dev mode), its own
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` and
`/finish_weight_update` endpoints (`HttpEngineControl`), and our receivers inside its worker.

After a version goes through, the server's logprobs match a transformers forward of the new
weights within 1e-3 and no longer match the old; a corrupted version is refused naming the
tensor (the error crosses the HTTP boundary intact) and the server keeps serving the old one.
One server serves the whole module; it is always shut down, whatever the tests do."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.helpers import CorruptingSender, load_safetensors_dir
from tests.reference import reference_logprobs
from transports.base import ChecksumError
from transports.factory import TrainCluster, create_weight_synchronizer

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(600)]

TRANSPORTS = ["filesystem", "http", "collective", "ipc"]
PROMPT = [5, 17, 42, 8, 23, 11, 3, 29]


@pytest.fixture(scope="module")
async def server(tiny_model_dir, tmp_path_factory):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.server import ServerEngine

    # No prefix caching: a prompt's cached keys/values must not outlive the weights that made
    # them (the orchestrator fences the cache at activation; these tests swap weights directly).
    config = EngineConfig(model=str(tiny_model_dir), kind="server", max_model_len=128, max_num_seqs=4,
                          enable_prefix_caching=False,
                          worker_extension_cls="transports.vllm_backend.InflightWorkerExtension",
                          weight_transfer_backend="inflight")
    engine = ServerEngine(config, "transports-http", log_dir=tmp_path_factory.mktemp("server-logs"))
    try:
        await engine.start()
        yield engine
    finally:
        await engine.shutdown()
    assert engine.process is not None and engine.process.poll() is not None, "the server outlived the module"


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir) -> dict[str, torch.Tensor]:
    return load_safetensors_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def moved(checkpoint: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint moved far enough to change every logprob."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * v.std().clamp(min=0.02) * torch.randn(v.shape, generator=g) for k, v in checkpoint.items()}


def expected(hf_model, weights: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    _, unexpected = hf_model.load_state_dict(weights, strict=False)
    assert not unexpected
    return torch.tensor(reference_logprobs(hf_model, PROMPT, tokens))


async def sample(server, request_id: str) -> tuple[list[int], torch.Tensor]:
    from orchestrator.engines.base import SamplingSettings

    done = await server.complete(request_id, PROMPT, SamplingSettings(max_tokens=12, seed=1234, ignore_eos=True))
    assert len(done.token_ids) == 12
    return list(done.token_ids), torch.tensor(done.logprobs)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_transport_updates_a_server_over_http(transport, server, hf_model, checkpoint, tmp_path):
    from transports.vllm_backend import HttpEngineControl

    control = HttpEngineControl(server.url, timeout_s=120)
    state = {k: v.clone() for k, v in checkpoint.items()}
    sync = create_weight_synchronizer(
        state_dict=lambda: state, engines=[control], colocated=transport in ("ipc", "http"),
        transport=transport, train_cluster=TrainCluster(), inference_world_size=1,
        filesystem_root=tmp_path / "weights", bucket_bytes=256 << 10, wire_dtype=None, timeout_s=60)
    seed = 200 + TRANSPORTS.index(transport)
    try:
        await asyncio.to_thread(sync.init_communicator)
        # Start from the checkpoint (an earlier test may have left other weights live).
        sync.mark_stale()
        await asyncio.to_thread(sync.sync_weights)
        old = {k: v.clone() for k, v in state.items()}
        tokens, served = await sample(server, f"{transport}-old")
        assert torch.allclose(served, expected(hf_model, old, tokens), atol=1e-3)

        state.update(moved(checkpoint, seed))
        sync.mark_stale()
        version = await asyncio.to_thread(sync.sync_weights)
        assert not sync.is_stale
        tokens, served = await sample(server, f"{transport}-new")
        assert torch.allclose(served, expected(hf_model, state, tokens), atol=1e-3)
        assert (served - expected(hf_model, old, tokens)).abs().max() > 1e-2

        # A corrupted version is refused naming the tensor; the server keeps serving `version`.
        live = {k: v.clone() for k, v in state.items()}
        state.update(moved(checkpoint, seed + 50))
        sync.mark_stale()
        real = sync.sender
        sync.sender = CorruptingSender(real)
        try:
            with pytest.raises(ChecksumError) as err:
                await asyncio.to_thread(sync.sync_weights)
        finally:
            sync.sender = real
        assert err.value.tensor in state
        assert err.value.tensor in str(err.value)
        assert sync.is_stale and sync.version == version + 1
        tokens, served = await sample(server, f"{transport}-refused")
        assert torch.allclose(served, expected(hf_model, live, tokens), atol=1e-3)

        # ... and the next good version still goes through.
        version = await asyncio.to_thread(sync.sync_weights)
        assert not sync.is_stale
        tokens, served = await sample(server, f"{transport}-after")
        assert torch.allclose(served, expected(hf_model, state, tokens), atol=1e-3)
    finally:
        sync.shutdown()
        await asyncio.to_thread(control.shutdown_weight_transfer_engine)
        control.close()
