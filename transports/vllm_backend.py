"""The receiving end of every transport, registered as a vLLM weight-transfer backend.

Backends (names for `weight_transfer_config={"backend": ...}`):

    inflight_filesystem   inflight_collective   inflight_ipc   inflight_http
    inflight              (any of them: the init info's "transport" names it)

vLLM's own calls drive them, in-process (`vllm.LLM`) and over HTTP (dev endpoints):

    init_weight_transfer_engine({"plan": ..., "options": ...})   receiver connects / listens
    start_weight_update()                                         nothing touches the model
    update_weights({"version": v, "attempt": a})                  whole version -> staging, validated
    finish_weight_update()                                        staged -> live (layerwise reload)

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

        device_tensors = ((name, t.to(self.device, non_blocking=True)) for name, t in staged.items())
        initialize_layerwise_reload(self.model)
        self.model.load_weights(device_tensors)
        finalize_layerwise_reload(self.model, self.model_config)

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
    """`EngineWeightControl` over a vLLM OpenAI server's dev endpoints (VLLM_SERVER_DEV_MODE=1)."""

    def __init__(self, base_url: str, timeout_s: float = 120.0) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(timeout=timeout_s)

    def _post(self, path: str, body: dict[str, Any]) -> None:
        response = self._client.post(f"{self.base_url}/{path}", json=body)
        if response.status_code != 200:
            from transports.base import TransportError

            raise TransportError(f"POST /{path}: {response.status_code} {response.text[:500]}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("start_weight_update", {})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine", {})

    def close(self) -> None:
        self._client.close()
