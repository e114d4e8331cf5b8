"""The engine interface the rest of inflight-rl uses, over a real vLLM.

An `Engine` takes prompt token ids and sampling settings and streams back `TokenChunk`s: the
sampled token ids, the logprob of each sampled token, and, on the final chunk, the engine's
per-token weight versions (vLLM reports `WeightVersionSpan`s when a request finishes). It can
abort one request, pause (abort / wait / keep) and resume, report health, and shut down.

Implementations: `inproc.InProcessEngine` (vLLM `AsyncLLM` in this process) and
`server.ServerEngine` (a vLLM OpenAI-compatible server process, started here or attached to by
URL). Every remote call carries a timeout; a dead engine raises `EngineDeadError`.
"""

from __future__ import annotations

import abc
import json
from collections.abc import AsyncIterator, Sequence
from typing import Literal

import msgspec

from orchestrator.errors import EngineGenerateError
from replay.records import SamplingSettings

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")


class VersionSpan(msgspec.Struct, frozen=True, array_like=True):
    """Output tokens [start, end) were sampled under policy `version`."""

    version: int
    start: int
    end: int


#: Slots a LoRA engine we start gets past its `max_loras`: vLLM's CPU LoRA kernels read the last
#: slot for every token of a request without an adapter that shares a batch with one that has one
#: (index -1 into the stacked weights), so that slot is kept empty (`transports.lora_stage`).
SPARE_LORA_SLOTS = 1


def vllm_max_loras(max_loras: int) -> int:
    """vLLM's `max_loras` (and `max_cpu_loras`) for an engine that serves `max_loras` adapters."""
    return max_loras + SPARE_LORA_SLOTS


class AdapterRef(msgspec.Struct, frozen=True):
    """A LoRA adapter as an engine serves it: a name unique to one set of weights (vLLM keys
    its prefix cache by it), an integer id (the in-process engine's), and its PEFT directory."""

    name: str
    int_id: int
    path: str


