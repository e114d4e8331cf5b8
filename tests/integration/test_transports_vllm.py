"""Every transport updates a real vLLM CPU engine (in-process, fp32): its logprobs then match a
transformers forward of the new weights within 1e-3 and no longer match the old; a bad version
is refused naming the tensor and the engine keeps serving its old weights."""

from __future__ import annotations


import pytest
import torch

from tests.helpers import CorruptingSender, inflight_llm, load_safetensors_dir
from transports.base import ChecksumError
from transports.factory import TrainCluster, create_weight_synchronizer

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TRANSPORTS = ["filesystem", "collective", "ipc", "http"]
PROMPT = [5, 17, 42, 8, 23, 11, 3, 29]


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir):
    return load_safetensors_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = inflight_llm(tiny_model_dir)
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def sample(llm) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    return tokens, [lp[t].logprob for t, lp in zip(tokens, out.logprobs)]


def hf_logprobs(hf_model, weights: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    missing, unexpected = hf_model.load_state_dict(weights, strict=False)
    assert not unexpected
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(PROMPT) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def new_weights(checkpoint, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint moved far enough to change every logprob, rounded to bf16-representable
    values so the default bf16 wire carries them exactly."""
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.5 * v.std().clamp(min=0.02) * torch.randn(v.shape, generator=g)).to(torch.bfloat16).float()
            for k, v in checkpoint.items()}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transport_updates_a_real_engine(transport, llm, hf_model, checkpoint, tmp_path):
    from transports.vllm_backend import LLMControl

    # bf16-representable, so the default bf16 wire carries the starting weights exactly too.
    state = {k: v.to(torch.bfloat16).float() for k, v in checkpoint.items()}
    sync = create_weight_synchronizer(
        state_dict=lambda: state, engines=[LLMControl(llm)], colocated=transport in ("ipc", "http"),
        transport=transport, train_cluster=TrainCluster(), inference_world_size=1,
        filesystem_root=tmp_path, bucket_bytes=256 << 10, timeout_s=30)
    try:
        sync.init_communicator()
        old = {k: v.clone() for k, v in state.items()}
        seed = 100 + TRANSPORTS.index(transport)
        # Start every test from the original checkpoint (a previous test may have moved it).
        sync.mark_stale()
        sync.sync_weights()
        tokens, engine_lp = sample(llm)
        assert torch.allclose(torch.tensor(engine_lp), hf_logprobs(hf_model, old, tokens), atol=1e-3)

        state.update(new_weights(checkpoint, seed))
        sync.mark_stale()
        version = sync.sync_weights()
        assert not sync.is_stale
        tokens, engine_lp = sample(llm)
        engine_lp = torch.tensor(engine_lp)
        assert torch.allclose(engine_lp, hf_logprobs(hf_model, state, tokens), atol=1e-3)
        assert (engine_lp - hf_logprobs(hf_model, old, tokens)).abs().max() > 1e-2

        # A corrupted version is refused naming the tensor; the engine keeps serving `version`.
        served = {k: v.clone() for k, v in state.items()}
        state.update(new_weights(checkpoint, seed + 50))
        sync.mark_stale()
        real = sync.sender
        sync.sender = CorruptingSender(real)
        try:
            with pytest.raises(ChecksumError) as err:
                sync.sync_weights()
        finally:
            sync.sender = real
        assert err.value.tensor in state
        assert sync.is_stale and sync.version == version + 1
        tokens, engine_lp = sample(llm)
        assert torch.allclose(torch.tensor(engine_lp), hf_logprobs(hf_model, served, tokens), atol=1e-3)
    finally:
        sync.shutdown()
        llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine")
