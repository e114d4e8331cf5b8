"""The `lora` row of `inflight bench activation`: a version that is a LoRA adapter (rank 16 on
every linear layer of the decoder), loaded natively beside the serving adapters and made live
at one instant (the fleet's `adapter` strategy), on the same engine and model as the full-model
rows, under the same streaming load. The activation reads and builds the adapter on a thread of
the worker, off the engine's step (`orchestrator.engines.adapter_stage`, `transports.lora_stage`:
its staging); then vLLM's `add_lora`, which registers the built adapter and copies it into a slot
between two engine steps, makes it loadable, new requests name it, and the adapter no request
uses any more is unloaded. Its window, as the pause-free row's, runs from the end of the staging
(when the engine's workers were seen holding it built: `Engine.adapter_staged_at`) to the
activation's return: `add_lora`, the flip and the unload are in it. The staging's own added stall
(the longest step gap while it built, against the idle twin's) is reported beside it
(`staging_stall_ms`, median and p90): nothing the adapter costs the steps is left unmeasured.
An engine whose staging is not seen (no swap extension: vLLM reads the files in its step) has
its window from the activation's start.

Reported beside the stall: the bytes a version moves, the adapter file's size against the full
model's weights (goals: stall <= the `pause_free` row's, median and p90; bytes <= 5% of the
model's at rank 16).

`publish_adapter` runs in the benchmark's publishing process, like `activation_publish`.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORAS = 4
ADAPTERS_SUBDIR = "adapters"


def publish_adapter(model_dir: str, root: str, version: int, rank: int = RANK) -> dict:
    """Writes `version` as a random rank-`rank` PEFT adapter on every decoder linear layer of
    `model_dir` (seeded by the version; B non-zero, so outputs change) under root/adapters/;
    returns {"version", "seconds", "adapter_bytes", "model_bytes"} once complete."""
    import torch

    from orchestrator.bench.activation_publish import _base
    from transports.adapters import write_adapter

    started = time.perf_counter()
    base, _plan = _base(model_dir)
    g = torch.Generator().manual_seed(int(version))
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        out_features, in_features = weight.shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = 0.01 * torch.randn(rank, in_features, generator=g)
        tensors[f"base_model.model.{module}.lora_B.weight"] = 0.01 * torch.randn(out_features, rank, generator=g)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "base_model_name_or_path": model_dir}
    path = write_adapter(Path(root) / ADAPTERS_SUBDIR, int(version), tensors, config, keep_last=8)
    return {"version": int(version), "seconds": time.perf_counter() - started,
            "adapter_bytes": (path / "adapter_model.safetensors").stat().st_size,
            "model_bytes": sum(v.numel() * v.element_size() for v in base.values())}


class AdapterLoad:
    """What the streaming load holds: the adapter each new request names (None: the base until
    the first lora activation) and the versions its requests in flight use."""

    def __init__(self) -> None:
        self.adapter = None
        self.in_use: Counter[int] = Counter()

    def users(self, engine_id: str) -> set[int]:
        return {v for v, n in self.in_use.items() if n > 0}


class LoraRow:
    """The lora row's fleet (its loaded adapters persist across repetitions)."""

    def __init__(self, engine, root: Path, load: AdapterLoad) -> None:
        from orchestrator.fleet.adapters import AdapterStore
        from orchestrator.fleet.fleet import Fleet

        self.load = load
        self.fleet = Fleet([engine], strategy="adapter", kv_policy="drain",
                           adapters=AdapterStore(root=root / ADAPTERS_SUBDIR, max_loras=MAX_LORAS))
        self.fleet.adapter_users.append(load.users)
        self.sizes: list[tuple[int, int]] = []  # (adapter bytes, model bytes) per version

    async def activate(self, version: int, live: int) -> tuple[float, float, tuple[float, float]]:
        """Activates adapter `version` over full-model version `live`; returns (t0, t1, staging)."""
        # Full-model rows move the fleet's live version too: this fleet follows (a version number
        # names one activation of the benchmark's engine, whatever it moved).
        self.fleet.coordinator.live_version = live
        from orchestrator.fleet.adapters import adapter_name

        record = await self.fleet.activate(version)
        t1 = time.monotonic()
        if record.outcome != "activated":
            raise RuntimeError(f"lora: activation {record.outcome}: {record.message}")
        self.load.adapter = self.fleet.request_adapter(version)
        begun = self.fleet.coordinator.started_at
        name = adapter_name(version)
        seen = [e.adapter_staged_at[name] for e in self.fleet.engines.values()
                if name in getattr(e, "adapter_staged_at", {})]
        staged_at = max(seen) if len(seen) == len(self.fleet.engines) else begun
        return staged_at, t1, (begun, staged_at)

    def summary(self, result: dict) -> dict:
        """The row's comparisons: stall against pause_swap and pause_free, bytes per version."""
        lora = result.get("lora")
        if lora is None or not self.sizes:
            return {}
        adapter_bytes, model_bytes = self.sizes[-1]
        out = {"rank": RANK, "targets": list(TARGETS), "adapter_bytes": adapter_bytes, "model_bytes": model_bytes,
               "bytes_ratio": adapter_bytes / model_bytes, "stall_ms": lora["stall_ms"],
               "stall_ms_p90": lora["stall_ms_p90"], "window": "from the end of the adapter's staging",
               **{k: lora[k] for k in ("staging_ms", "staging_stall_ms", "staging_stall_ms_p90") if k in lora},
               "goals": {"stall_ms_at_most": "pause_free", "bytes_ratio": 0.05}}
        for other in ("pause_swap", "pause_free"):
            if other in result:
                out[f"{other}_stall_ms"] = result[other]["stall_ms"]
                out[f"{other}_stall_ms_p90"] = result[other]["stall_ms_p90"]
        if "pause_free" in result:
            free = result["pause_free"]
            out["stall_within_pause_free"] = lora["stall_ms"] <= free["stall_ms"]
            out["stall_p90_within_pause_free"] = lora["stall_ms_p90"] <= free["stall_ms_p90"]
        return out
