"""One JAX (Flax NNX + optax) optimizer step on the digits task, published through the
filesystem transport into a live vLLM CPU engine (in-process, fp32): the engine's logprobs then
match a transformers forward of the stepped weights, and the NNX forward, within 1e-3, and no
longer match the weights before the step."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from tests.helpers import inflight_llm, load_safetensors_dir

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [5, 17, 42, 8, 23, 11, 3, 29]
TOL = 1e-3


@pytest.fixture(scope="module")
async def toy_batch(tiny_model_dir):
    """Digits prompts, two completions each (digits / prose), scored by the task, GRPO advantages."""
    from orchestrator.config.run import TaskConfig
    from orchestrator.tasks import make_task
    from orchestrator.trainer.loss import group_advantages

    task = make_task(TaskConfig(name="digits", seed=0), str(tiny_model_dir))
    tok = task.tokenizer
    answers = [tok.encode("4712") + [task.eos_token_id], tok.encode(" import os") + [task.eos_token_id]]
    prompts, completions, rewards, groups = [], [], [], []
    for i in range(4):
        prompt = await task.prompt(i)
        for answer in answers:
            prompts.append(list(prompt.token_ids))
            completions.append(answer)
            rewards.append((await task.score(prompt, answer))["reward"])
            groups.append(i)
    advantages = group_advantages(torch.tensor(rewards), torch.tensor(groups), normalize_std=True)
    assert advantages.abs().min() > 0.5  # each group holds a better and a worse completion
    return prompts, completions, advantages.tolist(), tok.pad_token_id


@pytest.fixture(scope="module")
def stepped(tiny_model_dir, toy_batch):
    """(checkpoint, stepped NNX model): the tiny checkpoint loaded into NNX, one adam step."""
    from transformers import AutoConfig

    from orchestrator.trainer.jax_nnx import load_from_hf, make_batch, make_optimizer, train_step

    checkpoint = load_safetensors_dir(tiny_model_dir)
    model = load_from_hf(checkpoint, AutoConfig.from_pretrained(tiny_model_dir))
    batch = make_batch(*toy_batch)
    optimizer = make_optimizer(model, learning_rate=5e-3)
    loss = train_step(model, optimizer, batch)
    assert np.isfinite(float(loss))
    return checkpoint, model


@pytest.fixture(scope="module")
def llm(tiny_model_dir, stepped):
    # After `stepped`: the JAX step runs before the engine pins this process's thread to core 0.
    engine = inflight_llm(tiny_model_dir)
    yield engine
    del engine


def sample(llm) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    return tokens, [lp[t].logprob for t, lp in zip(tokens, out.logprobs)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, weights: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """A transformers forward of `weights` (fp32)."""
    missing, unexpected = hf_model.load_state_dict(weights, strict=False)
    assert not unexpected and not missing
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(PROMPT) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def nnx_logprobs(model, tokens: list[int]) -> torch.Tensor:
    from flax import nnx

    from orchestrator.trainer.jax_nnx import make_batch, token_logprobs

    batch = make_batch([PROMPT], [tokens], [0.0], pad_id=0)
    logp = np.asarray(nnx.jit(token_logprobs)(model, batch))[np.asarray(batch.completion)]
    return torch.from_numpy(np.array(logp))


def test_jax_step_published_into_a_live_engine(llm, stepped, hf_model, tmp_path):
    from orchestrator.trainer.jax_nnx import refit_map, to_hf, trainer_state
    from transports.factory import create_weight_synchronizer
    from transports.vllm_backend import LLMControl

    checkpoint, model = stepped
    weights = to_hf(model)
    assert set(weights) == set(checkpoint)
    moved = [k for k in checkpoint if not torch.equal(weights[k], checkpoint[k])]
    assert len(moved) == len(checkpoint), sorted(set(checkpoint) - set(moved))  # the step moved every tensor

    # fp32 on the wire: the engine receives the trainer's values exactly.
    sync = create_weight_synchronizer(
        state_dict=lambda: trainer_state(model), engines=[LLMControl(llm)], colocated=False,
        transport="filesystem", name_map=refit_map(model.cfg), wire_dtype=None, filesystem_root=tmp_path,
        bucket_bytes=256 << 10, timeout_s=60)
    try:
        sync.init_communicator()
        sync.mark_stale()
        version = sync.sync_weights()
        assert not sync.is_stale and version >= 1
        assert sorted(sync.prepare_refit_info()) == sorted(checkpoint)

        tokens, engine_lp = sample(llm)
        engine_lp = torch.tensor(engine_lp)
        want = hf_logprobs(hf_model, weights, tokens)
        err_hf = (engine_lp - want).abs().max().item()
        err_nnx = (engine_lp - nnx_logprobs(model, tokens).to(engine_lp.dtype)).abs().max().item()
        # ... and they are the step's: the weights before it give other logprobs.
        moved_lp = (engine_lp - hf_logprobs(hf_model, checkpoint, tokens)).abs().max().item()
        print(f"engine vs transformers {err_hf:.2e}, engine vs NNX {err_nnx:.2e}, vs pre-step {moved_lp:.2e}")
        assert err_hf <= TOL and err_nnx <= TOL
        assert moved_lp > 1e-2
    finally:
        sync.shutdown()
        llm.llm_engine.collective_rpc("shutdown_weight_transfer_engine")
