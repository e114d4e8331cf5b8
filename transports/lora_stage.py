"""Loading a LoRA adapter off the engine's step: the worker side.

vLLM loads an adapter inside its engine loop: `add_lora` (and a request naming an adapter not
yet held) reads the adapter's files, builds its CPU tensors, packs them (q/k/v, gate/up) and
copies them into the layers' adapter slots, all between two engine steps, so generation stops
for the whole load. `LoraStagingExtension` (mixed into `transports.swap.SwapWorkerExtension`)
moves everything but the last copy onto a thread of the worker, pinned off the worker's core:

    lora_stage(req)      {"name", "int_id", "path"}: starts reading and building that adapter
                         (vLLM's own `_load_adapter`, then its packing) on a thread and returns
                         at once; the engine keeps generating. Staging the same path again while
                         it is staging or staged returns its state (nothing is read twice).
    lora_status(req)     {"path"}: {"state": staging | staged | failed | absent, "error",
                         "seconds"}; a failure is reported once, then forgotten.
    lora_unstage(req)    {"path"}: forgets what is staged for that path (a stage abandoned).
    lora_stage_events()  what the worker did with adapters, oldest first (at most 64):
                         {"event": "staged" | "failed" | "taken" | "loaded_in_step", "path", "at"}
                         ("taken": a step made a staged adapter live; "loaded_in_step": a step
                         had none staged and read the files itself, as vLLM does).

The worker's LoRA manager is hooked once (its `_load_adapter`): when vLLM's `add_lora` comes,
the adapter built for that path is handed over instead of reading the files (re-numbered when
the caller's int id differs, as a server's counter does), so the step that makes it live only
registers it and copies it into a slot. Light imports only (torch, vLLM).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from transports.shadow import offload_current_thread

#: Staged adapters kept per worker (oldest forgotten first): a stage whose `add_lora` never came.
MAX_STAGED = 8
EVENTS_KEPT = 64


def _parse(arg: Any) -> dict:
    if arg is None or arg == "":
        return {}
    return arg if isinstance(arg, dict) else json.loads(arg)


class LoraStagingExtension:
    """See the module docstring. Every name starts with `lora_` or `_lora_`: the class is mixed
    into vLLM's worker beside other extensions, whose names it must not shadow."""

    def _lora_staging(self) -> dict:
        state = self.__dict__.get("_inflight_lora_staging")
        if state is None:
            # Read on the worker's own thread (RPCs run there): the core its forward passes use.
            state = {"lock": threading.Lock(), "entries": OrderedDict(), "events": deque(maxlen=EVENTS_KEPT),
                     "worker_cpus": set(os.sched_getaffinity(0))}
            self.__dict__["_inflight_lora_staging"] = state
        return state

    def _lora_manager(self):
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("LoRA is not enabled on this engine (enable_lora)")
        if not getattr(manager, "_inflight_staged_hook", False):
            self._lora_hook(manager)
        return manager

    def _lora_hook(self, manager) -> None:
        """vLLM's `_load_adapter` takes a staged adapter when there is one for the path."""
        read_files = manager._load_adapter

        def load_adapter(lora_request):
            staged = self._lora_take_staged(lora_request)
            if staged is not None:
                return staged
            self._lora_note("loaded_in_step", lora_request.lora_path)
            return read_files(lora_request)

        manager._load_adapter = load_adapter
        manager._inflight_staged_hook = True
        manager._inflight_read_files = read_files

    def _lora_note(self, event: str, path: str) -> None:
        self._lora_staging()["events"].append({"event": event, "path": path, "at": time.monotonic()})

    def _lora_take_staged(self, lora_request):
        s = self._lora_staging()
        with s["lock"]:
            entry = s["entries"].get(lora_request.lora_path)
            if entry is None or entry["state"] != "staged":
                return None  # none, or still staging / failed: the step reads the files itself
            del s["entries"][lora_request.lora_path]
        model = entry["model"]
        if model.id != lora_request.lora_int_id:
            model = model.clone(lora_request.lora_int_id)  # shares the tensors
        self._lora_note("taken", lora_request.lora_path)
        return model

    # -- RPCs ---------------------------------------------------------------------------------
    def lora_stage(self, req: str) -> dict:
        request = _parse(req)
        manager = self._lora_manager()
        s = self._lora_staging()
        path = str(request["path"])
        with s["lock"]:
            entry = s["entries"].get(path)
            if entry is not None and entry["state"] in ("staging", "staged"):
                return _snapshot(entry)
            entry = {"state": "staging", "error": None, "seconds": 0.0, "model": None}
            s["entries"][path] = entry
            while len(s["entries"]) > MAX_STAGED:
                s["entries"].popitem(last=False)
        thread = threading.Thread(target=self._lora_stage_thread, args=(manager, request, entry),
                                  name=f"inflight-lora-stage-{request.get('int_id')}", daemon=True)
        thread.start()
        return _snapshot(entry)

    def lora_status(self, req: str) -> dict:
        path = str(_parse(req)["path"])
        s = self._lora_staging()
        with s["lock"]:
            entry = s["entries"].get(path)
            if entry is None:
                return {"state": "absent", "error": None, "seconds": 0.0}
            if entry["state"] == "failed":
                del s["entries"][path]
            return _snapshot(entry)

    def lora_unstage(self, req: str) -> dict:
        path = str(_parse(req)["path"])
        s = self._lora_staging()
        with s["lock"]:
            entry = s["entries"].pop(path, None)
        return {"forgotten": entry is not None}

    def lora_stage_events(self) -> list[dict]:
        return list(self._lora_staging()["events"])

    # -- the staging thread -------------------------------------------------------------------
    def _lora_stage_thread(self, manager, request: dict, entry: dict) -> None:
        from vllm.lora.request import LoRARequest

        s = self._lora_staging()
        started = time.perf_counter()
        offload_current_thread(s["worker_cpus"])  # off the core the forward passes run on
        path = str(request["path"])
        try:
            lora_request = LoRARequest(str(request["name"]), int(request["int_id"]), path)
            model = manager._inflight_read_files(lora_request)  # reads, validates, builds CPU tensors
            # The packing `add_lora` does (q/k/v, gate/up; scaling folded into B), done here; the
            # step's own pass over the packed adapter finds nothing left to pack.
            manager._adapter_manager._create_merged_loras_inplace(model)
            with s["lock"]:
                entry.update(state="staged", model=model, seconds=time.perf_counter() - started)
            self._lora_note("staged", path)
        except BaseException as exc:  # reported through lora_status
            with s["lock"]:
                entry.update(state="failed", error=f"{type(exc).__name__}: {exc}",
                             seconds=time.perf_counter() - started)
            self._lora_note("failed", path)


def _snapshot(entry: dict) -> dict:
    return {"state": entry["state"], "error": entry["error"], "seconds": entry["seconds"]}

