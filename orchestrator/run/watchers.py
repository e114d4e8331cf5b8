"""The run loop's periodic watchers, each a task of its group: the progress guard's verdict
(`guard.ProgressGuard`: a run that cannot progress stops, naming why) and the event loop's lag
(the `loop_lag` gauge)."""

from __future__ import annotations

import time

import anyio

from orchestrator.observe.logging import get_logger

log = get_logger("orchestrator.run.loop")  # the events keep the logger they had in the loop


async def watch_progress(loop, every_s: float = 1.0) -> None:
    """A run that cannot progress stops, naming why (`guard.ProgressGuard`)."""
    while True:
        await anyio.sleep(every_s)
        scheduler = loop.run.scheduler
        verdict = loop.guard.verdict(time.monotonic(), trainer_busy=loop.batch is not None,
                                     waiting_on=f"rollouts for a batch ({scheduler.inflight} in flight)")
        if verdict is not None:
            log.error("run.no_progress", reason=verdict)
            loop.request_stop("no progress", failure=f"{verdict}; the full log: "
                                                     f"{loop.run.run_dir / 'orchestrator.jsonl'}")
            return


async def watch_loop_lag(metrics, every_s: float = 0.25) -> None:
    """How late the event loop wakes from a sleep of `every_s`: its lag, as a gauge."""
    while True:
        before = time.monotonic()
        await anyio.sleep(every_s)
        metrics.loop_lag.set(max(0.0, time.monotonic() - before - every_s))
