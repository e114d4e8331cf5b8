"""`generation_ratio`: the orchestrator's rollout path against offline `vllm.LLM.generate`.

The same prompts (digits prompts of the model's chat template), the same engine settings
(`[engine]` of the embedded default: fp32, eager, max_num_seqs) and the same sampling (every
completion exactly `max_tokens` long: EOS ignored, so both generate the same number of tokens):
1. offline: `vllm.LLM.generate` of all prompts at once, in a child process (token ids and
   logprobs, no detokenization), after a warm-up batch;
2. the rollout path: one in-process engine (`InprocEngine`) under a `Fleet`, every prompt a
   rollout through `Fleet.generate` (what `inflight run` does for each rollout), all in flight.
Completion tokens/s of 2 over 1 is `generation_ratio` (goal >= 0.8). Measured in one run, one
after the other: this machine's speed varies about 2x from day to day.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

_OFFLINE = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
llm = LLM(model=args["model"], dtype="float32", enforce_eager=True, max_num_seqs=args["max_num_seqs"],
          max_model_len=args["max_model_len"], seed=0, disable_log_stats=True)
params = SamplingParams(max_tokens=args["max_tokens"], temperature=1.0, logprobs=0, ignore_eos=True,
                        detokenize=False)
llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
started = time.perf_counter()
outputs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - started
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print("RESULT " + json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)
"""


def prompts_for(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from orchestrator.config.run import TaskConfig
    from orchestrator.tasks import make_task

    task = make_task(TaskConfig(name="digits"), model_dir, tokenizer=AutoTokenizer.from_pretrained(model_dir))
    return [list(task.prompt_sync(i).token_ids) for i in range(n)]


def offline_rate(model_dir: str, prompts: list[list[int]], max_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> dict:
    args = json.dumps({"model": model_dir, "prompts": prompts, "max_tokens": max_tokens,
                       "max_num_seqs": max_num_seqs, "max_model_len": max_model_len})
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", VLLM_LOGGING_STREAM="ext://sys.stderr")
    proc = subprocess.run([sys.executable, "-c", _OFFLINE, args], capture_output=True, text=True, env=env,
                          timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"offline generation failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(line[len("RESULT "):])
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    return result


async def rollout_path_rate(model_dir: str, prompts: list[list[int]], max_tokens: int, max_num_seqs: int,
                            max_model_len: int, log_dir: Path) -> dict:
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines import make_engine
    from orchestrator.fleet.fleet import Fleet
    from replay.records import SamplingSettings

    engine = make_engine(EngineConfig(model=model_dir, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                      worker_extension_cls="transports.swap.SwapWorkerExtension"),
                         "gen-0", log_dir=log_dir)
    sampling = SamplingSettings(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    async with engine:
        fleet = Fleet([engine])

        async def run_all(batch: list[list[int]]) -> int:
            tokens = [0]

            async def one(i: int, prompt: list[int]) -> None:
                completion = await fleet.generate(prompt, sampling, request_id=f"gen-{time.monotonic_ns()}-{i}",
                                                  redispatch=False, final_only=True)
                tokens[0] += len(completion.token_ids)

            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(batch):
                    tg.start_soon(one, i, prompt)
            return tokens[0]

        await run_all(prompts[:8])  # warm-up
        started = time.perf_counter()
        tokens = await run_all(prompts)
        seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


async def generation_ratio(model_dir: str | None = None, n: int = 160, max_tokens: int = 64,
                           max_num_seqs: int = 128, max_model_len: int = 512, preset: str = "tiny-rl") -> dict:
    from orchestrator.model import ensure_model

    with tempfile.TemporaryDirectory(prefix="inflight-bench-gen-") as tmp:
        model = str(ensure_model(model_dir or Path(tmp) / preset, preset=preset))
        prompts = await anyio.to_thread.run_sync(prompts_for, model, n)
        offline = await anyio.to_thread.run_sync(offline_rate, model, prompts, max_tokens, max_num_seqs,
                                                 max_model_len)
        ours = await rollout_path_rate(model, prompts, max_tokens, max_num_seqs, max_model_len, Path(tmp))
    return {"generation_preset": preset if model_dir is None else model_dir, "generation_prompts": n, "generation_max_tokens": max_tokens, "generation_offline": offline,
            "generation_rollout_path": ours, "generation_ratio": ours["tokens_per_s"] / offline["tokens_per_s"]}
