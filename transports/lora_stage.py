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
    lora_slots()         vLLM's slot list: an adapter's int id, "reserved" (a stage's),
                         "kept_empty" (a CPU worker's spare last slot) or None.
    lora_stage_events()  what the worker did with adapters, oldest first (at most 64):
                         {"event": "staged" | "failed" | "taken" | "loaded_in_step" |
                         "live_from_slot", "path", "at", "slot"} ("taken": a step made a staged
                         adapter live; "loaded_in_step": a step had none staged and read the
                         files itself, as vLLM does; "live_from_slot": the step took the slot the
                         staging filled and copied nothing; "slot": the slot the staging filled,
                         None when none was free).

The worker's LoRA manager is hooked once (its `_load_adapter`): when vLLM's `add_lora` comes,
the adapter built for that path is handed over instead of reading the files (re-numbered when
the caller's int id differs, as a server's counter does).

The copy into the layers' slots is moved off the step too, where a slot is free (max_loras >= 2:
the live adapter's and one more). `lora_stage`, on the worker's own thread, reserves the first
free slot (a marker in vLLM's slot list, so no activation of vLLM's takes it meanwhile), and the
staging thread copies the adapter into it: that slot is read by no request (the punica mapping
names only the slots of adapters in use). The manager's `activate_adapter` is hooked too: for the
adapter taken from a filled slot it only records the slot as the adapter's ("live_from_slot"),
the step then copies nothing. Every other activation is vLLM's own; a reservation is given back
(under the slot's lock, so never while the thread copies into it) when its stage is forgotten,
fails, or vLLM would otherwise find no free slot. Light imports only (torch, vLLM).
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
#: Marks a slot in vLLM's `lora_index_to_id` as reserved for a stage (lora ids are positive).
RESERVED = -7
#: Marks the last slot of a CPU worker that has one past what its engine serves: kept empty, since
#: vLLM's CPU LoRA kernels read it (index -1) for every token of a request without an adapter in a
#: batch beside one with an adapter (`orchestrator.engines.base.SPARE_LORA_SLOTS`).
KEPT_EMPTY = -8


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
                     "worker_cpus": set(os.sched_getaffinity(0)), "filled": {}}
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
        slots = manager._adapter_manager
        activate = slots.activate_adapter

        def activate_adapter(lora_id: int) -> bool:
            if self._lora_live_from_slot(slots, lora_id):
                return True
            self._lora_release_for(slots, lora_id)
            return activate(lora_id)

        slots.activate_adapter = activate_adapter
        manager._inflight_staged_hook = True
        manager._inflight_read_files = read_files

    def _lora_note(self, event: str, path: str, **more) -> None:
        self._lora_staging()["events"].append({"event": event, "path": path, "at": time.monotonic(), **more})

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
        with entry["slot_lock"]:
            if entry["slot"] is not None and entry["filled"]:  # the activation that follows takes the slot
                s["filled"][lora_request.lora_int_id] = (entry, model, lora_request.lora_path)
        self._lora_note("taken", lora_request.lora_path)
        return model

    # -- slots (all on the worker's own thread but the copy) ------------------------------------
    def _lora_reserve_slot(self, manager) -> tuple[list, int] | None:
        """The first free slot, marked RESERVED; None when none is free or vLLM's activation
        does more than copy into the layers (a classification head)."""
        slots = manager._adapter_manager
        if getattr(slots, "_classification_head", None) is not None:
            return None
        ids = slots.lora_index_to_id
        for index, held in enumerate(ids):
            if held is None:
                ids[index] = RESERVED
                return ids, index
        return None

    @staticmethod
    def _lora_keep_spare(manager, serves) -> None:
        """On a CPU worker with more slots than its engine serves (`serves`, the stage's "slots"):
        the last slot marked KEPT_EMPTY and zeroed, so no activation of vLLM's or ours fills it."""
        from vllm.platforms import current_platform

        slots = manager._adapter_manager
        ids = slots.lora_index_to_id
        if not isinstance(serves, int) or len(ids) <= serves or ids[-1] is not None or not current_platform.is_cpu():
            return
        ids[-1] = KEPT_EMPTY
        for module in slots.modules.values():
            module.reset_lora(len(ids) - 1)

    @staticmethod
    def _lora_release(entry: dict) -> None:
        """Gives the entry's reserved slot back (after a copy into it has ended)."""
        with entry["slot_lock"]:
            reserved, entry["slot"] = entry["slot"], None
        if reserved is not None:
            ids, index = reserved
            if ids[index] == RESERVED:
                ids[index] = None

    def _lora_release_for(self, slots, lora_id: int) -> None:
        """Before vLLM's own activation: a fill meant for `lora_id` that cannot be used, and, when
        vLLM would find no free slot, every reservation (the stages then copy in their step)."""
        s = self._lora_staging()
        filled = s["filled"].pop(lora_id, None)
        if filled is not None:
            self._lora_release(filled[0])
        active = slots._active_adapters
        if lora_id in active or None in slots.lora_index_to_id or len(active) >= slots.lora_slots:
            return  # a free slot, or vLLM's LRU evicts the oldest itself
        with s["lock"]:
            entries = list(s["entries"].values())
        for entry in entries + [f[0] for f in s["filled"].values()]:
            self._lora_release(entry)
        s["filled"].clear()
        if None not in slots.lora_index_to_id and active:
            # Every slot but the kept-empty one active: the LRU manager's own rule at the capacity
            # the engine serves (vLLM counts the spare slot and would find none free).
            active.remove_oldest()

    def _lora_live_from_slot(self, slots, lora_id: int) -> bool:
        """vLLM's activation of `lora_id` without its copy, when the staging filled its slot."""
        s = self._lora_staging()
        filled = s["filled"].get(lora_id)
        if filled is None:
            return False
        entry, model, path = filled
        with entry["slot_lock"]:
            reserved = entry["slot"]
            usable = (_still_reserved(reserved, slots) and lora_id not in slots._active_adapters
                      and slots._registered_adapters.get(lora_id) is model)
            if not usable:
                return False
            active = slots._active_adapters
            if len(active) >= slots.lora_slots:  # the LRU manager's own rule (may raise: the
                active.remove_oldest()            # reservation then stays the entry's, given back)
            entry["slot"] = None
            del s["filled"][lora_id]
            active[lora_id] = None
            slots.lora_index_to_id[reserved[1]] = lora_id
            if hasattr(active, "touch"):
                active.touch(lora_id)
        self._lora_note("live_from_slot", path, slot=reserved[1])
        return True

    # -- RPCs ---------------------------------------------------------------------------------
    def lora_stage(self, req: str) -> dict:
        request = _parse(req)
        manager = self._lora_manager()
        s = self._lora_staging()
        path = str(request["path"])
        self._lora_keep_spare(manager, request.get("slots"))
        with s["lock"]:
            entry = s["entries"].get(path)
            if entry is not None and entry["state"] in ("staging", "staged"):
                return _snapshot(entry)
            failed = s["entries"].pop(path, None)
        if failed is not None:  # its slot back first: this stage may take it
            self._lora_release(failed)
        evicted = []
        with s["lock"]:
            entry = {"state": "staging", "error": None, "seconds": 0.0, "model": None,
                     "slot": self._lora_reserve_slot(manager), "slot_lock": threading.Lock(), "filled": False}
            s["entries"][path] = entry
            while len(s["entries"]) > MAX_STAGED:
                evicted.append(s["entries"].popitem(last=False)[1])
        for old in evicted:
            self._lora_release(old)
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
            snapshot, failed = _snapshot(entry), entry["state"] == "failed"
            if failed:
                del s["entries"][path]
        if failed:
            self._lora_release(entry)
        return snapshot

    def lora_unstage(self, req: str) -> dict:
        path = str(_parse(req)["path"])
        s = self._lora_staging()
        with s["lock"]:
            entry = s["entries"].pop(path, None)
        if entry is not None:
            self._lora_release(entry)
        return {"forgotten": entry is not None}

    def lora_stage_events(self) -> list[dict]:
        return list(self._lora_staging()["events"])

    def lora_slots(self) -> list:
        """vLLM's slots, in order: the int id of the adapter in each, "reserved" (a stage's),
        "kept_empty" (a CPU worker's spare), None (free)."""
        ids = self._lora_manager()._adapter_manager.lora_index_to_id
        return [{RESERVED: "reserved", KEPT_EMPTY: "kept_empty"}.get(held, held) if held is not None else None
                for held in ids]

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
            slot = self._lora_fill_slot(manager._adapter_manager, model, entry)
            with s["lock"]:
                entry.update(state="staged", model=model, seconds=time.perf_counter() - started)
            self._lora_note("staged", path, slot=slot)
        except BaseException as exc:  # reported through lora_status
            with s["lock"]:
                entry.update(state="failed", error=f"{type(exc).__name__}: {exc}",
                             seconds=time.perf_counter() - started)
            self._lora_note("failed", path)

    @staticmethod
    def _lora_fill_slot(slots, model, entry: dict) -> int | None:
        """vLLM's `activate_adapter` copy of `model` into the entry's reserved slot, here on the
        staging thread (the slot's index, or None when it has none or it was given back)."""
        with entry["slot_lock"]:
            reserved = entry["slot"]
            if not _still_reserved(reserved, slots):
                return None
            index = reserved[1]
            for module_name, module in slots.modules.items():
                weights = slots._get_lora_layer_weights(model, module_name)
                if not weights:
                    module.reset_lora(index)
                else:
                    module.set_lora(index, weights.lora_a, weights.lora_b)
            _copies_done(slots)
            entry["filled"] = True
            return index


def _still_reserved(reserved: tuple[list, int] | None, slots) -> bool:
    """The reservation (slot list, index) still holds its marker in the manager's current list
    (vLLM's `remove_all_adapters` replaces the list)."""
    return reserved is not None and reserved[0] is slots.lora_index_to_id and reserved[0][reserved[1]] == RESERVED


def _copies_done(slots) -> None:
    """vLLM's set_lora copies with non_blocking=True: on a GPU this thread's stream is not the one
    the forward passes use, so the copies are waited for before the slot is called filled (written,
    not yet run: no GPU here; on a CPU the copies are done when they return)."""
    import torch

    device = next((t.device for m in slots.modules.values() for t in getattr(m, "lora_a_stacked", ())), None)
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _snapshot(entry: dict) -> dict:
    return {"state": entry["state"], "error": entry["error"], "seconds": entry["seconds"]}

