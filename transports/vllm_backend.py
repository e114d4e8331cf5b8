"""The receiving end of every transport, registered as a vLLM weight-transfer backend.

Backends (names for `weight_transfer_config={"backend": ...}`):

    inflight_filesystem   inflight_collective   inflight_ipc   inflight_http
    inflight              (any of them: the init info's "transport" names it)

vLLM's own calls drive them, in-process (`vllm.LLM`) and over HTTP (dev endpoints):

    init_weight_transfer_engine({"plan": ..., "options": ...})   receiver connects / listens
    start_weight_update()                                         nothing touches the model
    update_weights({"version": v, "attempt": a})                  whole version -> staging, validated
    finish_weight_update()                                        staged -> live (layerwise reload)

This is the simple mode, for users without a fleet: each engine makes a version live at its own
`finish_weight_update`, so it is NOT atomic across engines (for a while one engine samples the
new version and another the old, and no token records which). The coordinated path receives
through the same code (`transports.endpoint.receive_version`) from the swap worker extension's
staging thread (`transports.swap`), and `orchestrator.fleet.fleet.Fleet.activate` flips every engine at
one instant.

A version that fails in `update_weights` never reaches the model, so the engine keeps serving
its old weights. Making staged weights live goes through vLLM's layerwise reload
(`initialize_layerwise_reload` / `model.load_weights` / `finalize_layerwise_reload`), which
re-processes CPU linear layers correctly (never `model.load_weights` alone on CPU). With
`"apply_on_finish": false` in the init info the version stays staged until the worker
extension's `inflight_apply_staged()` (collective_rpc) makes it live.

Importing this module registers the backends; name it in `worker_extension_cls`
(`transports.vllm_backend.InflightWorkerExtension`) so every worker process imports it before
the model loads. Light imports only: torch, msgspec, vLLM, and the transport's client library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from transports.errors import TransportError, TransportTimeoutError, describe_error, rebuild_error
from transports.endpoint import ReceivingEndpoint

BACKENDS = {
    "inflight": "any",  # the transport named by the init info's "transport"
    "inflight_filesystem": "filesystem",
    "inflight_collective": "collective",
    "inflight_ipc": "ipc",
    "inflight_http": "http",
}


@dataclass
class InflightInitInfo(WeightTransferInitInfo):
    plan: str
    options: dict[str, Any] = field(default_factory=dict)
    apply_on_finish: bool = True
    transport: str | None = None


@dataclass
class InflightUpdateInfo(WeightTransferUpdateInfo):
    version: int
    attempt: int = 0
    discard: bool = False


class InflightWeightTransferEngine(WeightTransferEngine[InflightInitInfo, InflightUpdateInfo]):
    init_info_cls = InflightInitInfo
    update_info_cls = InflightUpdateInfo
    supports_draft_weight_update = False
    transport = "abstract"

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        worker_rank = getattr(vllm_config.parallel_config, "rank", 0) or 0
        self.endpoint = ReceivingEndpoint(self.transport, self._apply, worker_rank=worker_rank)

    def init_transfer_engine(self, init_info: InflightInitInfo) -> None:
        if self.transport == "any":
            if not init_info.transport:
                raise ValueError("the 'inflight' backend needs init_info['transport']")
            self.endpoint.transport = init_info.transport
        self.endpoint.init_weight_transfer_engine(
            {"plan": init_info.plan, "options": init_info.options, "apply_on_finish": init_info.apply_on_finish})

    def start_weight_update(self) -> None:
        self.endpoint.start_weight_update()

    def receive_weights(self, update_info: InflightUpdateInfo) -> None:
        self.endpoint.update_weights(
            {"version": update_info.version, "attempt": update_info.attempt, "discard": update_info.discard})

    def finish_weight_update(self) -> None:
        self.endpoint.finish_weight_update()

    def _apply(self, staged: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        from transports.cpu_reload import cpu_moe_layers_written, repair_cpu_reload

        device_tensors = ((name, t.to(self.device, non_blocking=True)) for name, t in staged.items())
        initialize_layerwise_reload(self.model)
        self.model.load_weights(device_tensors)
        moe = cpu_moe_layers_written(self.model)  # vLLM 0.32 CPU reload defects: see transports.cpu_reload
        finalize_layerwise_reload(self.model, self.model_config)
        repair_cpu_reload(self.model, moe)

    def shutdown(self) -> None:
        self.endpoint.shutdown()


def _engine_class(name: str, transport: str) -> type[InflightWeightTransferEngine]:
    return type(f"Inflight{transport.capitalize()}WeightTransferEngine", (InflightWeightTransferEngine,),
                {"transport": transport, "__module__": __name__})


ENGINE_CLASSES = {name: _engine_class(name, transport) for name, transport in BACKENDS.items()}


def register() -> None:
    """Registers every backend with vLLM's factory; safe to call more than once."""
    for name, cls in ENGINE_CLASSES.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, cls)


