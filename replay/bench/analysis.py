"""`inflight bench replay-analysis`: recomputation speed against a plain batched forward.

A synthetic run is written to a scratch directory: a small random Qwen2 model (version 0) and a
replay log of rollouts with prompts and completions of mixed lengths. Then, over the same
tokens, in the same process:

- `recompute`: `inflight replay`'s recomputation (`analyze(..., target="0")`; its
  `timing.recompute_seconds`: batching, padding, forward, gather, copy back),
- `forward`: what a user would write by hand: batches of 16 rollouts in log order, right-padded
  with an attention mask, `model(input_ids, attention_mask).logits`, log_softmax, gather.

`recompute_ratio` = recompute tokens/s / forward tokens/s (goal >= 0.8); `end_to_end_ratio`
also counts reading the log, loading the weights and the statistics. Best of two runs each.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

GOAL = 0.8
PLAIN_BATCH = 16


def _model_dir(path: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return path


def _write_log(run_dir: Path, model_dir: Path, rollouts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from replay.log import FsyncPolicy, ReplayLog
    from replay.records import PolicyIdentity, RolloutRecord, RunMetaRecord, Timings

    rng = np.random.default_rng(0)
    identity = PolicyIdentity(base_checkpoint=str(model_dir), tokenizer_hash="", chat_template_hash="",
                              serving_precision="float32", logprobs_mode="raw_logprobs")
    sequences = []
    with ReplayLog.open(run_dir, fsync=FsyncPolicy.every(1000)) as log:
        log.append(RunMetaRecord(run_id="bench", created_at=time.time(), identity=identity,
                                 config={"model_dir": str(model_dir)}))
        for i in range(rollouts):
            prompt = rng.integers(3, 4096, int(rng.integers(16, 96)), dtype=np.int32)
            completion = rng.integers(3, 4096, int(rng.integers(32, 320)), dtype=np.int32)
            sequences.append((prompt, completion))
            log.append(RolloutRecord.from_lists(
                rollout_id=i, group_id=i // 8, prompt_id=f"p{i // 8}", engine_id="bench",
                prompt_token_ids=prompt, completion_token_ids=completion,
                completion_logprobs=np.full(len(completion), -8.3, np.float32), dispatched_version=0,
                identity=identity, timings=Timings(dispatched_at=time.time())))
    return sequences


def _plain_forward(model, sequences, device) -> float:
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(sequences), PLAIN_BATCH):
            batch = sequences[start:start + PLAIN_BATCH]
            width = max(len(p) + len(c) for p, c in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (p, c) in enumerate(batch):
                seq = torch.from_numpy(np.concatenate([p, c]).astype(np.int64))
                ids[row, :len(seq)] = seq
                mask[row, :len(seq)] = 1
            ids, mask = ids.to(device), mask.to(device)
            logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            for row, (p, c) in enumerate(batch):
                positions = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=device)
                logprobs[row, positions].gather(1, ids[row, positions + 1][:, None]).cpu()
    return time.perf_counter() - started


def run_bench(*, rollouts: int = 256, device: str | None = None,
              directory: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    import torch

    from replay.analysis.analyze import Options, analyze
    from replay.analysis.recompute import load_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="inflight-bench-replay-", dir=directory) as scratch:
        root = Path(scratch)
        model_dir = _model_dir(root / "model")
        sequences = _write_log(root / "run", model_dir, rollouts)
        tokens = sum(len(c) for _, c in sequences)
        model = load_model(model_dir, device)
        forward_s = min(_plain_forward(model, sequences, device) for _ in range(2))
        del model
        recompute_s, end_to_end_s = float("inf"), float("inf")
        for _ in range(2):
            started = time.perf_counter()
            report, _ = analyze(root / "run", Options(target="0", device=device))
            end_to_end_s = min(end_to_end_s, time.perf_counter() - started)
            recompute_s = min(recompute_s, report["timing"]["recompute_seconds"])
            assert report["tokens"] == tokens
    recompute_rate, forward_rate = tokens / recompute_s, tokens / forward_s
    ratio = recompute_rate / forward_rate
    return {
        "device": device, "rollouts": rollouts, "tokens": tokens,
        "model": "Qwen2 random, hidden 256, 4 layers, vocab 4096, fp32",
        "recompute_seconds": recompute_s, "forward_seconds": forward_s,
        "end_to_end_seconds": end_to_end_s,
        "recompute_tokens_per_s": recompute_rate, "forward_tokens_per_s": forward_rate,
        "recompute_ratio": ratio, "end_to_end_ratio": forward_s / end_to_end_s,
        "goal": GOAL, "met": ratio >= GOAL,
    }
