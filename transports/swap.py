"""Worker side of a coordinated activation: stage off the engine's core, then swap or flip.

`SwapWorkerExtension` (name `transports.swap.SwapWorkerExtension` in `worker_extension_cls`)
adds these methods to every vLLM worker, reached with `collective_rpc`. Each takes at most one
JSON string argument (a server's `/collective_rpc` passes strings only) and returns a dict.

    swap_init(cfg)         {"plan": RefitPlan json, "root": filesystem root, "strategy":
                            "pause_swap" | "double_buffer", "timeout_s": ...}
    swap_stage(req)        {"version": v, "attempt": a}: starts staging v on a thread pinned off
                            the worker's core and returns at once (the engine keeps generating);
                            {"version": v, "base_dir": d, "lora_dir": a} stages base d with the
                            PEFT adapter a merged in (a LoRA update, see `merge_lora`)
    swap_status()          {"state": idle|staging|staged|failed, "version", "error", "seconds"}
    swap_drop()            forgets whatever is staged (a failed activation)
    swap_apply()           staged -> live. pause_swap: copies the staged tensors into the live
                            weights (vLLM's layerwise reload; call it while paused). double_buffer:
                            exchanges every parameter's `.data` and each layer's `cpu_linear`
                            handle with the prepared shadow (about a millisecond). Returns
                            {"version", "previous", "requests": {request id: output tokens so
                            far}}: vLLM runs RPCs between two forward passes, so those counts are
                            the exact token index where each in-flight request switched.
    swap_rollback(req)     double_buffer only: flips back to the previous version.
    swap_confirm()         after a pause-free flip ({"watch": true} to swap_apply/swap_rollback):
                            {"requests": {id: 0}} for requests first scheduled after the flip
    swap_load_dir(req)     {"path": dir}: load every safetensors file there into the live
                            weights (the load-in-pause baseline of `inflight bench activation`)
    swap_requests()        {request id: output tokens so far}
    swap_lora_*            see `LoraSwap` below.

Double buffering keeps a second, engine-ready copy of the model (a "shadow": every parameter
cloned, module tree shared otherwise) and loads a new version into it with vLLM's own layerwise
reload, so every post-processing step (on CPU: the oneDNN repacking of linear weights, most of a
reload's time) runs off-pause on the staging thread. After a flip the shadow holds the previous
version: it is the rollback target until the next version is staged into it.

Light imports only (torch, safetensors, vLLM, this package); never `orchestrator` or `replay`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch

from transports.vllm_backend import InflightWorkerExtension

STRATEGIES = ("pause_swap", "double_buffer")


def _parse(arg: Any) -> dict:
    if arg is None or arg == "":
        return {}
    if isinstance(arg, dict):
        return arg
    return json.loads(arg)


def staging_cpus(worker_cpus: set[int]) -> set[int]:
    """Cores for the staging thread: every allowed core the worker's forward thread is not
    pinned to (the same set when the worker owns them all, e.g. a 1-core machine)."""
    allowed = set(os.sched_getaffinity(0)) | set(range(os.cpu_count() or 1))
    others = allowed - set(worker_cpus)
    return others or set(worker_cpus)


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
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    model.load_weights(iter(weights.items()))
    finalize_layerwise_reload(model, model_config)


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


def merge_lora(base_dir: str, lora_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Base weights (every safetensors file of `base_dir`) with a PEFT-format adapter
    (`adapter_config.json` r / lora_alpha, `adapter_model.safetensors` lora_A / lora_B) merged:
    W + (alpha / r) * B @ A. Staged like any version, so the adapter lands beside the serving
    copy and is swapped in by a flip between two engine steps."""
    import glob

    from safetensors.torch import load_file

    base: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(base_dir, "*.safetensors"))):
        base.update(load_file(file))
    with open(os.path.join(lora_dir, "adapter_config.json")) as f:
        config = json.load(f)
    scale = float(config["lora_alpha"]) / float(config["r"])
    adapter = load_file(os.path.join(lora_dir, "adapter_model.safetensors"))
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        module = key.split(".lora_A.")[0]
        if module.startswith("base_model.model."):
            module = module[len("base_model.model."):]
        name = module + ".weight"
        if name not in base:
            raise KeyError(f"adapter targets {name}, which the base model does not have")
        base[name] = base[name].float() + scale * (b.float() @ a.float())
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in base.items()}


