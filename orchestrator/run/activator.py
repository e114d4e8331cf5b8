"""The run loop's activator task (`orchestrator.run.loop.RunLoop`): each version the trainer
publishes goes live on the fleet, the newest first; what follows from the record (engines fenced,
the version live for the scheduler, the progress line, an evaluation due) is told to the loop;
failures are retried and, past `activation.max_failures` in a row, stop the run."""

from __future__ import annotations

import time

import anyio

from orchestrator.observe.logging import get_logger
from orchestrator.scheduling import scheduler as sch

log = get_logger("orchestrator.run.loop")  # its events keep the logger they had in the loop


async def run_activator(loop) -> None:
    """Activates the newest published version; a failed one is retried (newest wins), up to
    `activation.max_failures` in a row: then the run stops with the cause. Meanwhile
    `activation_failing` names the last failure (/healthz reports the run degraded)."""
    fleet = loop.run.fleet
    failures = 0
    loop.activation_failing = None
    while True:
        await loop._version_wanted.wait()
        loop._version_wanted = anyio.Event()
        version = loop.wanted_version
        if loop.stop_requested.is_set():  # stopping: no rollout would sample it
            return
        if version <= fleet.live_version:
            continue
        async with loop.activation_lock:  # never in the middle of a rejoin
            record = await fleet.activate(version)
        loop.run.record_activation(record)
        for eo in record.engines:
            if eo.outcome == "engine_fenced":
                loop.handle(sch.EngineDown(engine=eo.engine))
        loop._engines_fenced()  # also those fenced by a rolled-back activation
        if record.outcome in ("activated", "engine_fenced"):
            failures = 0
            loop.activation_failing = None
            loop.run.metrics.live_version.set(version)
            loop.run.progress.state.live_version = version
            loop.run.progress.state.last_activation = (
                f"v{version} {record.outcome} "
                f"(pause {max((e.pause_s for e in record.engines), default=0):.3f}s)")
            loop.handle(sch.VersionLive(version=version, at=time.monotonic()))
            loop.eval_wanted.set()
        else:
            failures += 1
            log.warning("activation.failed", version=version, outcome=record.outcome, message=record.message)
            if not fleet.coordinator.serving:
                loop.request_stop("no engine serves", failure="every engine is fenced")
                return
            cause = " | ".join(line.strip() for line in (record.message or "").splitlines() if line.strip())
            loop.activation_failing = f"version {version} {record.outcome}: {cause or 'no message'}"
            limit = loop.run.config.activation.max_failures
            if failures >= limit:
                loop.request_stop("activation failing", failure=(
                    f"activation failed {failures} times in a row (activation.max_failures = {limit}); "
                    f"last: {loop.activation_failing}"))
                return
            await anyio.sleep(min(30.0, 0.5 * 2 ** failures))
            loop._version_wanted.set()  # retry: the newest version wanted then
