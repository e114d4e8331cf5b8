"""Double buffering inside an engine worker: a second, engine-ready copy of the model (a
"shadow": every parameter cloned, module tree shared otherwise), loaded through vLLM's own
layerwise reload off-pause, and the flip that exchanges it with the live weights between two
engine steps (every parameter's `.data` and each CPU linear layer's `cpu_linear` handle; an
involution, so a second flip rolls back). Also the choice of cores for the staging thread.

Light imports only (torch; vLLM's reload helpers inside the functions that need them).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch


class _RotaryReloadNotice(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" at every reload:
    the rotary embedding's `cos_sin_cache` buffer counts as loadable but no checkpoint holds it (it
    is computed from the config at start), so vLLM puts the buffer back as it was, which is
    right. The warning says nothing about the new weights (their logprobs match a transformers
    forward, tests/integration/test_activation_*): it is dropped here, in the worker, where this
    module is imported (by `transports.swap`) before the model loads. Every other reload warning
    still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadNotice())


def staging_cpus(worker_cpus: set[int]) -> set[int]:
    """Cores for the staging thread: every allowed core the worker's forward thread is not
    pinned to (the same set when the worker owns them all, e.g. a 1-core machine)."""
    allowed = set(os.sched_getaffinity(0)) | set(range(os.cpu_count() or 1))
    others = allowed - set(worker_cpus)
    return others or set(worker_cpus)


def offload_current_thread(worker_cpus: set[int]) -> None:
    """Moves the calling thread off the worker's core (Linux: per thread) and below the engine's
    own threads where they share a core. Threads it starts inherit both."""
    try:
        os.sched_setaffinity(0, staging_cpus(worker_cpus))
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):
        pass


def clone_for_shadow(model: torch.nn.Module) -> torch.nn.Module:
    """A second model with its own parameters and buffers and the same module attributes
    otherwise (KV caches, attention backends, quant methods are shared, never copied).
    Tied parameters stay tied."""
    memo: dict[int, Any] = {}

    def clone_tensor(t: torch.Tensor | None):
        if t is None:
            return None
        if id(t) in memo:
            return memo[id(t)]
        data = t.data.clone()
        if isinstance(t, torch.nn.Parameter):
            new = torch.nn.Parameter(data, requires_grad=False)
            new.__class__ = t.__class__
            new.__dict__.update(t.__dict__)
        else:
            new = data
        memo[id(t)] = new
        return new

    def clone(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in memo:
            return memo[id(module)]
        new = module.__class__.__new__(module.__class__)
        new.__dict__ = dict(module.__dict__)
        memo[id(module)] = new
        new._parameters = {k: clone_tensor(p) for k, p in module._parameters.items()}
        new._buffers = {k: clone_tensor(b) for k, b in module._buffers.items()}
        new._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        new._modules = {k: (clone(m) if m is not None else None) for k, m in module._modules.items()}
        return new

    return clone(model)


def module_pairs(live: torch.nn.Module, shadow: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    pairs = list(zip(live.modules(), shadow.modules(), strict=True))
    for a, b in pairs:
        if type(a) is not type(b):
            raise RuntimeError(f"shadow model differs from the live one at {type(a).__name__}")
    return pairs


def flip(live: torch.nn.Module, shadow: torch.nn.Module) -> int:
    """Exchanges the weights of `live` and `shadow`: every parameter's (and buffer's) `.data`
    and every layer's `cpu_linear` handle. An involution: a second flip restores both."""
    seen: set[int] = set()
    swapped = 0
    for a, b in module_pairs(live, shadow):
        for table in ("_parameters", "_buffers"):
            ta, tb = getattr(a, table), getattr(b, table)
            for name, pa in ta.items():
                pb = tb.get(name)
                if pa is None or pb is None or id(pa) in seen:
                    continue
                seen.add(id(pa))
                if pa is pb:
                    continue
                pa.data, pb.data = pb.data, pa.data
                swapped += 1
        if "cpu_linear" in a.__dict__ or "cpu_linear" in b.__dict__:
            ha, hb = a.__dict__.get("cpu_linear"), b.__dict__.get("cpu_linear")
            a.cpu_linear, b.cpu_linear = hb, ha
    return swapped


