"""Publishing for `inflight bench activation`, the way a trainer does it: in another process.

`publish_version` runs in a worker process (`anyio.to_process.run_sync`), so perturbing and
writing the whole model never blocks the benchmark's event loop, the one that timestamps
tokens; the benchmark awaits it before it opens a measured window. The process keeps the base
weights and the refit plan between calls (one load per model). Module-level functions only:
they travel to the worker process by reference.
"""

from __future__ import annotations

import time
from pathlib import Path

_CACHE: dict[str, tuple] = {}


def _base(model_dir: str):
    """(base weights, refit plan) of `model_dir`, loaded once per process."""
    cached = _CACHE.get(model_dir)
    if cached is None:
        from safetensors.torch import load_file

        from transports.refit.plan import RefitPlan

        base = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            base.update(load_file(f))
        if not base:
            raise FileNotFoundError(f"no safetensors file in {model_dir}")
        plan = RefitPlan.build({k: (tuple(v.shape), v.dtype) for k, v in base.items()}, wire_dtype=None)
        cached = _CACHE[model_dir] = (base, plan)
    return cached


def describe(model_dir: str) -> dict:
    """{"parameters": n, "plan": the refit plan as JSON} for the engines' `swap_init`."""
    base, plan = _base(model_dir)
    return {"parameters": sum(v.numel() for v in base.values()), "plan": plan.encode().decode()}


def publish_version(model_dir: str, root: str, version: int, scale: float = 0.01) -> dict:
    """Writes and commits `version` (base + `scale` * seeded noise) to the filesystem transport
    at `root`; returns {"version", "seconds"} once committed."""
    import torch

    from transports.filesystem import FilesystemSender

    started = time.perf_counter()
    base, plan = _base(model_dir)
    g = torch.Generator().manual_seed(int(version))
    state = {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in base.items()}
    sender = FilesystemSender(root, keep_last=3, fsync=False)
    try:
        sender.begin(int(version), plan.bucket_count)
        for header, payload in plan.pack(state, version=int(version)):
            sender.send(header, payload)
        sender.commit(int(version))
    finally:
        sender.close()
    return {"version": int(version), "seconds": time.perf_counter() - started}
