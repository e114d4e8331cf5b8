"""`inflight generate`: sample a group of completions and print tokens, logprobs and versions."""

from __future__ import annotations

import argparse
import json
import sys

import anyio

from orchestrator.config.run import EngineConfig
from orchestrator.config.sampling import check_sampling
from orchestrator.engines import make_engine
from orchestrator.engines.base import Completion, SamplingSettings
from orchestrator.errors import ConfigError
from orchestrator.model import check_model_dir


def encode_prompt(model_dir: str, text: str, raw: bool) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if raw or not tokenizer.chat_template:
        return tokenizer.encode(text, add_special_tokens=False)
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


async def run_generate(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise ConfigError("-n", f"must be >= 1, got {args.n}")
    sampling = check_sampling(SamplingSettings(max_tokens=args.max_tokens, temperature=args.temperature,
                                               seed=args.seed))
    check_model_dir(args.model)
    prompt_ids = encode_prompt(args.model, args.prompt, args.raw)
    engine = make_engine(EngineConfig(model=args.model, kind=args.engine))
    results: list[Completion] = []
    async with engine:
        async def one(i: int) -> None:
            seed = None if sampling.seed is None else sampling.seed + i
            s = SamplingSettings(**{**_fields(sampling), "seed": seed})
            results.append(await engine.complete(f"generate-{i}", prompt_ids, s))

        async with anyio.create_task_group() as tg:
            for i in range(args.n):
                tg.start_soon(one, i)
    results.sort(key=lambda c: c.request_id)
    show(args, prompt_ids, results)
    return 0


def _fields(s: SamplingSettings) -> dict:
    import msgspec

    return msgspec.structs.asdict(s)


def show(args: argparse.Namespace, prompt_ids: list[int], results: list[Completion]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.json:
        for c in results:
            print(json.dumps({"request_id": c.request_id, "prompt_token_ids": prompt_ids,
                              "token_ids": c.token_ids, "logprobs": c.logprobs,
                              "versions": c.versions, "finish_reason": c.finish_reason,
                              "text": tokenizer.decode(c.token_ids)}))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, soft_wrap=True)
    console.print(f"prompt: {len(prompt_ids)} tokens, {len(results)} completions, engine={args.engine}")
    for c in results:
        spans = ", ".join(f"v{s.version}[{s.start}:{s.end})" for s in c.version_spans)
        console.print(f"\n[bold]{c.request_id}[/bold]  finish={c.finish_reason}  "
                      f"sum logprob={sum(c.logprobs):.3f}  versions: {spans or 'unreported'}")
        console.print(repr(tokenizer.decode(c.token_ids)))
        table = Table("i", "token", "text", "logprob", "version", box=None, pad_edge=False)
        for i, tok in enumerate(c.token_ids):
            version = "-" if c.versions is None else str(c.versions[i])
            table.add_row(str(i), str(tok), repr(tokenizer.decode([tok])), f"{c.logprobs[i]:.4f}", version)
        console.print(table)
