"""Sub-commands of the orchestrator package: `model init`, `generate` (and later `run`).

`register` stays light: heavy imports (torch, vLLM) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import sys


def register(sub, bench_sub) -> None:
    model = sub.add_parser("model", help="build local models")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    init = model_sub.add_parser(
        "init", help="build a Qwen2-architecture model with random weights and a locally trained tokenizer")
    init.add_argument("dir", help="output directory (must not exist or be empty)")
    init.add_argument("--seed", type=int, default=0, help="weights seed; the same seed gives identical files")
    init.add_argument("--preset", choices=sorted(__import__("orchestrator.model", fromlist=["PRESETS"]).PRESETS), default="tiny",
                      help="tiny: ~0.5M parameters (tests); small: ~70M (benchmarks)")
    init.set_defaults(func=cmd_model_init)

    gen = sub.add_parser("generate", help="a smoke test: sample completions and show tokens, logprobs, versions")
    gen.add_argument("--model", required=True, help="model directory (see: inflight model init)")
    gen.add_argument("--prompt", required=True, help="prompt text (wrapped in the chat template unless --raw)")
    gen.add_argument("-n", type=int, default=2, help="completions of the prompt (a GRPO group)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--engine", choices=["inproc", "server"], default="inproc")
    gen.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per completion")
    gen.set_defaults(func=cmd_generate)
    run = sub.add_parser("run", help="the orchestrator: rollouts in flight while a trainer steps (GRPO)",
                         description="Run asynchronous RL: engines, trainer, task, replay log, live /stats. "
                                     "With no CONFIG, the embedded default: the tiny-rl model on one CPU "
                                     "engine learning the digits task.")
    run.add_argument("config", nargs="?", help="TOML config (see examples/default.toml); default: embedded")
    run.add_argument("--run-dir", help="run directory (default: run.dir of the config, runs/default)")
    run.add_argument("--max-steps", type=int, help="trainer steps to run (default: run.max_steps)")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --run-dir after a crash or a stop (its config.json is used)")
    run.set_defaults(func=cmd_run)
    export = sub.add_parser("export-model", help="one policy version of a run as a Hugging Face model directory",
                            description="Write version V of the run in RUN_DIR (0: the base model) as a Hugging "
                                        "Face directory (config, safetensors, tokenizer, chat template, a model "
                                        "card) that transformers and vLLM load.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (inflight run --run-dir)")
    export.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (must not exist, or be empty)")
    export.add_argument("--version", default="latest", metavar="latest|V",
                        help="the version to export: latest (default: the newest the run holds) or a number")
    export.add_argument("--merge", action="store_true",
                        help="LoRA runs: write the base model with the version's adapter merged in (a full "
                             "model directory) instead of the adapter directory")
    export.set_defaults(func=cmd_export_model)
    __import__("orchestrator.commands.eval", fromlist=["register"]).register(sub)
    __import__("orchestrator.commands.fleet", fromlist=["register"]).register(sub)
    __import__("orchestrator.bench.activation", fromlist=["register"]).register(bench_sub)
    __import__("orchestrator.bench.orchestrator", fromlist=["register"]).register(bench_sub)
    __import__("orchestrator.bench.time_to_reward", fromlist=["register"]).register(bench_sub)
    __import__("orchestrator.bench.cluster", fromlist=["register"]).register(bench_sub)
    __import__("orchestrator.bench.engine_start", fromlist=["register"]).register(bench_sub)


def cmd_model_init(args: argparse.Namespace) -> int:
    from orchestrator.model import build_model

    out, n_params = build_model(args.dir, preset=args.preset, seed=args.seed)
    print(f"{out}\t{n_params} parameters ({args.preset}, seed {args.seed})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import anyio

    from orchestrator.commands.generate import run_generate

    return anyio.run(run_generate, args)


def cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import anyio

    from orchestrator.config.run import load_config
    from orchestrator.observe.logging import log_to_file
    from orchestrator.run.run import Run

    config = load_config(args.config) if args.config else None
    run = Run(config, args.run_dir, resume=args.resume, max_steps=args.max_steps)
    run.config_path = args.config  # its directory is searched for the task's modules
    run.run_dir.mkdir(parents=True, exist_ok=True)
    log_to_file(Path(run.run_dir) / "orchestrator.jsonl", args.log_level)
    return anyio.run(run.main)


def cmd_export_model(args: argparse.Namespace) -> int:
    from orchestrator.commands.export_model import export_model

    result = export_model(args.run_dir, args.version, out_dir=args.out_dir, merge=args.merge)
    form = "" if result.form == "model" else f", {result.form}"
    print(f"{result.path}\tversion {result.version} ({result.source}{form}: {result.source_path})")
    if result.note:  # weights no engine served under this version, or not known: said plainly
        print(f"inflight: warning: {result.note}", file=sys.stderr)
    return 0