register()


class InflightWorkerExtension:
    """Named in `worker_extension_cls`: its import registers the backends in every worker;
    its methods are reachable with `collective_rpc`."""

    def inflight_apply_staged(self) -> int | None:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, InflightWeightTransferEngine):
            raise RuntimeError("the weight-transfer backend is not an inflight_* backend")
        return engine.endpoint.apply_staged()

    def inflight_staged_version(self) -> int | None:
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.endpoint.staged_version if isinstance(engine, InflightWeightTransferEngine) else None

    def inflight_last_error(self) -> dict[str, Any] | None:
        """Why this worker's last `update_weights` failed (`describe_error`), or None. A server's
        HTTP endpoints answer a failure with text only; `HttpEngineControl` asks here for the
        typed error (which tensor, which check)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, InflightWeightTransferEngine) or engine.endpoint.last_error is None:
            return None
        return describe_error(engine.endpoint.last_error)


class LLMControl:
    """`EngineWeightControl` over an in-process `vllm.LLM`."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class HttpEngineControl:
    """`EngineWeightControl` over a vLLM OpenAI server's dev endpoints (VLLM_SERVER_DEV_MODE=1).

    Every call has a timeout (`timeout_s`, raised as `TransportTimeoutError`). A failed
    `update_weights` answers 500 with the error as text; the typed error (`ChecksumError`
    naming the tensor, ...) is then fetched from the worker (`inflight_last_error` through
    `/collective_rpc`) and raised here, so callers see the same exception as in-process.
    """

    def __init__(self, base_url: str, timeout_s: float = 120.0) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = httpx.Client(timeout=timeout_s)

    def _post(self, path: str, body: dict[str, Any], timeout_s: float | None = None):
        import httpx

        limit = timeout_s or self.timeout_s
        try:
            response = self._client.post(f"{self.base_url}/{path}", json=body, timeout=limit)
        except httpx.TimeoutException as exc:
            raise TransportTimeoutError(f"POST {self.base_url}/{path}", limit) from exc
        except httpx.HTTPError as exc:
            self._client.close()
            self._client = httpx.Client(timeout=self.timeout_s)
            raise TransportError(f"POST {self.base_url}/{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            # The server may drop the connection after an error answer: start afresh.
            self._client.close()
            self._client = httpx.Client(timeout=self.timeout_s)
            raise TransportError(f"POST /{path}: {response.status_code} {response.text[:500]}")
        return response

    def _worker_error(self) -> TransportError | None:
        """The typed error of the worker whose last update failed, if any worker says so."""
        try:
            response = self._post("collective_rpc", {"method": "inflight_last_error", "timeout": 30},
                                  timeout_s=min(self.timeout_s, 60.0))
            results = response.json().get("results") or []
        except (TransportError, ValueError):
            return None
        for result in results:
            if isinstance(result, dict) and result.get("type"):
                return rebuild_error(result)
        return None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("start_weight_update", {})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self._post("update_weights", {"update_info": update_info})
        except TransportTimeoutError:
            raise
        except TransportError as exc:
            typed = None if update_info.get("discard") else self._worker_error()
            if typed is not None:
                raise typed from exc
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine", {})

    def close(self) -> None:
        self._client.close()