def reload_into(model: torch.nn.Module, weights: dict[str, torch.Tensor], model_config) -> None:
    """Loads `weights` (engine names) through vLLM's layerwise reload, which re-runs every
    layer's post-processing (never `model.load_weights` alone on CPU)."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    from transports.cpu_reload import cpu_moe_layers_written, repair_cpu_reload

    initialize_layerwise_reload(model)
    model.load_weights(iter(weights.items()))
    moe = cpu_moe_layers_written(model)  # vLLM 0.32 CPU reload defects: see transports.cpu_reload
    finalize_layerwise_reload(model, model_config)
    repair_cpu_reload(model, moe)


def share_reload_metadata(live: torch.nn.Module, shadow: torch.nn.Module) -> None:
    """The layerwise reload restores each layer from metadata recorded when the live model
    loaded; the shadow's layers reuse it."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for a, b in module_pairs(live, shadow):
        src, dst = get_layerwise_info(a), get_layerwise_info(b)
        params, buffers = src.restore_metadata
        dst.restore_metadata = ({k: _copy_meta(t, a, b) for k, t in params.items()},
                                {k: _copy_meta(t, a, b) for k, t in buffers.items()})
        dst.restore_device = src.restore_device


def _copy_meta(tensor: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module) -> torch.Tensor:
    """A private copy of one recorded meta tensor: the reload registers these very objects on
    the layer and rebinds their weight loaders to it, so live and shadow must not share them."""
    from types import MethodType

    new = torch.empty_strided(tuple(tensor.size()), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")
    new.__class__ = tensor.__class__
    attrs = {}
    for key, value in tensor.__dict__.items():
        while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
            value = value.__wrapped__  # a reload's wrapper, bound to the live layer's progress
        if isinstance(value, MethodType) and value.__self__ is live:
            value = value.__func__.__get__(shadow)
        attrs[key] = value
    new.__dict__ = attrs
    return new


class BucketwiseReload:
    """vLLM's layerwise reload of `model` fed one bucket at a time, as each arrives (the staging
    area's `on_bucket`), so a version is replayed into the shadow while the receiver reads the
    next bucket. The reload keeps each layer's tensors until every weight of that layer has
    arrived, then post-processes the layer (oneDNN repacking on CPU); a layer split across
    buckets is therefore fine. `finish()` post-processes what is left (attention layers);
    `abort()` after a failure ends the reload all the same, so the next version starts from a
    clean reload state (a half-loaded layer would otherwise count the old bytes towards the new
    version); the model is then garbage, never a rollback target. Once `cancel` is set, buckets
    are skipped: the receiver drains its version, the model is left alone."""

    def __init__(self, model: torch.nn.Module, model_config, cancel: threading.Event | None = None):
        self.model = model
        self.model_config = model_config
        self.cancel = cancel
        self.started = False
        self.done = False
        self.buckets = 0
        self.error: str | None = None  # why abort() could not end the reload cleanly

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.cancel is not None and self.cancel.is_set():
            return
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with torch.no_grad():  # thread-local: this may run on a receiver's replay thread
            if not self.started:
                initialize_layerwise_reload(self.model)
                self.started = True
            self.model.load_weights(iter(tensors.items()))
        self.buckets += 1

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from transports.cpu_reload import cpu_moe_layers_written, repair_cpu_reload

        with torch.no_grad():
            if not self.started:  # a plan without buckets: still a complete (empty) reload
                initialize_layerwise_reload(self.model)
                self.started = True
            moe = cpu_moe_layers_written(self.model)  # vLLM 0.32 CPU reload defects (transports.cpu_reload)
            finalize_layerwise_reload(self.model, self.model_config)
            repair_cpu_reload(self.model, moe)
        self.done = True

    def abort(self) -> None:
        if self.started and not self.done:
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
            )

            try:
                with torch.no_grad():
                    finalize_layerwise_reload(self.model, self.model_config)
            except Exception as exc:  # noqa: BLE001 - the model is no rollback target either way
                self.error = f"{type(exc).__name__}: {exc}"
            self.done = True
