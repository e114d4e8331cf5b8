"""What a run starts with, once its trainer is ready (`Run`): its meta record (`config_as_run`:
the config as it runs) and, on --resume, what the log, the dispatch journal (`resume.py`) and
the trainer say, reconciled: consumptions the trainer finished after the orchestrator died,
crashed records for rollouts in flight then, the completed rollouts restored into their groups."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import msgspec

from orchestrator.observe.logging import get_logger
from orchestrator.run.records import consumption_record, crashed_record
from orchestrator.run.resume import ResumeState, load_resume_state

log = get_logger("orchestrator.run.run")  # its events keep the logger they had in the run


def config_as_run(run) -> dict:
    """The config as the run uses it, for run_meta: the activation the fleet performs (a LoRA
    run's is "adapter", whatever the file says) and each engine's settings after what
    [trainer.lora], [fleet] and [cluster] set on them (`engines_as_run`)."""
    config = msgspec.to_builtins(run.config)
    config["activation"] = {**config["activation"], "strategy": run.fleet.strategy,
                            "kv_policy": run.fleet.coordinator.kv_policy}
    config["engines_as_run"] = [{"id": engine_id, **msgspec.to_builtins(engine)}
                                for engine_id, engine in run.config.engine_configs()]
    return config


async def restore(run, ready) -> ResumeState:
    """At a run's start (`Run`, once its trainer is ready): a fresh run writes its meta record; a
    resumed one reconciles log, journal and trainer."""
    from replay.log import read_records
    from replay.records import RunMetaRecord

    meta = RunMetaRecord(run_id=run.run_id, created_at=time.time(), identity=run.identity,
                         config={**config_as_run(run), "resumed": run.resume,
                                 "model_dir": str(Path(run.config.engine.model).resolve())})
    if not run.resume:
        run.recorder.submit(meta)
        return ResumeState()
    records = await anyio.to_thread.run_sync(lambda: list(read_records(run.run_dir)))
    run.recorder.preload(records)
    run.recorder.submit(meta)
    state = load_resume_state(run.run_dir, records)
    missing = missed_consumptions(run.run_dir, state, ready.step)
    for message in missing:
        record = consumption_record(message)
        run.recorder.submit(record)
        records.append(record)
    if missing:
        state = load_resume_state(run.run_dir, records)
    for entry in state.lost:
        prompt = await run.task.prompt(entry.group_id)
        run.recorder.submit(crashed_record(entry, prompt, identity=run.identity, sampling=run.sampling))
    run.loop.restore_completed(state.records)
    log.info("run.resumed", step=ready.step, version=ready.version, lost=len(state.lost),
             restored_groups=len(state.restored), recovered_consumptions=len(missing))
    return state


def missed_consumptions(run_dir, state: ResumeState, trainer_step: int) -> list:
    """Steps the trainer finished after the orchestrator died: their consumption is in the
    trainer's checkpoint or journal entry (written before the version is published)."""
    from orchestrator.trainer.step_journal import consumption_of

    out = []
    for step in range(max(state.consumed_steps, default=0) + 1, trainer_step + 1):
        message = consumption_of(run_dir, step)
        if message is not None:
            out.append(message)
    return out
