"""What a resumed trainer does after it restored its newest checkpoint: train the journaled steps
after it again (`step_journal`), and continue from the weights the engines served.

A replayed step comes out bit for bit the same on the same machine and thread count, but not
always (GPU kernels, another thread count). Its version was published already, and engines
served it: a version number never names two sets of weights. So after each replayed step whose
version is still published (`transport.keep_last`; the newest always is), its weights are
compared with the published ones and, where they differ, replaced by them (`Publisher.load`,
bit for bit; `trainer.replay_differs` in trainer.log names the version and the largest
difference). The optimizer's state (Adam's moments) stays the re-derived one: the state that
produced the published weights is not kept anywhere, and the re-derived one is the nearest the
trainer has. A version lost between its journal entry and its publish (no COMPLETE: no engine
served it) is published from the re-derived weights, as before.

Progress: before each replayed step the trainer sends `Replaying(step, index, total)` over the
link (the orchestrator bounds each by trainer.step_timeout_s, `launcher`) and logs
`trainer.replay_step` when it is done.

`INFLIGHT_FAULT_REPLAY_PERTURB` (tests only): every replayed step's weights are shifted by that
amount (a float), so that they differ from the published ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from orchestrator.observe.logging import get_logger
from orchestrator.trainer import checkpoint, ledger, step_journal
from orchestrator.trainer.link import Replaying

log = get_logger("orchestrator.trainer")

PERTURB_REPLAY = "INFLIGHT_FAULT_REPLAY_PERTURB"


def replay(trainer, steps: list[int], progress: Callable[[Replaying], None] | None = None) -> None:
    """Train the journaled `steps` again on `trainer` (a `process.Trainer`), each on its own batch
    and consuming what it did the first time; where a published version's weights came out
    otherwise, continue from the published ones."""
    started = time.perf_counter()
    differed: dict[int, float] = {}
    last: tuple[int, int, float] | None = None  # (version, tensors, max |diff|) of the last compared
    for index, step in enumerate(steps, 1):
        if progress is not None:
            progress(Replaying(step=step, index=index, total=len(steps)))
        t0 = time.perf_counter()
        entry = step_journal.read(trainer.run_dir, step)
        result = trainer._train(entry.batch)
        if result.rollout_ids != entry.meta.consumption.rollout_ids:
            raise checkpoint.CheckpointError(f"journal entry {step_journal.step_path(trainer.run_dir, step)}: trained "
                                             "again, the step consumed other rollouts than it recorded")
        trainer.step, trainer.resumed = step, True
        _perturb_for_tests(trainer.model)
        if entry.published and trainer.publisher.is_complete(step):
            compared, diff = trainer.publisher.compare(step)
            last = (step, compared, diff)
            if diff != 0.0:  # NaN too
                differed[step] = diff
                served_weights(trainer, step, diff)
        log.info("trainer.replay_step", step=step, index=index, total=len(steps),
                 seconds=round(time.perf_counter() - t0, 3))
    log.info("trainer.replayed", steps=steps, seconds=round(time.perf_counter() - started, 3),
             compared_version=last[0] if last else None, compared_tensors=last[1] if last else 0,
             max_abs_diff=last[2] if last else None, restored_published=sorted(differed))


def served_weights(trainer, version: int, diff: float) -> None:
    """The model takes published `version`'s weights, which the re-derived ones missed by `diff`."""
    trainer.publisher.load(version)
    compared, after = trainer.publisher.compare(version)
    if after != 0.0:
        raise checkpoint.CheckpointError(f"published version {version} loaded into the trainer still differs from "
                                         f"its files by {after}: the trainer cannot continue from it")
    log.warning("trainer.replay_differs", version=version, max_abs_diff=diff, compared_tensors=compared,
                action="continuing from the published weights; the optimizer state is the re-derived one")


def _perturb_for_tests(model) -> None:
    shift = os.environ.get(PERTURB_REPLAY)
    if not shift:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point():
                p.add_(float(shift))
    log.warning("trainer.replay_perturbed", shift=float(shift), hook=PERTURB_REPLAY)


def record_published(trainer, version: int) -> None:
    """Note in the ledger which weights `version` names (one process only: see `ledger`)."""
    if trainer.ranks.sharded:
        return
    digest, tensors = ledger.model_digest(trainer.model)
    ledger.record(trainer.run_dir, version, digest, tensors)


def check_republish(trainer, version: int) -> None:
    """Before `version` is published again (its files were lost before COMPLETE): the weights
    held now must be the ones the ledger says it names, if it names any."""
    if not trainer.ranks.sharded:
        ledger.check(trainer.run_dir, version, ledger.model_digest(trainer.model)[0])
