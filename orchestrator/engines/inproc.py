"""A vLLM `AsyncLLM` driven from this process (its engine core and worker are vLLM's own
child processes; vLLM 0.32 always runs AsyncLLM's core out of process)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Sequence

import anyio

from orchestrator.config.run import EngineConfig
from orchestrator.engines.adapter_stage import stage_adapter, unstage_adapter
from orchestrator.config.sampling import check_sampling
from orchestrator.engines.base import (
    PAUSE_MODES,
    SKIP_ISA_PROBE,
    AdapterRef,
    Engine,
    PauseMode,
    SamplingSettings,
    TokenChunk,
    VersionSpan,
    parse_version,
    vllm_max_loras,
)
from orchestrator.errors import (
    ConfigError,
    EngineDeadError,
    EngineGenerateError,
    EngineTimeoutError,
)
from orchestrator.model import check_model_dir
from orchestrator.observe.logging import get_logger
from transports.server_main import FORK_WORKER_ENV

log = get_logger(__name__)


def chunk_from_output(completion, finished: bool, prompt_token_ids=None) -> TokenChunk:
    """Convert one DELTA `CompletionOutput` of vLLM into a TokenChunk."""
    token_ids = list(completion.token_ids)
    logprobs: list[float] = []
    if completion.logprobs is not None:
        for token_id, entry in zip(token_ids, completion.logprobs):
            logprobs.append(float(entry[token_id].logprob))
    spans = None
    if finished and completion.weight_versions is not None:
        spans = [VersionSpan(parse_version(s.version), s.start, s.end) for s in completion.weight_versions]
    return TokenChunk(token_ids=token_ids, logprobs=logprobs, finished=finished,
                      finish_reason=completion.finish_reason if finished else None,
                      version_spans=spans, prompt_token_ids=prompt_token_ids if finished else None)


# How long vLLM waits for its engine core process to leave after SIGTERM before it kills it (and
# its worker). The core leaves in ~1.4 s (tiny-rl, idle machine) once its processes skip the final
# garbage collection at exit (transports.engine_signals.skip_final_gc_at_exit; before that it took
# ~5 s, and the 1 s wait here ended every run with three force-kill warnings and a leaked shared
# memory segment). A prompt exit returns at once; only a hung engine waits this out, then is killed.
CORE_EXIT_WAIT_S = 5.0


_core_env_holders: dict[str, int] = {}  # engines being started that set each key (event loop thread only)
_core_env_before: dict[str, str | None] = {}


@contextlib.contextmanager
def engine_core_env(key: str, value: str):
    """`key=value` in this process's environment while engine cores are spawned (each inherits it
    then), and as before once the last engine starting here is up. Left set, every process started
    from here later inherited it: FORK_WORKER_ENV made any vLLM child of such a process (a server
    the run starts, a test's subprocess) import vLLM's executor in its plugin hook, seconds each
    (measured: 0.1 s -> 8 s for a bare spawned child in the suite). Engines that start at the same
    time share the setting (one start method a run) and the last one out restores it."""
    if not _core_env_holders.get(key):
        _core_env_before[key] = os.environ.get(key)
    _core_env_holders[key] = _core_env_holders.get(key, 0) + 1
    os.environ[key] = value
    try:
        yield
    finally:
        _core_env_holders[key] -= 1
        if not _core_env_holders[key]:
            before = _core_env_before.pop(key, None)
            if before is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before


class InProcessEngine(Engine):
    def __init__(self, config: EngineConfig, engine_id: str = "engine-0") -> None:
        self.config = config.validate()
        self.engine_id = engine_id
        self._llm = None
        self._dead = False
        self._adapter_names: dict[int, str] = {}  # int id -> name, of adapters loaded here
        self.adapter_staged_at: dict[str, float] = {}  # adapter name -> when its staging was seen done

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._llm is not None:
            return
        check_model_dir(self.config.model)
        # Read by the CPU worker when it sizes its KV cache; must be set before it starts.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(self.config.kv_cache_gib)))
        for key, value in SKIP_ISA_PROBE.items():  # inherited by the engine core and worker
            os.environ.setdefault(key, value)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = dict(
            model=self.config.model,
            dtype=self.config.dtype,
            max_model_len=self.config.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            seed=self.config.seed,
            enforce_eager=self.config.enforce_eager,
            enable_prefix_caching=self.config.enable_prefix_caching,
            disable_log_stats=True,
        )
        if self.config.logprobs_mode:
            kwargs["logprobs_mode"] = self.config.logprobs_mode
        if self.config.enable_lora:
            # max_cpu_loras = max_loras: the fleet unloads what no request uses, so vLLM's own
            # cache never evicts (and later reloads from disk) an adapter a request still names.
            # One slot more than it serves: kept empty on a CPU engine (base.SPARE_LORA_SLOTS).
            slots = vllm_max_loras(self.config.max_loras)
            kwargs.update(enable_lora=True, max_lora_rank=self.config.max_lora_rank, max_loras=slots,
                          max_cpu_loras=slots)
        if self.config.worker_extension_cls:
            kwargs["worker_extension_cls"] = self.config.worker_extension_cls
        if self.config.weight_transfer_backend:
            from vllm.config import WeightTransferConfig

            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=self.config.weight_transfer_backend)
        args = AsyncEngineArgs(**kwargs)
        log.info("engine.starting", engine=self.engine_id, kind="inproc", model=self.config.model)
        try:
            with anyio.fail_after(self.config.start_timeout_s), \
                    engine_core_env(FORK_WORKER_ENV, "1" if self.config.start_method == "fork" else "0"):
                # Building the engine blocks (it spawns and waits for the core process).
                self._llm = await anyio.to_thread.run_sync(AsyncLLM.from_engine_args, args)
        except TimeoutError:
            raise EngineTimeoutError(self.engine_id, f"not ready within engine.start_timeout_s = "
                                                     f"{self.config.start_timeout_s}s") from None
        except (RuntimeError, ValueError, OSError) as exc:
            # vLLM refused the model or settings, or its engine core died starting (vLLM logs why
            # above): one named line for the user, not a traceback of our code.
            self._dead = True
            raise EngineDeadError(self.engine_id, f"failed to start on {self.config.model}: "
                                                  f"{type(exc).__name__}: {exc}") from exc
        await self.set_weight_version(0)
        log.info("engine.ready", engine=self.engine_id)

    async def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.control_timeout_s):
            _stop_output_handler(llm)
            await anyio.to_thread.run_sync(functools.partial(llm.shutdown, timeout=CORE_EXIT_WAIT_S))
        self._dead = True
        log.info("engine.stopped", engine=self.engine_id)

    # -- requests ---------------------------------------------------------------------------
    @property
    def llm(self):
        if self._llm is None:
            raise EngineDeadError(self.engine_id, "not started" if not self._dead else "shut down")
        return self._llm

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling: SamplingSettings, cache_salt: str | None = None,
                       final_only: bool = False, adapter: AdapterRef | None = None) -> AsyncIterator[TokenChunk]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead
        from vllm.v1.engine.exceptions import EngineGenerateError as VllmGenerate

        check_sampling(sampling)
        if not prompt_token_ids:
            raise ConfigError("prompt_token_ids", "must not be empty")
        # final_only: one output per request (no per-token Python work on the way); DELTA otherwise.
        kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
        # Token ids and logprobs only: no detokenization in vLLM's output processor (it runs in this
        # process, on the loop's core); text, where a task needs it, is decoded once at the end.
        # Stop strings need vLLM's text: with them, it detokenizes.
        params = SamplingParams(**sampling.to_vllm(), output_kind=kind, detokenize=bool(sampling.stop))
        prompt: dict = {"prompt_token_ids": list(prompt_token_ids)}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        stream = self.llm.generate(prompt, params, request_id, lora_request=_lora_request(adapter))
        try:
            while True:
                try:
                    with anyio.fail_after(self.config.chunk_timeout_s):
                        out = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise EngineTimeoutError(
                        self.engine_id, f"request {request_id}: no output for {self.config.chunk_timeout_s}s") from None
                except VllmDead as exc:
                    self._dead = True
                    why = "engine shut down" if self._llm is None else f"engine died ({exc})"  # shutdown() ends streams
                    raise EngineDeadError(self.engine_id, f"request {request_id}: {why}") from exc
                except VllmGenerate as exc:
                    raise EngineGenerateError(self.engine_id, f"request {request_id} failed: {exc.__cause__ or exc}") from exc
                except ValueError as exc:  # vLLM's validation of the request (bad token id, length)
                    raise EngineGenerateError(self.engine_id, f"request {request_id} rejected: {exc}") from exc
                yield chunk_from_output(out.outputs[0], out.finished, out.prompt_token_ids)
                if out.finished:
                    return
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def abort(self, request_id: str) -> None:
        with anyio.fail_after(self.config.control_timeout_s):
            await self.llm.abort(request_id)

    async def abort_many(self, request_ids: Sequence[str]) -> None:
        with anyio.fail_after(self.config.control_timeout_s):
            await self.llm.abort(list(request_ids))

    # -- LoRA adapters ------------------------------------------------------------------------
    async def load_adapter(self, adapter: AdapterRef) -> None:
        if not self.config.enable_lora:
            raise EngineGenerateError(self.engine_id, "LoRA is not enabled on this engine (engine.enable_lora)")
        self._adapter_names[adapter.int_id] = adapter.name  # before the call: it may load though cancelled
        try:
            if self.stages_adapters:  # read and built beside generation; add_lora only makes it live
                await stage_adapter(self, adapter, self.config.control_timeout_s)
            loaded = await self._control(self.llm.add_lora(_lora_request(adapter)), f"add_lora({adapter.name})")
        except (EngineDeadError, EngineTimeoutError):
            raise
        except EngineGenerateError:
            self._adapter_names.pop(adapter.int_id, None)
            raise
        except Exception as exc:  # vLLM refused the adapter (it raises a bare Exception from its worker)
            self._adapter_names.pop(adapter.int_id, None)
            raise EngineGenerateError(self.engine_id, f"adapter {adapter.name} at {adapter.path}: {exc}") from exc
        if loaded is False:
            raise EngineGenerateError(self.engine_id, f"adapter {adapter.name} at {adapter.path}: not loaded")

    @property
    def stages_adapters(self) -> bool:
        """Adapters are staged in the workers first (`engines.adapter_stage`): the swap extension is there."""
        return bool(self.config.worker_extension_cls)

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        if self.stages_adapters:  # a stage abandoned before add_lora leaves its adapter staged
            await unstage_adapter(self, adapter, self.config.control_timeout_s)
        await self._control(self.llm.remove_lora(adapter.int_id), f"remove_lora({adapter.name})")
        self._adapter_names.pop(adapter.int_id, None)

    async def loaded_adapters(self) -> list[str]:
        """The engine's own list (its integer ids), named as they were loaded here."""
        ids = await self._control(self.llm.list_loras(), "list_loras")
        return sorted(self._adapter_names.get(i, f"lora-id-{i}") for i in ids)

    # -- control ----------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError("pause.mode", f"must be one of {PAUSE_MODES}, got {mode!r}")
        await self._control(self.llm.pause_generation(mode=mode, clear_cache=clear_cache), "pause")

    async def resume(self) -> None:
        await self._control(self.llm.resume_generation(), "resume")

    async def is_paused(self) -> bool:
        return bool(await self._control(self.llm.is_paused(), "is_paused"))

    async def set_weight_version(self, version: int) -> None:
        await self._control(self.llm.update_weight_version(str(int(version))), "update_weight_version")

    async def reset_prefix_cache(self) -> None:
        await self._control(self.llm.reset_prefix_cache(), "reset_prefix_cache")

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                             timeout: float | None = None) -> list:
        return await self._control(
            self.llm.collective_rpc(method, args=args, kwargs=kwargs or {}),
            f"collective_rpc({method})", timeout=timeout)

    async def healthy(self) -> bool:
        if self._llm is None or self._dead:
            return False
        try:
            with anyio.fail_after(self.config.control_timeout_s):
                await self._llm.check_health()
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            self._dead = True
            return False
        return not self._llm.errored

    async def _control(self, awaitable, what: str, timeout: float | None = None):
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

        limit = timeout or self.config.control_timeout_s
        try:
            with anyio.fail_after(limit):
                return await awaitable
        except TimeoutError:
            raise EngineTimeoutError(self.engine_id, f"{what} did not answer within {limit}s") from None
        except VllmDead as exc:
            self._dead = True
            raise EngineDeadError(self.engine_id, f"{what}: engine died ({exc})") from exc


def _stop_output_handler(llm) -> None:
    """Stop AsyncLLM's output handler before its engine core is stopped. `AsyncLLM.shutdown` (run in
    a thread) cancels the handler only at its very end, after the core has exited or been killed
    and the client (marked dead) has closed its sockets; meanwhile the handler, still reading on
    this loop, can get the dead core's last word or a closed socket and log "AsyncLLM
    output_handler failed" with an EngineDeadError traceback (seen at the end of a successful run
    under load, when the core was force-killed). Nothing reads outputs of a stopping engine; a
    request still streaming is told at once that the engine is gone, as the handler's failure
    would have told it (without this, it waited out chunk_timeout_s)."""
    from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

    handler = getattr(llm, "output_handler", None)
    if handler is not None and not handler.done():
        handler.cancel()
    processor = getattr(llm, "output_processor", None)
    if processor is not None:
        processor.propagate_error(VllmDead("the engine was shut down"))


def _lora_request(adapter: AdapterRef | None):
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.int_id, adapter.path)
