"""`inflight eval RUN_DIR|MODEL_DIR [CONFIG] [--version V]`: the run's held-out evaluation, standalone.

On a run directory it evaluates a retained version (exported to a temporary Hugging Face
directory first, `orchestrator.commands.export_model`) with the run's own config unless CONFIG is given;
on a model directory it evaluates that model with CONFIG's [eval] and [task]. It starts one
in-process engine, samples `samples_per_prompt` completions of each eval prompt, and prints the
same object `inflight stats --json` lists under `eval` (one line of JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import anyio
import msgspec

from orchestrator.errors import ConfigError
from orchestrator.run.eval import describe


def register(sub) -> None:
    ev = sub.add_parser("eval", help="held-out evaluation (mean@k, pass@k) of a run's version or a model directory",
                        description="Evaluate a run's version (or a model directory) on the [eval] task of a config.")
    ev.add_argument("target", help="a run directory (its versions) or a Hugging Face model directory")
    ev.add_argument("config", nargs="?", help="TOML config whose [eval] and [task] to use (default: the run's own)")
    ev.add_argument("--version", default="latest", help="with a run directory: latest (default) or a version number")
    ev.add_argument("--samples-per-prompt", "-k", type=int, help="override eval.samples_per_prompt")
    ev.add_argument("--max-prompts", type=int, help="override eval.max_prompts")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    return anyio.run(_main, args)


async def _main(args: argparse.Namespace) -> int:
    target = Path(args.target)
    config = _config(args, target)
    with tempfile.TemporaryDirectory(prefix="inflight-eval-") as tmp:
        is_run = (target / "config.json").is_file() and (target / "replay").is_dir()
        if is_run:
            from orchestrator.commands.export_model import export_model

            version = args.version if args.version == "latest" else _int(args.version)
            # merge: a LoRA run's version is an adapter; the engine evaluates base + adapter merged
            exported = await anyio.to_thread.run_sync(
                lambda: export_model(target, version, out_dir=Path(tmp) / "model", merge=True))
            model_dir, version_number = str(exported.path), exported.version
        else:
            if args.version != "latest":
                raise ConfigError("--version", "only meaningful with a run directory")
            from orchestrator.model import check_model_dir

            model_dir, version_number = str(check_model_dir(target)), 0
        record = await evaluate_model(config, model_dir, version_number, Path(tmp), config_path=args.config,
                                      run_dir=target if is_run else None)
    # standalone, no trainer step is known: only the version
    out = {"step": None, "version": record.version, "task": record.task, "k": record.k,
           "mean_at_k": record.mean_at_k, "pass_at_k": record.pass_at_k, "prompts": record.prompts,
           "pass_threshold": record.pass_threshold, "components": record.components, "model": str(target),
           "versions": record.versions, "mixed": record.mixed}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{target} v{version_number}  {record.task}: {describe(record)}  ({record.prompts} prompts, "
              f"{record.seconds:.1f}s)")
    return 0


def _config(args: argparse.Namespace, target: Path):
    from orchestrator.config.run import RunConfig, load_config

    if args.config:
        config = load_config(args.config)
    elif (target / "config.json").is_file():
        config = msgspec.json.decode((target / "config.json").read_bytes(), type=RunConfig).validate()
    else:
        raise ConfigError("config", f"{target} is not a run directory: give a TOML config with [eval] and [task]")
    changes = {}
    if args.samples_per_prompt is not None:
        changes["samples_per_prompt"] = args.samples_per_prompt
    if args.max_prompts is not None:
        changes["max_prompts"] = args.max_prompts
    if changes:
        config = msgspec.structs.replace(config, eval=msgspec.structs.replace(config.eval, **changes)).validate()
    return config


async def evaluate_model(config, model_dir: str, version: int, log_dir: Path, config_path: str | None = None,
                         run_dir: Path | None = None):
    """One evaluation of `model_dir` with one in-process engine (the run's engine settings)."""
    from orchestrator.engines import make_engine
    from orchestrator.fleet.fleet import Fleet
    from orchestrator.run.eval import Evaluator
    from orchestrator.run.run import run_sampling
    from orchestrator.scoring.scorer import Scorer
    from orchestrator.tasks import make_task
    from orchestrator.tasks.entrypoint import SEARCH_PATH_FILE, search_path

    task_config = config.eval.task_config(config.task)
    paths = search_path(config_path)
    if run_dir is not None:  # where the run found the task's modules
        stored = run_dir / SEARCH_PATH_FILE
        paths += json.loads(stored.read_text()) if stored.is_file() else []
    task = await anyio.to_thread.run_sync(lambda: make_task(task_config, model_dir, search_path=paths, where="eval"))
    sampling, logprobs_mode = run_sampling(config)
    engine_config = msgspec.structs.replace(config.engine, model=model_dir, kind="inproc", url=None,
                                            logprobs_mode=logprobs_mode)
    engine = make_engine(engine_config, "eval-0", log_dir=log_dir)
    evaluator = Evaluator(task, Scorer(task, workers=task_config.score_workers, timeout_s=task_config.score_timeout_s),
                          config.eval, sampling)
    await evaluator.load()
    async with engine:
        await engine.set_weight_version(version)  # its tokens carry the version they were sampled by
        fleet = Fleet([engine], live_version=version)
        # one version, no activation: every token carries `version`; nothing else to serve, so
        # more requests at once than a run's eval.max_inflight
        return await evaluator.run(fleet, step=0, version=version, concurrency=max(64, config.eval.max_inflight))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError("--version", f"must be 'latest' or a version number, got {text!r}") from None
