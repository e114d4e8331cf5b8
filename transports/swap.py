"""Worker side of a coordinated activation: stage off the engine's core, then swap or flip.

`SwapWorkerExtension` (name `transports.swap.SwapWorkerExtension` in `worker_extension_cls`)
adds these methods to every vLLM worker, reached with `collective_rpc`. Each takes at most one
JSON string argument (a server's `/collective_rpc` passes strings only) and returns a dict.

    swap_init(cfg)         {"plan": RefitPlan json, "root": filesystem root, "strategy":
                            "pause_swap" | "double_buffer", "timeout_s": ...}
    swap_stage(req)        {"version": v}: starts staging the *committed* version v (its
                            `RUN_ROOT/vNNNNNNNN/COMPLETE` marker written) on a thread pinned off
                            the worker's core and returns at once (the engine keeps generating).
                            The attempt staged is read from the committed files. With
                            {"version": v, "attempt": a} buckets of attempt a are streamed as they
                            are written, but the version is reported staged only once COMPLETE
                            exists and the committed files are the ones read (that attempt, same
                            checksums); either wait is bounded by `timeout_s`.
                            {"version": v, "base_dir": d, "lora_dir": a} stages base d with the
                            PEFT adapter a merged in (a LoRA update, see `merge_lora`).
                            Refused (RuntimeError "previous staging still running") while a
                            dropped stage's thread still runs after a bounded wait (`join_s`,
                            default 2 s): two threads never write one shadow.
    swap_status()          {"state": idle|staging|staged|failed, "version", "attempt", "error",
                            "seconds"}
    swap_drop()            forgets whatever is staged (a failed activation); a stage still
                            waiting or receiving stops at its next check, before it touches
                            the shadow
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

Double buffering keeps a second, engine-ready copy of the model (a "shadow", see
`transports.shadow`) and loads a new version into it with vLLM's own layerwise reload, so every
post-processing step (on CPU: the oneDNN repacking of linear weights, most of a reload's time)
runs off-pause on the staging thread. After a flip the shadow holds the previous version: it is
the rollback target until the next version is staged into it. LoRA merging lives in
`transports.lora`.

Light imports only (torch, safetensors, vLLM, this package); never `orchestrator` or `replay`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch

from transports.lora import load_safetensors_dir, merge_lora
from transports.shadow import (  # re-exported: importable from `transports.swap` as before
    clone_for_shadow,
    flip,
    module_pairs,
    reload_into,
    share_reload_metadata,
    staging_cpus,
)
from transports.vllm_backend import InflightWorkerExtension

__all__ = ["STRATEGIES", "SwapWorkerExtension", "clone_for_shadow", "flip", "load_safetensors_dir", "merge_lora",
           "module_pairs", "reload_into", "share_reload_metadata", "staging_cpus"]

STRATEGIES = ("pause_swap", "double_buffer")
#: How long `swap_stage` waits for a dropped staging thread to end before refusing.
DEFAULT_JOIN_S = 2.0


def _parse(arg: Any) -> dict:
    if arg is None or arg == "":
        return {}
    if isinstance(arg, dict):
        return arg
    return json.loads(arg)


class StagingDropped(Exception):
    """A staging thread noticed that its stage was dropped; it stops before writing anything."""


class _Stager:
    """One version being staged on a thread; its state is read by `swap_status`."""

    def __init__(self) -> None:
        # Re-entrant: swap_drop answers with snapshot() while it holds the lock (a plain Lock
        # deadlocked the worker there: every later RPC and forward pass waited forever).
        self.lock = threading.RLock()
        self.state = "idle"
        self.version: int | None = None
        self.attempt: int | None = 0
        self.error: str | None = None
        self.seconds = 0.0
        self.thread: threading.Thread | None = None
        self.generation = 0  # bumped by drop(): a thread of an older generation discards its result
        self.cancel = threading.Event()  # set by drop(): the current thread stops at its next check

    def snapshot(self) -> dict:
        with self.lock:
            return {"state": self.state, "version": self.version, "attempt": self.attempt,
                    "error": self.error, "seconds": round(self.seconds, 4)}

    def check(self, generation: int) -> None:
        """Raises `StagingDropped` when the stage of `generation` was dropped meanwhile."""
        with self.lock:
            if self.generation != generation:
                raise StagingDropped()

    def wait_previous(self, join_s: float) -> None:
        """Waits (at most `join_s`) for the previous staging thread to end; refuses while it
        lives: two threads must never write one shadow."""
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(max(0.0, join_s))
        if thread.is_alive():
            raise RuntimeError(f"previous staging still running (version {self.version}, thread {thread.name}); "
                               f"waited {join_s:g} s")


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
        # A dropped stage's thread may still run (reloading the shadow): wait for it, bounded.
        stager.wait_previous(float(s["cfg"].get("join_s", DEFAULT_JOIN_S)))
        attempt = request.get("attempt")
        with stager.lock:
            if stager.state == "staging" or (stager.thread is not None and stager.thread.is_alive()):
                raise RuntimeError(f"previous staging still running (version {stager.version})")
            stager.generation += 1
            generation = stager.generation
            stager.cancel = threading.Event()
            stager.state, stager.version = "staging", int(request["version"])
            stager.attempt = None if attempt is None else int(attempt)
            stager.error, stager.seconds = None, 0.0
            s["staged"] = None
            if s["cfg"].get("strategy") == "double_buffer" and not request.get("rollback"):
                s["shadow_version"] = None  # about to be overwritten: no longer a rollback target
            thread = threading.Thread(target=self._stage_thread, args=(generation, dict(request), stager.cancel),
                                      name=f"inflight-stage-{request['version']}", daemon=True)
            stager.thread = thread
        thread.start()
        return stager.snapshot()

    def _stage_thread(self, generation: int, request: dict, cancel: threading.Event) -> None:
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
            if delay and cancel.wait(delay):
                raise StagingDropped()
            if request.get("lora_dir"):
                weights = merge_lora(request["base_dir"], request["lora_dir"], self._model_config().dtype)
            else:
                attempt = request.get("attempt")
                weights = self._receive(int(request["version"]), None if attempt is None else int(attempt),
                                        generation)
            stager.check(generation)  # dropped while receiving: leave the shadow alone
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
        except StagingDropped:
            return
        except BaseException as exc:  # reported through swap_status
            with stager.lock:
                if stager.generation == generation:
                    stager.state = "failed"
                    stager.error = f"{type(exc).__name__}: {exc}"
                    stager.seconds = time.perf_counter() - started

    def _receive(self, version: int, attempt: int | None, generation: int | None = None) -> dict[str, torch.Tensor]:
        """Receives `version` through the filesystem transport and returns it once committed.
        `attempt=None`: the committed attempt (read from the committed files)."""
        from transports.filesystem import FilesystemReceiver
        from transports.staging import StagingArea

        s = self._swap()
        plan = s["plan"]
        if plan is None:
            raise RuntimeError("swap_init carried no refit plan")
        stager: _Stager = s["stager"]
        receiver = FilesystemReceiver(s["cfg"]["root"], arena_bytes=plan.arena_bytes,
                                      timeout_s=float(s["cfg"].get("timeout_s", 60.0)))
        try:
            if attempt is None:
                attempt = receiver.committed_attempt(version)
                with stager.lock:
                    if generation is None or stager.generation == generation:
                        stager.attempt = attempt
            staging = StagingArea(plan)
            staging.begin(version, attempt)
            receiver.receive(version, staging, committed=True)
        finally:
            receiver.close()
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
        staged: a late drop of an abandoned version must not drop a newer one (a rejoin). A
        staging thread still running stops at its next check (it never writes the shadow after
        it); `swap_stage` waits for it to end before starting another."""
        s = self._swap()
        stager: _Stager = s["stager"]
        with stager.lock:
            if version is not None and stager.version is not None and stager.version != int(version):
                return stager.snapshot()
            stager.generation += 1
            stager.cancel.set()
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
        path = _parse(req)["path"]
        started = time.perf_counter()
        weights = load_safetensors_dir(path, self._model_config().dtype)
        with torch.no_grad():
            reload_into(self._live_model(), weights, self._model_config())
        return {"tensors": len(weights), "seconds": round(time.perf_counter() - started, 6),
                "requests": self.swap_requests()}

    def swap_step_times(self, req: str = "") -> dict:
        """The worker's own clock per engine step (for `inflight bench activation`). The first
        call wraps this worker's `execute_model` and `sample_tokens` (instance attributes; the
        model runner and its `swap_confirm` watch are left alone); from then on every step
        that scheduled tokens is kept (the last 20,000). {"since": t} returns the steps that
        ended after monotonic time t. Returns {"now", "wall", "installed", "steps": [[start,
        end, wall_end, requests, tokens], ...]}: `time.monotonic()` is system-wide on Linux, so
        start/end compare directly with a client's monotonic clock on the same machine;
        `requests` is how many requests the step scheduled (a decode step samples one token
        for each), `tokens` how many tokens it computed."""
        from collections import deque

        log = self.__dict__.get("_inflight_step_log")
        installed = False
        if log is None:
            log = self.__dict__["_inflight_step_log"] = deque(maxlen=20000)
            pending: list = []  # the step whose tokens come from sample_tokens
            execute, sample = self.execute_model, self.sample_tokens

            def execute_model(scheduler_output, *args, **kwargs):
                start = time.monotonic()
                out = execute(scheduler_output, *args, **kwargs)
                tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
                requests = len(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
                pending.clear()
                if tokens > 0:
                    if out is None:
                        pending.append((start, requests, tokens))
                    else:
                        log.append((start, time.monotonic(), time.time(), requests, tokens))
                return out

            def sample_tokens(*args, **kwargs):
                out = sample(*args, **kwargs)
                if pending:
                    start, requests, tokens = pending.pop()
                    log.append((start, time.monotonic(), time.time(), requests, tokens))
                return out

            self.execute_model, self.sample_tokens = execute_model, sample_tokens
            installed = True
        since = float(_parse(req).get("since", float("-inf")))
        return {"now": time.monotonic(), "wall": time.time(), "installed": installed,
                "steps": [list(s) for s in log if s[1] > since]}
