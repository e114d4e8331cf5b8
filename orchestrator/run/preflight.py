"""What `inflight run` checks before it starts anything (no engine, no trainer, no file written):
a config file given with `--resume` is the run's own, the model path can be a model directory,
and whether a resumed run has anything left to do.

A finished run is one whose replay log records the consumption of its last step (what
`inflight stats` shows). Reading the log costs what a resume costs anyway, so the trainer's
checkpoints (RUN_DIR/trainer/step-*) answer first where they can: with a checkpoint at every
step (`trainer.checkpoint`, `publish_every = 1`) the log cannot record a step the checkpoints
do not have, because a step's checkpoint is written before the orchestrator hears of the step.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from orchestrator.config.run import RunConfig
from orchestrator.errors import ConfigError

_ABSENT = object()


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of a config's builtins, e.g. {"scheduler.max_off_policy_steps": 4};
    lists of tables are indexed: "engines[1].url"."""
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for key, inner in value.items():
            out.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and any(isinstance(item, dict) for item in value):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def config_differences(given: RunConfig, stored: RunConfig) -> list[str]:
    """The dotted keys whose values differ between two configurations, sorted."""
    a, b = flatten(msgspec.to_builtins(given)), flatten(msgspec.to_builtins(stored))
    return sorted(k for k in a.keys() | b.keys() if a.get(k, _ABSENT) != b.get(k, _ABSENT))


def check_resume_config(given: RunConfig | None, stored: RunConfig, run_dir: Path) -> None:
    """A config file given with --resume must be the run's own: a resumed run continues with
    the configuration it started with, and silently ignoring an edited file would train
    something other than what the user asked for."""
    if given is None:
        return
    keys = config_differences(given, stored)
    if not keys:
        return
    shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    hint = " (--max-steps N changes the step count)" if "run.max_steps" in keys else ""
    raise ConfigError("--resume", f"the config given differs from {run_dir / 'config.json'} at {shown}: a resumed "
                                  f"run keeps its own configuration; leave the config file out to resume it, or "
                                  f"start a new run directory{hint}")


def check_model_paths(config: RunConfig) -> None:
    """A model path that exists must be a directory (a missing one is built: ensure_model)."""
    paths = [("engine.model", config.engine.model)]
    if isinstance(config.engines, list):
        paths += [(f"engines[{i}].model", e.model) for i, e in enumerate(config.engines) if e.model is not None]
    for field, path in paths:
        p = Path(path)
        if p.exists() and not p.is_dir():
            raise ConfigError(field, f"{p} is a file, not a model directory (a Hugging Face model directory, "
                                     f"or a path where `inflight model init` builds one)")


def finished_steps(run_dir: Path, config: RunConfig, max_steps: int) -> int | None:
    """The steps a run has done when it has reached `max_steps` (nothing left to do); None when
    steps remain, or when its log lacks a step its checkpoints or its step journal hold (the
    orchestrator died right after the trainer's last step: a resume records that step first;
    a journaled step is one the trainer finished as much as a checkpointed one)."""
    from orchestrator.trainer.checkpoint import complete_steps
    from orchestrator.trainer.step_journal import journaled_steps

    durable = max([*complete_steps(run_dir), *journaled_steps(run_dir)], default=0)
    every_step_durable = config.trainer.checkpoint and config.trainer.publish_every == 1
    if every_step_durable and durable < max_steps:
        return None
    consumed = consumed_steps(run_dir)
    if consumed < max_steps or consumed < durable:
        return None
    return consumed


def consumed_steps(run_dir: Path) -> int:
    """The newest trainer step whose consumption the replay log records (0: none)."""
    from replay.errors import LogNotFoundError
    from replay.log import read_records
    from replay.records import ConsumptionRecord

    try:
        return max((r.step for r in read_records(run_dir, lenient=True) if isinstance(r, ConsumptionRecord)),
                   default=0)
    except LogNotFoundError:
        return 0