class TokenChunk(msgspec.Struct):
    """New tokens of one request. The last chunk has `finished=True` and, when the engine
    reported them, the version spans covering every output token of the request."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: str | None = None
    version_spans: list[VersionSpan] | None = None
    # On the last chunk, where the engine reports it: the prompt token ids it ran (a multi-turn
    # episode checks each turn's prompt against the tokens it sent).
    prompt_token_ids: list[int] | None = None


class Completion(msgspec.Struct):
    """A whole completion, assembled from its chunks (see `collect`)."""

    request_id: str
    engine_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int] | None
    finish_reason: str | None

    @property
    def version_spans(self) -> list[VersionSpan]:
        return spans_from_versions(self.versions or [])


def parse_version(label: str | int | None) -> int:
    """vLLM labels versions with strings; ours are integers ("default" is the initial weights)."""
    if label is None or label == "default":
        return 0
    try:
        return int(label)
    except (TypeError, ValueError):
        raise ValueError(f"weight version label {label!r} is not an integer") from None


def versions_from_spans(spans: Sequence[VersionSpan], n_tokens: int) -> list[int]:
    """Expand spans to one version per token, checking that they cover exactly n_tokens."""
    out: list[int] = []
    for span in spans:
        if span.start != len(out) or span.end < span.start:
            raise ValueError(f"version spans are not contiguous at token {len(out)}: {spans}")
        out.extend([span.version] * (span.end - span.start))
    if len(out) != n_tokens:
        raise ValueError(f"version spans cover {len(out)} tokens, the completion has {n_tokens}")
    return out


def spans_from_versions(versions: Sequence[int]) -> list[VersionSpan]:
    spans: list[VersionSpan] = []
    for i, v in enumerate(versions):
        if spans and spans[-1].version == v:
            spans[-1] = VersionSpan(v, spans[-1].start, i + 1)
        else:
            spans.append(VersionSpan(v, i, i + 1))
    return spans


# torch's inductor checks the CPU's vector ISA once per process by compiling a probe and dlopen-ing
# it in a child Python; in an engine worker under load that child was seen to hang for its full
# 60 s (twice on 2026-12-01: the engine's first requests stalled, "VecISA dlopen probe for avx512
# hung after 60s"). The ISAs are still taken from the CPU's own flags (cpuid); only the probe is
# skipped. A user's own setting wins.
SKIP_ISA_PROBE = {"TORCHINDUCTOR_VEC_ISA_OK": "1"}


class Engine(abc.ABC):
    """One inference engine. Safe to call from one asyncio event loop."""

    engine_id: str

    @abc.abstractmethod
    async def start(self) -> None:
        """Start (or attach to) the engine and wait until it serves; idempotent."""

    @abc.abstractmethod
    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling: SamplingSettings, cache_salt: str | None = None,
                 final_only: bool = False, adapter: AdapterRef | None = None) -> AsyncIterator[TokenChunk]:
        """Stream the completion of one request. Raises EngineGenerateError when the request
        fails, EngineDeadError when the engine is gone, EngineTimeoutError past the
        per-chunk timeout. A request aborted with `abort()` ends with finish_reason "abort".

        Requests reuse cached prefixes only from requests with the same `cache_salt`; the
        fleet salts with the dispatched version so that no new request reads keys/values
        computed under older weights. `final_only` asks for one chunk at the end (an engine
        may still stream). `adapter`: sample with this loaded LoRA adapter (None: the base)."""

    async def load_adapter(self, adapter: AdapterRef) -> None:
        """Load a LoRA adapter beside those serving (no pause); needs engine.enable_lora."""
        raise EngineGenerateError(self.engine_id, f"{type(self).__name__} cannot load LoRA adapters")

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        """Unload an adapter no request uses any more."""
        raise EngineGenerateError(self.engine_id, f"{type(self).__name__} cannot unload LoRA adapters")

    async def loaded_adapters(self) -> list[str]:
        """The names of the adapters the engine holds now (its own answer)."""
        return []

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort one request; others continue."""

    async def abort_many(self, request_ids: Sequence[str]) -> None:
        """Abort these requests in one call where the engine allows it (both of ours do)."""
        for request_id in request_ids:
            await self.abort(request_id)

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        """Stop scheduling. `keep` holds in-flight requests, `wait` lets them finish first,
        `abort` aborts them."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def is_paused(self) -> bool: ...

    @abc.abstractmethod
    async def healthy(self) -> bool:
        """True when the engine answers; never raises."""

    @abc.abstractmethod
    async def set_weight_version(self, version: int) -> None:
        """Label tokens sampled from now on with `version`."""

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Forget cached prefixes so no new request reuses keys/values of older weights."""

    @abc.abstractmethod
    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                             timeout: float | None = None) -> list:
        """Call a worker(-extension) method on every worker; returns one result per worker."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine (and any process this object started); idempotent."""

    async def leaving(self) -> bool:
        """True when the engine was told to stop and is draining (a server's SIGTERM): it
        finishes what it holds and refuses anything new. Never raises."""
        return False

    async def identity(self) -> dict:
        """What the engine serves, as its workers see it (`transports.swap` `swap_identity`):
        model, tokenizer, dtype, logprobs mode, LoRA. A joiner's is checked against the run's."""
        results = await self.collective_rpc("swap_identity")
        first = results[0] if isinstance(results, list) and results else results
        return json.loads(first) if isinstance(first, str) else dict(first)

    async def complete(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling: SamplingSettings) -> Completion:
        """Generate one request to its end and assemble the completion."""
        return await collect(self, request_id, prompt_token_ids, sampling)

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


async def collect(engine: Engine, request_id: str, prompt_token_ids: Sequence[int],
                  sampling: SamplingSettings) -> Completion:
    tokens: list[int] = []
    logprobs: list[float] = []
    finish_reason: str | None = None
    spans: list[VersionSpan] | None = None
    async for chunk in engine.generate(request_id, prompt_token_ids, sampling):
        tokens.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
        if chunk.finished:
            finish_reason = chunk.finish_reason
            spans = chunk.version_spans
    versions = versions_from_spans(spans, len(tokens)) if spans is not None else None
    return Completion(request_id=request_id, engine_id=engine.engine_id,
                      prompt_token_ids=list(prompt_token_ids), token_ids=tokens,
                      logprobs=logprobs, versions=versions, finish_reason=finish_reason)
