"""The trainer's efficient paths compute what the plain one does: the head applied in chunks
to the completion positions only (`completion_logprobs`, split path), micro-batches by token
budget with gradient accumulation (`train_step`, `train_step_sharded`), bf16 and the device
option; and a measurement of peak memory and step time before and after on the `small` preset."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.run import RunConfig, TrainerConfig, TransportConfig
from orchestrator.errors import ConfigError
from orchestrator.trainer import loss as loss_module
from orchestrator.trainer.link import Batch, Sample, StepDone, pack_f32, pack_i32
from orchestrator.trainer.loss import PackedBatch, completion_logprobs, logprob_path
from orchestrator.trainer.step import micro_batches, train_step

pytestmark = [pytest.mark.timeout(300), pytest.mark.light_lane]

REPO = Path(__file__).resolve().parents[2]
# Prompt and completion lengths of the test batch: every sample a different length, one
# completion empty (its log ratio is NaN, and stays in its place).
SHAPES = [(3, 9), (12, 20), (5, 0), (7, 14), (4, 3), (9, 17), (6, 1), (10, 11)]


def _load(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _full(model):
    """The same model, pinned to the full forward: the plain computation the others must equal."""
    reference = copy.deepcopy(model)
    setattr(reference, loss_module._PATH_ATTR, "full")
    return reference


def _samples(model, shapes=SHAPES, group_size: int = 4, seed: int = 0) -> list[Sample]:
    """Random tokens; recorded logprobs = the model's own + noise (ratios near 1, some past
    is_cap); rewards varied within each group."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    reference = _full(model)
    out = []
    for j, (p, c) in enumerate(shapes):
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        completion = torch.randint(3, vocab, (c,), generator=g).tolist()
        with torch.no_grad():
            logp = completion_logprobs(reference, PackedBatch([prompt], [completion], pad_id=0))
        recorded = logp + 0.4 * torch.randn(len(logp), generator=g)
        out.append(Sample(rollout_id=100 + j, group_id=j // group_size, prompt_token_ids=pack_i32(prompt),
                          completion_token_ids=pack_i32(completion), logprobs=pack_f32(recorded.tolist()),
                          reward=float(torch.rand((), generator=g)), dispatched_version=0))
    return out


def _step(model, samples, lr: float = 1e-4, temperature: float = 1.0, **config):
    """train_step with Adam; (result, gradients after clipping, weights after the step)."""
    tc = TrainerConfig(lr=lr, **config)
    optimizer = torch.optim.Adam(model.parameters(), lr=tc.lr)
    result = train_step(model, optimizer, samples, tc, pad_id=0, step=1, temperature=temperature)
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    return result, grads, weights


def _assert_same_step(got, want, atol: float = 1e-5) -> None:
    (r, grads, weights), (r0, grads0, weights0) = got, want
    assert r.loss == pytest.approx(r0.loss, abs=atol)
    assert r.metrics.keys() == r0.metrics.keys()
    for key, value in r0.metrics.items():
        assert r.metrics[key] == pytest.approx(value, abs=atol), key
    assert r.rollout_ids == r0.rollout_ids and r.advantages == r0.advantages
    for mine, theirs in ((r.log_ratio_mean, r0.log_ratio_mean), (r.log_ratio_max_abs, r0.log_ratio_max_abs)):
        assert np.array_equal(np.isnan(mine), np.isnan(theirs))  # the empty completion, in its place
        assert np.allclose(mine, theirs, atol=atol, equal_nan=True)
    for name, g0 in grads0.items():
        assert torch.allclose(grads[name], g0, atol=atol, rtol=0), name
    for name, w0 in weights0.items():
        assert torch.allclose(weights[name], w0, atol=atol, rtol=0), name


# -- micro-batch plans (pure) ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 200))
def test_micro_batches_cover_every_sample_once_within_the_budget_by_length(lengths, budget):
    plan = micro_batches(lengths, budget)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        padded = len(mb) * max(lengths[i] for i in mb)
        assert padded <= budget or len(mb) == 1  # a sample longer than the budget goes alone
        assert [lengths[i] for i in mb] == sorted((lengths[i] for i in mb), reverse=True)
    # Bucketed: a later micro-batch holds no sample longer than an earlier one's shortest.
    for a, b in zip(plan, plan[1:]):
        assert min(lengths[i] for i in a) >= max(lengths[i] for i in b)


