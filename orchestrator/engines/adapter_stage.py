"""Staging a LoRA adapter in an engine's workers before vLLM's load makes it live.

An engine whose workers carry the swap extension (`engine.worker_extension_cls`, as every
`inflight run` engine does) asks each worker to read and build the adapter on a thread beside
generation (`transports.lora_stage`: `lora_stage`, then `lora_status` until it is staged), and
only then calls vLLM's own load (`add_lora`, or a server's `/v1/load_lora_adapter`), which finds
the adapter built and only registers it and copies it into a slot: the engine step it runs
between no longer reads files or builds tensors. Each poll is one RPC, answered between two
engine steps.
"""

from __future__ import annotations

import json
import time

import anyio

from orchestrator.engines.base import AdapterRef
from orchestrator.errors import EngineGenerateError, EngineTimeoutError

#: First and longest wait between two polls of the workers' staging state.
POLL_FIRST_S = 0.01
POLL_MAX_S = 0.1


async def stage_adapter(engine, adapter: AdapterRef, timeout_s: float) -> float:
    """Stages `adapter` on every worker of `engine`; returns the longest worker's staging
    seconds. A worker that cannot build it raises EngineGenerateError naming the adapter and
    vLLM's reason (nothing of it is held then); EngineTimeoutError past `timeout_s`."""
    # "slots": what the engine serves; a CPU worker holding more keeps its last slot empty.
    request = json.dumps({"name": adapter.name, "int_id": adapter.int_id, "path": adapter.path,
                          "slots": engine.config.max_loras})
    which = json.dumps({"path": adapter.path})
    try:
        with anyio.fail_after(timeout_s):
            await engine.collective_rpc("lora_stage", (request,), timeout=timeout_s)
            delay = POLL_FIRST_S
            while True:
                states = await engine.collective_rpc("lora_status", (which,), timeout=timeout_s)
                failed = [s for s in states if s["state"] in ("failed", "absent")]
                if failed:
                    why = failed[0]["error"] or "its staging was forgotten (staged again elsewhere?)"
                    raise EngineGenerateError(engine.engine_id, f"adapter {adapter.name} at {adapter.path}: {why}")
                if all(s["state"] == "staged" for s in states):
                    # When the off-step work was seen done: the flip window of `inflight bench
                    # activation`'s lora row starts here, as the pause-free row's at its staged copy.
                    engine.adapter_staged_at[adapter.name] = time.monotonic()
                    return max(float(s["seconds"]) for s in states)
                await anyio.sleep(delay)
                delay = min(2 * delay, POLL_MAX_S)
    except TimeoutError:
        raise EngineTimeoutError(engine.engine_id, f"adapter {adapter.name} not staged within {timeout_s}s") from None


async def unstage_adapter(engine, adapter: AdapterRef, timeout_s: float) -> None:
    """Forgets whatever the workers staged for `adapter` (a load abandoned or refused)."""
    await engine.collective_rpc("lora_unstage", (json.dumps({"path": adapter.path}),), timeout=timeout_s)
