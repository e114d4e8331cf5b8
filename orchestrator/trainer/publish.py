"""Publishing trainer weights as versions through the project's own synchronizer.

The filesystem transport writes RUN_DIR/weights/vNNNNNNNN/ (safetensors buckets, a manifest,
then COMPLETE); engines stage a version from there. Weights travel in fp32 (`wire_dtype=None`
keeps each tensor's own dtype), so what an engine loads is bit-identical to the checkpoint.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from orchestrator.config import TransportConfig


def weights_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "weights"


class Publisher:
    """One filesystem synchronizer over `model.state_dict()`; `publish(v)` writes version v."""

    def __init__(self, model, run_dir: str | os.PathLike, transport: TransportConfig, version: int) -> None:
        from transports.factory import create_weight_synchronizer

        self.root = weights_root(run_dir)
        self.sync = create_weight_synchronizer(
            state_dict=lambda: model.state_dict(), engines=[], colocated=False, transport="filesystem",
            filesystem_root=self.root, keep_last=transport.keep_last, wire_dtype=None,
            timeout_s=transport.timeout_s)
        self.sync.init_communicator()
        # The synchronizer numbers versions by counting mark_stale() calls from 0; ours are
        # optimizer steps, so a resumed trainer starts its counter at the step it resumed at.
        self.sync._version = version

    @property
    def plan_json(self) -> str:
        return self.sync.plan.encode().decode()

    def is_complete(self, version: int) -> bool:
        from transports.filesystem import COMPLETE, version_dir

        return (version_dir(self.root, version) / COMPLETE).exists()

    def published(self) -> list[int]:
        from transports.filesystem import published_versions

        return published_versions(self.root) if self.root.is_dir() else []

    def publish(self, version: int) -> float:
        """Write `version` (the weights now in the model); returns the seconds it took."""
        started = time.perf_counter()
        # With publish_every > 1, or when re-publishing the resumed step, the counter is behind
        # or at `version`: align it so that mark_stale() names exactly this step.
        self.sync._version = version - 1
        self.sync.mark_stale()
        sent = self.sync.sync_weights()
        if sent != version:
            raise RuntimeError(f"synchronizer published version {sent}, expected {version}")
        return time.perf_counter() - started

    def close(self) -> None:
        self.sync.shutdown()