def test_no_budget_is_one_micro_batch_in_batch_order():
    assert micro_batches([5, 9, 2], None) == [[0, 1, 2]]
    assert micro_batches([5, 9, 2, 9], 18) == [[1, 3], [0, 2]]
    assert micro_batches([5, 30, 2], 10) == [[1], [0, 2]]  # 30 alone; 2 x 5 fits
    assert micro_batches([5, 30, 2], 9) == [[1], [0], [2]]


def test_a_budget_below_one_token_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as raised:
        TrainerConfig(micro_batch_tokens=0).validate()
    assert raised.value.field == "trainer.micro_batch_tokens"


# -- logprobs: split and chunked against the full forward ------------------------------------


def test_the_tiny_model_takes_the_split_path_with_the_attention_transformers_picks(tiny_model_dir):
    model = _load(tiny_model_dir)
    assert model.config._attn_implementation == "sdpa"
    assert logprob_path(model) == "split"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [1, 5, None])
def test_chunked_logprobs_and_their_gradients_equal_the_full_forward(tiny_model_dir, chunk_tokens, temperature):
    model = _load(tiny_model_dir)
    reference = _full(model)
    samples = _samples(model)
    prompts = [list(np.frombuffer(s.prompt_token_ids, "<i4")) for s in samples]
    completions = [list(np.frombuffer(s.completion_token_ids, "<i4")) for s in samples]
    batch = PackedBatch(prompts, completions, pad_id=0)
    n = int(batch.completion.sum())
    weights = torch.randn(n, generator=torch.Generator().manual_seed(1)) / n  # a token mean, as the losses are

    results = []
    for m, chunk in ((model, chunk_tokens), (reference, None)):
        logp = completion_logprobs(m, batch, temperature, chunk_tokens=chunk)
        (logp * weights).sum().backward()
        results.append((logp.detach(), {k: p.grad for k, p in m.named_parameters()}))
    (logp, grads), (logp0, grads0) = results
    assert logp.dtype == torch.float32 and logp.shape == logp0.shape == (sum(c for _, c in SHAPES),)
    assert torch.allclose(logp, logp0, atol=1e-5, rtol=0)
    for name, g0 in grads0.items():
        assert torch.allclose(grads[name], g0, atol=1e-5, rtol=0), name


