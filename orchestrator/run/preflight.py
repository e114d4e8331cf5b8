"""What `inflight run` checks before it starts anything (no engine, no trainer, no file written but
the lock a run holds on its directory):
a config file given with `--resume` is the run's own, the model path can be a model directory,
whether a resumed run has anything left to do, and whether a directory that holds a run's config
holds anything of it (a run whose set-up failed leaves none: the next run may take the directory).
One process runs in a directory at a time: RUN_DIR/run.lock (`hold_run_dir`).

A finished run is one whose replay log records the consumption of its last step (what
`inflight stats` shows). Reading the log costs what a resume costs anyway, so the trainer's
checkpoints (RUN_DIR/trainer/step-*) answer first where they can: with a checkpoint at every
step (`trainer.checkpoint`, `publish_every = 1`) the log cannot record a step the checkpoints
do not have, because a step's checkpoint is written before the orchestrator hears of the step.
"""

from __future__ import annotations

import fcntl
import os
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


RUN_LOCK = "run.lock"
_HELD: set[int] = set()  # the run.lock descriptors this process holds


def _close_held_in_child() -> None:
    # A process forked from a run (an in-process engine's core, with engine.start_method = "fork")
    # must not keep the directory locked after the run has ended: its copy of the descriptor would.
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def hold_run_dir(run_dir: Path) -> int:
    """Lock RUN_DIR/run.lock (flock, exclusive) and return its descriptor: held until
    `release_run_dir` (or the process ends, however it ends). Another process's run there is
    refused, naming the directory: two runs in one directory would interleave their journals and
    overwrite its config."""
    fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError("--run-dir", f"{run_dir} is in use by a run in progress (its {RUN_LOCK} is held); "
                                       "wait for it to end or choose another directory") from None
    except BaseException:
        os.close(fd)
        raise
    _HELD.add(fd)
    return fd


def release_run_dir(fd: int) -> None:
    _HELD.discard(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)  # for every copy of it a child may still hold
    finally:
        os.close(fd)


def refuse_a_run_dir_in_use(run_dir: Path) -> None:
    """Refused, as `hold_run_dir` refuses, while another process runs in the directory."""
    if (run_dir / RUN_LOCK).exists():
        release_run_dir(hold_run_dir(run_dir))


def holds_rollouts(run_dir: Path) -> bool:
    """Whether a run directory holds anything of a run's rollouts or steps: a dispatch journalled,
    a frame in the replay log (a torn one included: a resume recovers it), a published version.
    A run whose set-up failed (a typo in its config, a task that would not build, an engine that
    would not start) or was interrupted during it leaves none of these."""
    from orchestrator.run.resume import JOURNAL
    from orchestrator.trainer.publish import weights_root
    from replay.log.framing import LOG_SUBDIR, SEGMENT_HEADER

    journal = run_dir / JOURNAL
    if journal.exists() and journal.stat().st_size > 0:
        return True
    if any(segment.stat().st_size > SEGMENT_HEADER.size for segment in (run_dir / LOG_SUBDIR).glob("*.seg")):
        return True
    weights = weights_root(run_dir)
    return weights.is_dir() and any(weights.iterdir())


def refuse_a_run_dir_holding_a_run(run_dir: Path) -> None:
    """A new run (no --resume) may take a directory with nothing of a run in it (`holds_rollouts`)."""
    if holds_rollouts(run_dir):
        raise ConfigError("--run-dir", f"{run_dir} already holds a run; use --resume to continue it "
                                       "or choose another directory")