class _Stager:
    """One version being staged on a thread; its state is read by `swap_status`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state = "idle"
        self.version: int | None = None
        self.attempt = 0
        self.error: str | None = None
        self.seconds = 0.0
        self.thread: threading.Thread | None = None
        self.generation = 0  # bumped by drop(): a thread of an older generation discards its result

    def snapshot(self) -> dict:
        with self.lock:
            return {"state": self.state, "version": self.version, "attempt": self.attempt,
                    "error": self.error, "seconds": round(self.seconds, 4)}


class SwapWorkerExtension(InflightWorkerExtension):
    """See the module docstring."""

    # -- helpers -----------------------------------------------------------------------------
    def _swap(self) -> dict:
        state = self.__dict__.get("_inflight_swap")
        if state is None:
            state = {"stager": _Stager(), "cfg": None, "plan": None, "staged": None, "shadow": None,
                     "shadow_version": None, "live_version": 0, "previous": None,
                     "worker_cpus": set(os.sched_getaffinity(0)), "lora": {}}
            self.__dict__["_inflight_swap"] = state
        return state

    def _live_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _model_config(self):
        return self.model_runner.model_config

    # -- set-up ------------------------------------------------------------------------------
    def swap_init(self, cfg: str) -> dict:
        from transports.refit.plan import RefitPlan

        s = self._swap()
        config = _parse(cfg)
        strategy = config.get("strategy", "pause_swap")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        s["cfg"] = config
        s["plan"] = RefitPlan.decode(config["plan"]) if config.get("plan") else None
        s["live_version"] = int(config.get("live_version", s["live_version"]))
        if strategy != "double_buffer":
            s["shadow"] = None
        return {"strategy": strategy, "worker_cpus": sorted(s["worker_cpus"]),
                "staging_cpus": sorted(staging_cpus(s["worker_cpus"]))}

    # -- staging -----------------------------------------------------------------------------
    def swap_stage(self, req: str) -> dict:
        s = self._swap()
        if s["cfg"] is None:
            raise RuntimeError("swap_init was not called")
        request = _parse(req)
        stager: _Stager = s["stager"]
        with stager.lock:
            if stager.state == "staging":
                raise RuntimeError(f"version {stager.version} is still being staged")
            stager.generation += 1
            generation = stager.generation
            stager.state, stager.version = "staging", int(request["version"])
            stager.attempt, stager.error, stager.seconds = int(request.get("attempt", 0)), None, 0.0
        s["staged"] = None
        if s["cfg"].get("strategy") == "double_buffer" and not request.get("rollback"):
            s["shadow_version"] = None  # about to be overwritten: no longer a rollback target
        thread = threading.Thread(target=self._stage_thread, args=(generation, dict(request)),
                                  name=f"inflight-stage-{request['version']}", daemon=True)
        stager.thread = thread
        thread.start()
        return stager.snapshot()

    def _stage_thread(self, generation: int, request: dict) -> None:
        s = self._swap()
        stager: _Stager = s["stager"]
        started = time.perf_counter()
        try:
            try:
                os.sched_setaffinity(0, staging_cpus(s["worker_cpus"]))  # this thread only (Linux)
                # below the engine's own threads where they share a core (front end, engine core)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (OSError, AttributeError):
                pass
            delay = float(s["cfg"].get("stage_delay_s", 0.0))  # test hook: a slow transfer
            if delay:
                time.sleep(delay)
            if request.get("lora_dir"):
                weights = merge_lora(request["base_dir"], request["lora_dir"], self._model_config().dtype)
            else:
                weights = self._receive(int(request["version"]), int(request.get("attempt", 0)))
            prepared: Any = weights
            if s["cfg"].get("strategy") == "double_buffer":
                self._prepare_shadow(weights)
                prepared = None
            with stager.lock:
                if stager.generation != generation:
                    return  # dropped meanwhile
                s["staged"] = prepared
                if s["cfg"].get("strategy") == "double_buffer":
                    s["shadow_version"] = int(request["version"])
                stager.state = "staged"
                stager.seconds = time.perf_counter() - started
        except BaseException as exc:  # reported through swap_status
            with stager.lock:
                if stager.generation == generation:
                    stager.state = "failed"
                    stager.error = f"{type(exc).__name__}: {exc}"
                    stager.seconds = time.perf_counter() - started

    def _receive(self, version: int, attempt: int) -> dict[str, torch.Tensor]:
        from transports.filesystem import FilesystemReceiver
        from transports.staging import StagingArea

        s = self._swap()
        plan = s["plan"]
        if plan is None:
            raise RuntimeError("swap_init carried no refit plan")
        receiver = FilesystemReceiver(s["cfg"]["root"], arena_bytes=plan.arena_bytes,
                                      timeout_s=float(s["cfg"].get("timeout_s", 60.0)))
        staging = StagingArea(plan)
        staging.begin(version, attempt)
        try:
            receiver.receive(version, staging)
        finally:
            close = getattr(receiver, "close", None)
            if close is not None:
                close()
        return staging.finish()

    def _prepare_shadow(self, weights: dict[str, torch.Tensor]) -> None:
        s = self._swap()
        live = self._live_model()
        if s["shadow"] is None:
            shadow = clone_for_shadow(live)
            share_reload_metadata(live, shadow)
            s["shadow"] = shadow
        with torch.no_grad():
            reload_into(s["shadow"], weights, self._model_config())

    def swap_status(self) -> dict:
        return self._swap()["stager"].snapshot()

    def swap_drop(self, version: str | None = None) -> dict:
        """Drop what is staged (or being staged). With `version`, only if that is the version
        staged: a late drop of an abandoned version must not drop a newer one (a rejoin)."""
        s = self._swap()
        stager: _Stager = s["stager"]
        with stager.lock:
            if version is not None and stager.version is not None and stager.version != int(version):
                return stager.snapshot()
            stager.generation += 1
            stager.state, stager.error = "idle", None
            s["staged"] = None
            if s["cfg"] and s["cfg"].get("strategy") == "double_buffer":
                s["shadow_version"] = None  # half-written or unwanted: not a rollback target
        return stager.snapshot()

    # -- activation --------------------------------------------------------------------------
    def swap_requests(self) -> dict:
        requests = getattr(self.model_runner, "requests", {}) or {}
        return {rid: len(state.output_token_ids) for rid, state in requests.items()}

    def _watch_new_requests(self) -> None:
        """From now until `swap_confirm`, remember every request the worker schedules for the
        first time: with the pause-free flip those started after it, under the new weights,
        even if the engine still labelled their first tokens with the old version."""
        s = self._swap()
        runner = self.model_runner
        if "execute_model" in runner.__dict__:
            s["watch"] = set()
            return
        original = runner.execute_model
        s["watch"] = set()

        def execute_model(scheduler_output, *args, **kwargs):
            seen = s.get("watch")
            if seen is not None:
                for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                    seen.add(new.req_id)
            return original(scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model

    def swap_confirm(self) -> dict:
        """Ends the watch started by a pause-free flip: {request id: 0} for each request
        first scheduled after the flip."""
        s = self._swap()
        seen = s.get("watch") or set()
        s["watch"] = None
        return {"requests": {rid: 0 for rid in seen}}

    def swap_apply(self, req: str = "") -> dict:
        s = self._swap()
        if _parse(req).get("watch"):
            self._watch_new_requests()
        stager: _Stager = s["stager"]
        with stager.lock:
            if stager.state != "staged":
                raise RuntimeError(f"nothing staged (state {stager.state}, version {stager.version})")
            version = stager.version
        started = time.perf_counter()
        requests = self.swap_requests()
        if s["cfg"].get("strategy") == "double_buffer":
            flip(self._live_model(), s["shadow"])
            s["shadow_version"] = s["live_version"]
        else:
            with torch.no_grad():
                reload_into(self._live_model(), s["staged"], self._model_config())
        s["staged"] = None
        s["previous"], s["live_version"] = s["live_version"], version
        with stager.lock:
            stager.state = "idle"
        return {"version": version, "previous": s["previous"], "requests": requests,
                "seconds": round(time.perf_counter() - started, 6)}

    def swap_rollback(self, req: str = "") -> dict:
        s = self._swap()
        if _parse(req).get("watch"):
            self._watch_new_requests()
        if s["cfg"] is None or s["cfg"].get("strategy") != "double_buffer" or s["shadow"] is None:
            raise RuntimeError("rollback needs double buffering with a prepared shadow")
        if s["shadow_version"] is None:
            raise RuntimeError("the shadow holds no complete version to roll back to")
        requests = self.swap_requests()
        flip(self._live_model(), s["shadow"])
        s["live_version"], s["shadow_version"] = s["shadow_version"], s["live_version"]
        return {"version": s["live_version"], "previous": s["shadow_version"], "requests": requests}

    def swap_live_version(self) -> dict:
        s = self._swap()
        return {"live": s["live_version"], "shadow": s["shadow_version"], "staged": s["stager"].snapshot()}

    def swap_load_dir(self, req: str) -> dict:
        """Baseline: read a published checkpoint and reload the live model from it (call it
        while paused)."""
        import glob

        from safetensors.torch import load_file

        path = _parse(req)["path"]
        started = time.perf_counter()
        dtype = self._model_config().dtype
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            for name, tensor in load_file(file).items():
                weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        with torch.no_grad():
            reload_into(self._live_model(), weights, self._model_config())
        return {"tensors": len(weights), "seconds": round(time.perf_counter() - started, 6),
                "requests": self.swap_requests()}