def test_a_model_whose_logits_are_not_head_of_body_takes_the_full_forward(tiny_model_dir):
    model = _load(tiny_model_dir)
    scaled = copy.deepcopy(model)
    forward = scaled.forward

    def doubled_logits(*args, **kwargs):  # a transform after the head that no config names
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    scaled.forward = doubled_logits
    assert logprob_path(scaled) == "full"
    capped = copy.deepcopy(model)
    capped.config.final_logit_softcapping = 30.0  # named by the config: not even tried
    assert logprob_path(capped) == "full" and not hasattr(capped, loss_module.SPLIT_METHOD)
    batch = PackedBatch([[5, 6, 7]], [[8, 9]], pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits[0, 2:4] * 2.0
        want = torch.log_softmax(logits, -1)[torch.arange(2), torch.tensor([8, 9])]
        assert torch.allclose(completion_logprobs(scaled, batch), want, atol=1e-5)


# -- micro-batched steps against the whole batch ------------------------------------------


@pytest.mark.parametrize("loss", ["tis", "ppo", "icepop", "plain"])
def test_micro_batched_chunked_steps_equal_the_whole_batch_full_forward_step(tiny_model_dir, loss):
    """Budgets: none, larger than the batch, a few samples each, and 20 tokens, below the longest
    sample (32): every metric, the per-rollout log ratios, every gradient and the weights after
    one Adam step match the plain step (whole batch, full forward) to 1e-5.

    lr 1e-4: Adam's first step is lr * g / (|g| + eps); gradient elements of ~1e-8 (the rounding
    noise of a sum of terms ~1e-2) move by lr x their relative rounding error, whatever the
    summation order: at lr 1e-3 up to 2.4e-5 here, for any reordering, micro-batches or not."""
    model = _load(tiny_model_dir)
    samples = _samples(model)
    want = _step(_full(model), samples, loss=loss, temperature=0.8)
    lengths = [p + c for p, c in SHAPES]
    assert len(micro_batches(lengths, 64)) == 3 and 20 < max(lengths)
    for budget in (None, 10_000, 64, 20):
        got = _step(copy.deepcopy(model), samples, loss=loss, temperature=0.8, micro_batch_tokens=budget)
        _assert_same_step(got, want)


# -- dtype and device --------------------------------------------------------------------------


def _trainer(run_dir, model_dir, **trainer):
    from orchestrator.trainer.process import Trainer

    config = RunConfig(trainer=TrainerConfig(threads=1, **trainer), transport=TransportConfig(keep_last=4)).validate()
    return Trainer(str(run_dir), str(model_dir), config)


def test_a_bfloat16_trainer_computes_in_bf16_and_publishes_the_engines_fp32(tmp_path, tiny_model_dir):
    from tests.helpers import load_safetensors_dir

    trainer = _trainer(tmp_path / "run", tiny_model_dir, dtype="bfloat16", micro_batch_tokens=40)
    try:
        assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
        trainer.start(resume=False)
        samples = _samples(_load(tiny_model_dir))
        done = trainer.handle(Batch(step=1, samples=samples))
        assert isinstance(done, StepDone) and done.version == 1 and math.isfinite(done.loss)
        published = load_safetensors_dir(tmp_path / "run" / "weights" / "v00000001")
        state = trainer.model.state_dict()
        assert published.keys() == state.keys()
        for name, tensor in published.items():
            # The engine's dtype (float32 by default), holding exactly the trainer's bf16 values.
            assert tensor.dtype == torch.float32, name
            assert torch.equal(tensor, state[name].float()), name
    finally:
        trainer.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_trainer_without_a_cuda_device_is_a_config_error_naming_trainer_device(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError) as raised:
        _trainer(tmp_path / "run", tiny_model_dir, device="cuda")
    assert raised.value.field == "trainer.device"


# -- FSDP2: two gloo ranks, micro-batched, against one process ----------------------------


def _rank_main(rank: int, port: int, model_dir: str, samples_path: str, out_dir: str, budget) -> None:
    import datetime

    import torch.distributed as dist

    from orchestrator.trainer.ranks import Ranks, shard
    from orchestrator.trainer.step import train_step_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    try:
        ranks = Ranks(rank, 2, rank)
        model = shard(_load(model_dir), ranks, torch.device("cpu"))
        tc = TrainerConfig(lr=1e-4, micro_batch_tokens=budget)
        optimizer = torch.optim.Adam(model.parameters(), lr=tc.lr)
        samples = torch.load(samples_path, weights_only=False)
        result = train_step_sharded(model, optimizer, samples, tc, 0, ranks, step=1, temperature=0.8)
        path = logprob_path(model)
        weights = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective: every rank
        if rank == 0:
            torch.save({"result": msgspec.structs.asdict(result), "weights": weights, "path": path},
                       os.path.join(out_dir, "rank0.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 20])
def test_a_sharded_micro_batched_step_equals_one_process(tmp_path, tiny_model_dir, budget):
    """Rank 0 holds samples 0-3, rank 1 samples 4-7 (SHAPES): with a budget of 20 tokens the ranks
    run 4 and 3 micro-batches, so rank 1 adds one idle pass; the split path runs as an FSDP2
    forward method (the root's parameters gathered around it)."""
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    model = _load(tiny_model_dir)
    samples = _samples(model)
    torch.save(samples, tmp_path / "samples.pt")
    mp.spawn(_rank_main, args=(free_port(), str(tiny_model_dir), str(tmp_path / "samples.pt"), str(tmp_path), budget),
             nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert got["path"] == "split"
    result, _, weights0 = _step(_full(model), samples, temperature=0.8)
    sharded = got["result"]
    assert sharded["loss"] == pytest.approx(result.loss, abs=1e-5)
    for key, value in result.metrics.items():
        assert sharded["metrics"][key] == pytest.approx(value, abs=1e-5), key
    assert np.allclose(sharded["log_ratio_mean"], result.log_ratio_mean, atol=1e-5, equal_nan=True)
    for name, w0 in weights0.items():
        assert torch.allclose(got["weights"][name], w0, atol=1e-5, rtol=0), name


# -- measurement: peak memory and step time, before and after (small preset) ---------------


def _old_completion_logprobs(model, batch, temperature=1.0):
    """The computation before the split path (commit a18be66): the full forward, then an fp32
    copy of every completion position's logits and their log-softmax."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logits = logits[batch.completion].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch.targets[batch.completion]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def measure(model_dir: str, mode: str, budget: int | None, samples: int = 32, step: bool = True) -> dict:
    """In a fresh process, after one unmeasured pass: the resident high-water mark above the
    resident size before (heap trimmed, mark reset: /proc), wall and CPU seconds of (a)
    `logprob`: forward and backward of the loss, every micro-batch, no optimizer step, and (b)
    `step`: a whole `train_step`; on `samples` samples of prompt 16 + completion 64, one thread.
    Adam's state exists before either (allocated by a zero-gradient step). `mode`: "before" (the
    old computation), "after", or "hf": a transformers forward and backward of the same batch
    with its own LM loss (the issue's yardstick; no step). `step=False` measures (a) alone."""
    import ctypes
    import resource
    import time

    from orchestrator.trainer import step as step_module
    from transports.rss import reset_hwm, status_bytes

    torch.set_num_threads(1)
    model = _load(model_dir)
    batch = _bench_samples(model, samples)
    tc = TrainerConfig(lr=1e-5, micro_batch_tokens=budget)
    optimizer = torch.optim.Adam(model.parameters(), lr=tc.lr)
    for p in model.parameters():  # Adam's state, before anything is measured (the update is 0)
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    if mode == "before":
        step_module.completion_logprobs = _old_completion_logprobs
    passes = {"logprob": lambda: _logprob_pass(model, batch, tc, step_module)}
    if mode == "hf":
        passes = {"logprob": lambda: _hf_pass(model, batch)}
    elif step:
        passes["step"] = lambda: train_step(model, optimizer, batch, tc, pad_id=0, step=1)
    out = {"mode": mode, "budget": budget, "path": logprob_path(model) if mode == "after" else mode,
           "vocab": model.config.vocab_size, "parameters": sum(p.numel() for p in model.parameters())}
    # Unmeasured: the first pass also sets up the kernels' own buffers (hundreds of MiB the
    # first time, on either path).
    passes["logprob"]()
    for name, run in passes.items():
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: it cannot hide new peaks
        assert reset_hwm(), "needs a writable /proc/self/clear_refs"
        base = status_bytes("VmRSS")
        cpu0, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        run()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        out[f"{name}_s"] = round(time.perf_counter() - started, 2)
        out[f"{name}_cpu_s"] = round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2)
        out[f"{name}_peak_extra_mib"] = round((status_bytes("VmHWM") - base) / 2**20, 1)
    return out


def _bench_samples(model, count: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def tokens(n: int) -> bytes:
        return pack_i32(torch.randint(3, vocab, (n,), generator=g).tolist())

    return [Sample(rollout_id=j, group_id=j // 4, prompt_token_ids=tokens(16), completion_token_ids=tokens(64),
                   logprobs=pack_f32([-8.0] * 64), reward=float(j % 3), dispatched_version=0) for j in range(count)]


def _logprob_pass(model, samples, tc, step_module) -> None:
    data = step_module._unpack(samples, tc)
    plan = micro_batches(data.lengths, tc.micro_batch_tokens)
    step_module._accumulate(model, data, list(range(len(samples))), plan, tc, 0, 1.0, torch.device("cpu"),
                            scale=1.0 / data.tokens)
    model.zero_grad(set_to_none=True)


def _hf_pass(model, samples) -> None:
    prompts = [list(np.frombuffer(s.prompt_token_ids, "<i4")) for s in samples]
    completions = [list(np.frombuffer(s.completion_token_ids, "<i4")) for s in samples]
    batch = PackedBatch(prompts, completions, pad_id=0)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss.backward()
    model.zero_grad(set_to_none=True)


def _wide_vocab_model(out_dir: Path) -> Path:
    """tiny's body with Qwen2's vocabulary (151,936): where the logits, not the body, dominate."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151_936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    return out_dir


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_chunked_logprob_pass_peaks_far_lower_with_a_large_vocabulary(tmp_path):
    """Memory only (time depends on the machine's load and is never asserted): tiny's body with
    Qwen2's vocabulary, 16 samples of prompt 16 + completion 64 (the logprob pass alone: the whole
    step's row is not asserted, so not measured), each row in a fresh process with
    glibc's mmap threshold fixed at 64 KiB (every tensor its own mapping, unmapped when freed:
    the resident high-water mark is then the live tensors' peak, not the allocator's leftovers).
    The `small` preset's rows of docs/trainer.md come from the same `measure` (too slow for the
    suite: `python -c "from tests.unit.test_trainer_efficiency import measure; ..."`)."""
    wide = _wide_vocab_model(tmp_path / "wide")
    rows = {}
    for mode in ("before", "after"):
        code = ("import json; from tests.unit.test_trainer_efficiency import measure; "
                f"print(json.dumps(measure({str(wide)!r}, {mode!r}, None, samples=16, step=False)))")
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "MALLOC_MMAP_THRESHOLD_": "65536"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(mode, json.dumps(rows[mode]))
    assert rows["after"]["path"] == "split"
    # measured 1,804 MiB before, 395 after (32 samples: 3,608 and 418): the fp32 [tokens, vocab] logits are gone
    assert rows["after"]["logprob_peak_extra_mib"] < rows["before"]["logprob_peak_extra_mib"] / 3
