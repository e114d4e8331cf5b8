"""The trainer process of a coordinated activation, and the figures of the `end_to_end` row of
`inflight bench transports --end-to-end` (the engine side is `orchestrator.bench.end_to_end`:
transports never imports orchestrator).

A trainer process (`python -m transports.bench.end_to_end trainer CONFIG_JSON`) holds a model's
weights and a sending-only `TransportSynchronizer` (`create_weight_synchronizer(engines=[],
engine_count=n, ...)`): it never talks to the engines' control plane; each engine's swap worker
extension stages what it sends, and the fleet's activation makes the version live on every
engine at one instant. It speaks JSON lines: stdout carries only the answers (logs go to
stderr), stdin the commands.

    started           {"plan": plan json, "options": [engine i's receiver options, ...]}
                      then, once every engine's receiver joined: {"connected": true}
    {"cmd": "sync", "seed": s, "fault": f}
                      with `seed`: weights := the checkpoint perturbed by `seed`, `mark_stale()`;
                      then `sync_weights()`: {"ok": bool, "version": v, "started": t0,
                      "ended": t1, "error": ...} (times on `time.monotonic()`, system-wide)
    {"cmd": "reconnect"}
                      a fresh sender (a collective group broken by a failed version needs a new
                      rendezvous): {"options": [...]}, then {"connected": ...}
    {"cmd": "exclude", "engine": i} / {"cmd": "include", "engine": i}
                      leave engine i out of the versions that follow / take it back
                      (`exclude_engine` / `include_engine`): {"ok": bool, "error": ...}
    {"cmd": "stop"}

CONFIG_JSON: {"transport", "model_dir", "engines", "timeout_s", "bucket_bytes", "root" (the
filesystem transport), "start_version" (the version the engines serve), "wrapper": "module:function"} where `wrapper(sender, fault)` may wrap the
sender for one sync (the tests inject faults that way; nothing here knows of faults).
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from transports.errors import TransportError, TransportTimeoutError


def perturbed_state(base: Mapping[str, Any], seed: int, scale: float = 0.5) -> dict[str, Any]:
    """`base` moved far enough to change every logprob (fp32, deterministic in `seed`)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: (v + scale * v.std().clamp(min=0.02) * torch.randn(v.shape, generator=g)).contiguous()
            for k, v in base.items()}


def end_to_end_figures(*, end_to_end_s: float, raw_transfer_s: float, activation_s: float,
                       tokens_per_s_transfer: float | None, tokens_per_s_idle: float | None) -> dict[str, Any]:
    """The row's figures. `ratio` = (raw transfer + activation) / end to end: 1.0 means the
    whole path costs nothing beyond its two parts; lower is overhead. Unknown stays absent."""
    out: dict[str, Any] = {"end_to_end_s": round(end_to_end_s, 4), "raw_transfer_s": round(raw_transfer_s, 4),
                           "activation_s": round(activation_s, 4)}
    if end_to_end_s > 0:
        out["ratio"] = round((raw_transfer_s + activation_s) / end_to_end_s, 4)
    if tokens_per_s_transfer is not None:
        out["tokens_per_s_transfer"] = round(tokens_per_s_transfer, 1)
    if tokens_per_s_idle is not None:
        out["tokens_per_s_idle"] = round(tokens_per_s_idle, 1)
        if tokens_per_s_transfer is not None and tokens_per_s_idle > 0:
            out["throughput_during_transfer_ratio"] = round(tokens_per_s_transfer / tokens_per_s_idle, 4)
    return out


# ---------------------------------------------------------------------------------------------
# the parent's handle on a trainer process


class TrainerProcess:
    """Starts the trainer process and exchanges JSON lines with it; every read has a timeout."""

    def __init__(self, config: dict[str, Any], *, stderr=None) -> None:
        self.config = config
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transports.bench.end_to_end", "trainer", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1, env=env)
        self._lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read_lines, name="trainer-stdout", daemon=True)
        self._reader.start()

    def _read_lines(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # the process ended

    def read(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty as exc:
            raise TransportTimeoutError("the trainer process to answer", timeout_s) from exc
        if line is None:
            raise TransportError(f"the trainer process ended (exit code {self.proc.poll()})")
        return json.loads(line)

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def close(self, timeout_s: float = 30.0) -> None:
        try:
            if self.proc.poll() is None:
                self.send(cmd="stop")
            self.proc.wait(timeout_s)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


# ---------------------------------------------------------------------------------------------
# the trainer process itself


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _load_wrapper(spec: str | None):
    if not spec:
        return None
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def trainer_main(config: dict[str, Any]) -> int:
    import structlog
    import torch

    from transports.factory import TrainCluster, create_weight_synchronizer
    from transports.lora import load_safetensors_dir

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    torch.set_num_threads(1)
    transport = config["transport"]
    engines = int(config.get("engines", 2))
    base = load_safetensors_dir(config["model_dir"], torch.float32)
    state = {k: v.clone() for k, v in base.items()}
    wrapper = _load_wrapper(config.get("wrapper"))
    sync = create_weight_synchronizer(
        state_dict=lambda: state, engines=[], engine_count=engines, colocated=transport in ("ipc", "http"),
        transport=transport, train_cluster=TrainCluster(), inference_world_size=engines,
        filesystem_root=config.get("root"), bucket_bytes=config.get("bucket_bytes"), wire_dtype=None,
        timeout_s=float(config.get("timeout_s", 60.0)))

    def options() -> list[dict[str, Any]]:
        return [sync.engine_init_info(i)["options"] for i in range(engines)]  # type: ignore[attr-defined]

    def connect() -> None:
        try:
            sync.init_communicator()
            _emit({"connected": True})
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            _emit({"connected": False, "error": f"{type(exc).__name__}: {exc}"})

    # Versions continue the engines' numbering (a fleet already serving version n).
    for _ in range(int(config.get("start_version", 0))):
        sync.mark_stale()
    _emit({"plan": sync.plan.encode().decode(), "options": options()})
    connect()
    for line in sys.stdin:
        command = json.loads(line)
        kind = command.get("cmd")
        if kind == "stop":
            break
        if kind == "reconnect":
            sync.reconnect()  # type: ignore[attr-defined]
            _emit({"options": options()})
            connect()
            continue
        if kind in ("exclude", "include"):
            try:
                getattr(sync, f"{kind}_engine")(int(command["engine"]))
                _emit({"ok": True})
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                _emit({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        if kind != "sync":
            _emit({"ok": False, "error": f"unknown command {kind!r}"})
            continue
        if command.get("seed") is not None:
            state.update(perturbed_state(base, int(command["seed"])))
            sync.mark_stale()
        real = sync.sender  # type: ignore[attr-defined]
        if wrapper is not None and command.get("fault"):
            sync.sender = wrapper(real, command["fault"])  # type: ignore[attr-defined]
        started = time.monotonic()
        try:
            version = sync.sync_weights()
            _emit({"ok": True, "version": version, "started": started, "ended": time.monotonic()})
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            _emit({"ok": False, "version": sync.version, "started": started, "ended": time.monotonic(),
                   "error": f"{type(exc).__name__}: {exc}"})
        finally:
            sync.sender = real  # type: ignore[attr-defined]
    sync.shutdown()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "trainer":
        print("usage: python -m transports.bench.end_to_end trainer CONFIG_JSON", file=sys.stderr)
        sys.exit(2)
    sys.exit(trainer_main(json.loads(sys.argv[2])))
