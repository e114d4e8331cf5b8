"""Worker side of a coordinated activation: stage off the engine's core, then swap or flip.

`SwapWorkerExtension` (name `transports.swap.SwapWorkerExtension` in `worker_extension_cls`)
adds these methods to every vLLM worker, reached with `collective_rpc`. Each takes at most one
JSON string argument (a server's `/collective_rpc` passes strings only) and returns a dict.

    swap_init(cfg)         {"plan": RefitPlan json, "strategy": "pause_swap" | "double_buffer",
                            "timeout_s": ..., "transport": "filesystem" (default) | "collective" |
                            "ipc" | "http", "options": {...}, "root": filesystem root}.
                            `options` is what that transport's receiver needs: exactly the
                            `options` of the trainer's `engine_init_info(engine_index)` (per
                            engine); for the filesystem, `root` is enough, or
                            `"pull": {"url": ..., "token": ...}` for an engine on another host
                            than the run directory: each committed version is mirrored over
                            HTTP into a scratch directory of the worker's host first
                            (`transports.pull`). A push transport's
                            receiver is built on a thread (a collective one waits for the
                            trainer's rendezvous) and kept across calls with the same options;
                            new options close it and build another.
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
                            {"requests": {id: 0}} for requests first scheduled after the flip,
                            {"cached": {id: prompt tokens from the prefix cache}} for those of
                            them that hit it
    swap_load_dir(req)     {"path": dir}: load every safetensors file there into the live
                            weights (the load-in-pause baseline of `inflight bench activation`)
    swap_requests()        {request id: output tokens so far}

One staging path for every transport: the staging thread receives through the transport's
receiver (`transports.endpoint.make_receiver`) into a `StagingArea`
(`transports.endpoint.receive_version`, the same code the `apply_on_finish` endpoint uses). For
a push transport (collective, ipc, http) it waits, bounded by `timeout_s`, for the trainer's
sender, which `sync_weights()` drives; the version goes live only when the fleet flips it on
every engine. With double buffering each bucket is loaded into the shadow as soon as it is
accepted (`transports.shadow.BucketwiseReload`), while the receiver reads the next one. After a
failed version a collective group whose own transfer failed (a timeout, a broken peer) is
marked broken, and only a fresh rendezvous (`swap_init` with the trainer's new options) brings it
back; http and ipc keep their receiver (it frees what the failed version left queued and skips
buckets of another version or attempt; the trainer's kept-alive http connection and ipc
identity stay valid, which a rebuilt receiver would break).

Double buffering keeps a second, engine-ready copy of the model (a "shadow", see
`transports.shadow`) and loads a new version into it with vLLM's own layerwise reload, so every
post-processing step (on CPU: the oneDNN repacking of linear weights, most of a reload's time)
runs off-pause on the staging thread. After a flip the shadow holds the previous version: it is
the rollback target until the next version is staged into it. LoRA merging lives in
`transports.lora`; staging an adapter that vLLM serves natively, in `transports.lora_stage`.

Light imports only (torch, safetensors, vLLM, this package); never `orchestrator` or `replay`.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
import time
from typing import Any

import torch

from transports.lora import load_safetensors_dir, merge_lora
from transports.lora_stage import LoraStagingExtension
from transports.receiver_link import ReceiverLink, link_key
from transports.shadow import (  # re-exported: importable from `transports.swap` as before
    BucketwiseReload,
    clone_for_shadow,
    flip,
    module_pairs,
    offload_current_thread,
    reload_into,
    share_reload_metadata,
    staging_cpus,
)
from transports.stager import Stager, StagingDropped
from transports.vllm_backend import InflightWorkerExtension

__all__ = ["STRATEGIES", "SwapWorkerExtension", "clone_for_shadow", "flip", "load_safetensors_dir", "merge_lora",
           "module_pairs", "reload_into", "share_reload_metadata", "staging_cpus"]

STRATEGIES = ("pause_swap", "double_buffer")
TRANSPORTS = ("filesystem", "collective", "ipc", "http")
#: How long `swap_stage` waits for a dropped staging thread to end before refusing.
DEFAULT_JOIN_S = 2.0


def _parse(arg: Any) -> dict:
    if arg is None or arg == "":
        return {}
    if isinstance(arg, dict):
        return arg
    return json.loads(arg)


class SwapWorkerExtension(InflightWorkerExtension, LoraStagingExtension):
    """See the module docstring (and `transports.lora_stage` for the `lora_*` methods)."""

    # -- helpers -----------------------------------------------------------------------------
    def _swap(self) -> dict:
        state = self.__dict__.get("_inflight_swap")
        if state is None:
            state = {"stager": Stager(), "cfg": None, "plan": None, "staged": None, "shadow": None,
                     "shadow_version": None, "live_version": 0, "previous": None,
                     "worker_cpus": set(os.sched_getaffinity(0)), "lora": {}, "link": None}
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
        transport = config.get("transport") or "filesystem"
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        s["cfg"] = config
        s["plan"] = RefitPlan.decode(config["plan"]) if config.get("plan") else None
        s["live_version"] = int(config.get("live_version", s["live_version"]))
        if strategy != "double_buffer":
            s["shadow"] = None
        link: ReceiverLink | None = s["link"]
        if transport == "filesystem":
            if link is not None:
                link.close()
            s["link"] = None
            if config.get("pull"):  # another host's run directory: mirror versions into one of ours
                config["root"] = s.setdefault("pull_root", tempfile.mkdtemp(prefix="inflight-pull-"))
        else:
            if s["plan"] is None:
                raise ValueError(f"the {transport} transport needs the refit plan")
            options = dict(config.get("options") or {})
            if link is None or link.key != link_key(transport, options, s["plan"]):
                if link is not None:
                    link.close()
                s["link"] = ReceiverLink(transport, options, s["plan"], int(getattr(self, "rank", 0) or 0),
                                  s["worker_cpus"])
        return {"strategy": strategy, "transport": transport, "worker_cpus": sorted(s["worker_cpus"]),
                "staging_cpus": sorted(staging_cpus(s["worker_cpus"]))}

    # -- staging -----------------------------------------------------------------------------
    def swap_stage(self, req: str) -> dict:
        s = self._swap()
        if s["cfg"] is None:
            raise RuntimeError("swap_init was not called")
        request = _parse(req)
        stager: Stager = s["stager"]
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
            thread = threading.Thread(target=self._stage_thread,
                                      args=(generation, dict(request), stager.cancel, s["cfg"]),
                                      name=f"inflight-stage-{request['version']}", daemon=True)
            stager.thread = thread
        thread.start()
        return stager.snapshot()

    def _stage_thread(self, generation: int, request: dict, cancel: threading.Event, cfg: dict | None = None) -> None:
        """`cfg`: the configuration `swap_stage` saw. A `swap_init` while this runs (another
        strategy, transport or plan) fails the stage: what it staged (raw tensors, or nothing
        beyond the shadow) was prepared for the old configuration, and `swap_apply` under the
        new one would label the live weights with a version they do not hold."""
        s = self._swap()
        stager: Stager = s["stager"]
        started = time.perf_counter()
        try:
            offload_current_thread(s["worker_cpus"])
            delay = float(s["cfg"].get("stage_delay_s", 0.0))  # test hook: a slow transfer
            if delay and cancel.wait(delay):
                raise StagingDropped()
            in_shadow = False
            if request.get("lora_dir"):
                weights = merge_lora(request["base_dir"], request["lora_dir"], self._model_config().dtype)
            else:
                attempt = request.get("attempt")
                weights, in_shadow = self._receive(int(request["version"]),
                                                   None if attempt is None else int(attempt), generation, cancel)
            stager.check(generation)  # dropped while receiving: leave the shadow alone
            prepared: Any = weights
            if s["cfg"].get("strategy") == "double_buffer":
                if not in_shadow:
                    self._prepare_shadow(weights)
                prepared = None
            with stager.lock:
                if stager.generation != generation:
                    return  # dropped meanwhile
                if cfg is not None and s["cfg"] is not cfg:
                    raise RuntimeError(f"swap_init changed the configuration while version {request['version']} "
                                       "was being staged; stage it again")
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

    def _receive(self, version: int, attempt: int | None, generation: int | None = None,
                 cancel: threading.Event | None = None) -> tuple[dict[str, torch.Tensor], bool]:
        """Receives `version` through the configured transport (`receive_version`, the one
        staging path). Filesystem: `attempt=None` stages the committed attempt (read from the
        committed files), and the version counts only once committed. Push transports:
        `attempt=None` takes the attempt of the first bucket of `version` that arrives. With
        double buffering every bucket is loaded into the shadow as it is accepted; returns
        (the staged tensors, or {} when they went to the shadow; whether they did)."""
        from transports.endpoint import make_receiver, receive_version
        from transports.pull import mirror_version
        from transports.staging import StagingArea

        s = self._swap()
        plan = s["plan"]
        if plan is None:
            raise RuntimeError("swap_init carried no refit plan")
        stager: Stager = s["stager"]
        cfg = s["cfg"]
        timeout_s = float(cfg.get("timeout_s", 60.0))
        loader: BucketwiseReload | None = None
        # Bucket by bucket into the shadow through the model's own `load_weights` (every vLLM
        # model has one); a module without it is loaded whole once the version arrived.
        if cfg.get("strategy") == "double_buffer" and hasattr(self._live_model(), "load_weights"):
            loader = BucketwiseReload(self._ensure_shadow(), self._model_config(), cancel)
        sink = {"on_bucket": loader.load if loader is not None else None, "retain": loader is None}
        staging = StagingArea(plan)

        def note_attempt(value: int | None) -> None:
            with stager.lock:
                if generation is None or stager.generation == generation:
                    stager.attempt = value

        try:
            link: ReceiverLink | None = s["link"]
            if link is None:
                pull = cfg.get("pull")
                if pull:  # committed versions only: the mirror waits for COMPLETE, bounded
                    mirror_version(pull["url"], pull["token"], version, cfg["root"], timeout_s)
                receiver = make_receiver("filesystem", plan, {"root": cfg["root"], "timeout_s": timeout_s})
                try:
                    if attempt is None:
                        attempt = receiver.committed_attempt(version)
                        note_attempt(attempt)
                    weights = receive_version(receiver, staging, version, attempt, committed=True, **sink)
                finally:
                    receiver.close()
            else:
                receiver = link.get(timeout_s)
                try:
                    weights = receive_version(receiver, staging, version, attempt, **sink)
                except BaseException as exc:
                    link.failed(exc)
                    raise
                note_attempt(staging.attempt)
            if loader is not None:
                loader.finish()
        except BaseException:
            if loader is not None:
                loader.abort()
            raise
        return weights, loader is not None

    def _ensure_shadow(self) -> torch.nn.Module:
        s = self._swap()
        if s["shadow"] is None:
            live = self._live_model()
            shadow = clone_for_shadow(live)
            share_reload_metadata(live, shadow)
            s["shadow"] = shadow
        return s["shadow"]

    def _prepare_shadow(self, weights: dict[str, torch.Tensor]) -> None:
        shadow = self._ensure_shadow()
        with torch.no_grad():
            reload_into(shadow, weights, self._model_config())

    def swap_status(self) -> dict:
        return self._swap()["stager"].snapshot()

    def swap_identity(self) -> dict:
        """What this worker serves: a joining engine's is compared with the run's."""
        model = self._model_config()
        vllm_config = getattr(self, "vllm_config", None)
        mode = getattr(model, "logprobs_mode", None)
        scheduler = getattr(vllm_config, "scheduler_config", None)
        return {"model": str(Path(model.model).resolve()) if Path(str(model.model)).exists() else str(model.model),
                "tokenizer": (str(Path(model.tokenizer).resolve()) if Path(str(model.tokenizer)).exists()
                              else str(model.tokenizer)),
                "dtype": str(model.dtype).removeprefix("torch."),
                "logprobs_mode": str(getattr(mode, "value", mode) or ""),
                "max_model_len": int(model.max_model_len),
                "max_num_seqs": int(getattr(scheduler, "max_num_seqs", 0) or 0),
                "lora": getattr(vllm_config, "lora_config", None) is not None}

    def swap_drop(self, version: str | None = None) -> dict:
        """Drop what is staged (or being staged). With `version`, only if that is the version
        staged: a late drop of an abandoned version must not drop a newer one (a rejoin). A
        staging thread still running stops at its next check (it never writes the shadow after
        it); `swap_stage` waits for it to end before starting another."""
        s = self._swap()
        stager: Stager = s["stager"]
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
        if getattr(runner.execute_model, "inflight_watch", False):  # wrapped by an earlier flip
            s["watch"] = {}
            return
        original = runner.execute_model
        s["watch"] = {}

        def execute_model(scheduler_output, *args, **kwargs):
            seen = s.get("watch")
            if seen is not None:
                for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                    # prompt tokens whose keys/values came from the prefix cache: computed
                    # before the flip or after it, which the worker cannot tell
                    seen.setdefault(new.req_id, int(getattr(new, "num_computed_tokens", 0) or 0))
            return original(scheduler_output, *args, **kwargs)

        execute_model.inflight_watch = True
        runner.execute_model = execute_model

    def swap_confirm(self) -> dict:
        """Ends the watch started by a pause-free flip: {"requests": {request id: 0}} for each
        request first scheduled after the flip, and {"cached": {request id: prompt tokens taken
        from the prefix cache}} for those of them that hit it."""
        s = self._swap()
        seen = s.get("watch") or {}
        s["watch"] = None
        return {"requests": {rid: 0 for rid in seen}, "cached": {rid: n for rid, n in seen.items() if n}}

    def swap_apply(self, req: str = "") -> dict:
        s = self._swap()
        if _parse(req).get("watch"):
            self._watch_new_requests()
        stager: Stager = s["stager"]
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
