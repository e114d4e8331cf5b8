"""`inflight bench orchestrator` key `join_to_first_rollout_s`: an engine joining a busy fleet.

The real `RunLoop` and its fleet keeper drive 16 fake engines (`fake_engine` of
`orchestrator/bench/orchestrator.py`, paced like a real engine's stream) at 256 rollouts in
flight; a 17th joins the way `inflight fleet add` brings one in (`FleetKeeper.enter`: into the
fleet fenced, the live version staged beside the others' generation, the switch under the
activation lock, then rollouts). The joiner's staging RPCs (stage, status) take JOIN_RPC_S each
(its transfer: about half a trainer step of STEP_S), so the catch-up is long enough to watch the
others; its switch is instant, as a staged copy's is. A joiner whose transfer outlasts a step
finds a newer version live each time it is done; after PRESTAGE_ROUNDS it stages under the
activation lock, costing one activation that wait.

* `join_to_first_rollout_s`: from the join's start to the joiner's first finished rollout.
* `catch_up_s`: from the join's start to the joiner serving (the live version switched in).
* `others_rate_during_join_ratio`: rollouts/s finished by the other engines while the joiner
  caught up, over their rate in as long a window just before (goal >= 0.8: a join costs the fleet
  nothing but its own time).
* `activations_during_join` and `activation_max_ms_during_join`: versions that went live while it
  caught up, and the longest of those activations (the joiner holds no activation up).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import anyio

ENGINES = 16
CONCURRENCY = 256
JOIN_RPC_S = 0.25  # each swap RPC of the joiner: its transfer and status polls
CHUNK_DELAY_S = 0.005
WARM_S = 5.0
STEP_S = 1.0  # the fake trainer's step: a version goes live about every second  # the fake engines' stream: a chunk of 16 tokens every 5 ms


async def join_to_first_rollout(run_cls, make_engine, engines: int = ENGINES, concurrency: int = CONCURRENCY) -> dict:
    from orchestrator.run.loop import RunLoop

    with tempfile.TemporaryDirectory(prefix="inflight-bench-join-") as tmp:
        run = run_cls(Path(tmp), concurrency, 10**7, engines=engines, chunk_delay_s=CHUNK_DELAY_S)
        loop = RunLoop(run)
        run.loop = loop
        run.trainer.step_s = STEP_S
        await run.fleet.setup("{}", tmp)  # the transport a joiner's swap_init repeats
        activations: list[tuple[float, float]] = []  # (ended at, seconds)
        real_activate = run.fleet.activate

        async def timed_activate(version, **kwargs):
            started = time.perf_counter()
            record = await real_activate(version, **kwargs)
            activations.append((time.perf_counter(), time.perf_counter() - started))
            return record

        run.fleet.activate = timed_activate
        finished: list[tuple[float, str]] = []  # (at, engine) of every finished rollout
        run.fleet.on_outcome = lambda c: finished.append((time.perf_counter(), c.engine_id))
        await run.scorer.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(loop.main, run.scheduler.start())
                with anyio.fail_after(300):
                    while run.scheduler.done_steps < 2:
                        await anyio.sleep(0.05)
                await anyio.sleep(WARM_S)  # the window before the join is the steady state
                joiner = make_engine(f"fake-{engines}", chunk_delay_s=CHUNK_DELAY_S, swap_delay_s=JOIN_RPC_S,
                                     delayed=("swap_stage", "swap_status"))
                started = time.perf_counter()
                answer = await loop.keeper.enter(joiner, source="bench")
                serving_at = time.perf_counter()
                with anyio.fail_after(300):
                    while not any(engine == joiner.engine_id for _, engine in finished):
                        await anyio.sleep(0.005)
                first_at = next(at for at, engine in finished if engine == joiner.engine_id)
                loop.request_stop("done")
        finally:
            await run.scorer.aclose()
            await run.recorder.flush()
            run.recorder.close()
            run.journal.close()
    window = serving_at - started
    others = [at for at, engine in finished if engine != joiner.engine_id]
    during = sum(started <= at < serving_at for at in others) / window
    before = sum(started - window <= at < started for at in others) / window
    joined_activations = [s for end, s in activations if started <= end <= serving_at]
    return {"join_to_first_rollout_s": first_at - started, "catch_up_s": answer["catch_up_s"],
            "others_rate_during_join_ratio": during / before if before else None,
            "activations_during_join": len(joined_activations),
            "activation_max_ms_during_join": 1e3 * max(joined_activations) if joined_activations else None,
            "join_engines": engines, "join_concurrency": concurrency, "join_rpc_s": JOIN_RPC_S}
