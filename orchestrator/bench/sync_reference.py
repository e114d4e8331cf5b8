"""The plain synchronous GRPO loop that `inflight bench time-to-reward` races against:
`python -m orchestrator.bench.sync_reference --model DIR --config-json JSON [--target R]`.

One process, no engine, no orchestrator: each step samples the batch with transformers
`generate()` from the current weights (left-padded, all prompts x group_size at once, plain
temperature-1 sampling, no top-k/top-p), scores it with the run's own task, and takes one
optimizer step with the trainer's own `train_step` (same loss, advantages, clipping, Adam).
That is what TRL's `GRPOTrainer` step reduces to with one generation per step; every sample is
on-policy (staleness 0). The behaviour logprobs are the generating forward's own, so the
importance weight is 1 up to float noise.

Prints one JSON line per step (`step`, `reward`, `t_s`: seconds since this process began,
`generate_s`, `train_s`), then a summary line (`"summary": true`). It uses every core this
process may run on (torch threads), as TRL would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import msgspec
import numpy as np


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, list) else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def sample_batch(model, prompts: list[list[int]], group_size: int, max_tokens: int, pad_id: int,
                 eos: set[int]) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, completion ids, logprobs) for each prompt x group_size, in prompt order. A
    completion ends at its first EOS (kept, as an engine returns it) or at max_tokens."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention[row, width - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=max_tokens, num_return_sequences=group_size,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=pad_id,
                             eos_token_id=sorted(eos) or None)
    new = out.sequences[:, width:]
    logprobs = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in out.logits], dim=1)
    picked = logprobs.gather(-1, new[:, :logprobs.shape[1], None]).squeeze(-1)
    samples = []
    for row in range(new.shape[0]):
        ids = new[row].tolist()
        end = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        samples.append((prompts[row // group_size], ids[:end], picked[row, :end].tolist()))
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.bench.sync_reference")
    p.add_argument("--model", required=True)
    p.add_argument("--config-json", required=True, help="a RunConfig as JSON (task, sampling, scheduler, trainer)")
    p.add_argument("--target", type=float, default=0.9, help="stop at the first step whose batch reward reaches it")
    p.add_argument("--max-steps", type=int, default=60)
    args = p.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.config.run import RunConfig
    from orchestrator.tasks import make_task
    from orchestrator.trainer.link import Sample
    from orchestrator.trainer.step import train_step

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    config = msgspec.json.decode(args.config_json, type=RunConfig).validate()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(config.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.trainer.lr, weight_decay=config.trainer.weight_decay)
    pad = model.config.pad_token_id
    pad_id = int(pad) if pad is not None else int(tokenizer.eos_token_id or 0)
    eos = _eos_ids(model, tokenizer)
    task = make_task(config.task, args.model, tokenizer=tokenizer)
    sc = config.scheduler
    index = 0
    reached = None
    for step in range(1, args.max_steps + 1):
        prompts = [task.prompt_sync(index + g) for g in range(sc.batch_groups)]
        index += sc.batch_groups
        t0 = time.perf_counter()
        drawn = sample_batch(model, [list(p.token_ids) for p in prompts], sc.group_size,
                             config.sampling.max_tokens, pad_id, eos)
        generate_s = time.perf_counter() - t0
        samples = []
        for i, (prompt_ids, completion, logprobs) in enumerate(drawn):
            reward = task.score_sync(prompts[i // sc.group_size], completion)["reward"]
            samples.append(Sample(rollout_id=i, group_id=i // sc.group_size,
                                  prompt_token_ids=np.asarray(prompt_ids, "<i4").tobytes(),
                                  completion_token_ids=np.asarray(completion, "<i4").tobytes(),
                                  logprobs=np.asarray(logprobs, "<f4").tobytes(),
                                  reward=float(reward), dispatched_version=step - 1))
        t1 = time.perf_counter()
        result = train_step(model, optimizer, samples, config.trainer, pad_id, step=step, temperature=1.0,
                            device=torch.device("cpu"))
        line = {"step": step, "reward": result.reward_mean, "t_s": round(_age(), 3), "generate_s": round(generate_s, 4),
                "train_s": round(time.perf_counter() - t1, 4)}
        print(json.dumps(line), flush=True)
        if result.reward_mean >= args.target:
            reached = line
            break
    print(json.dumps({"summary": True, "reached": reached is not None,
                      "steps_to_target": reached["step"] if reached else None,
                      "s_to_target": reached["t_s"] if reached else None}), flush=True)
    return 0


def _age() -> float:
    from orchestrator.run.startup import process_age_s

    age = process_age_s()
    if age is None:
        raise RuntimeError("this benchmark times from the process's start, which /proc does not tell here")
    return age


if __name__ == "__main__":
    sys.exit(main())
