"""Publishing a LoRA run's versions: each the adapter alone, a PEFT adapter directory
RUN_DIR/weights/vNNNNNNNN/ (adapter_model.safetensors, adapter_config.json, then COMPLETE),
written by `transports.adapters.write_adapter`. Megabytes, not the model: no refit plan, no
buckets. Under torchrun every rank gathers the adapter (collective) and rank 0 writes it.

`AdapterPublisher` has the surface the trainer process uses of `publish.Publisher`."""

from __future__ import annotations

import json
import os
import time

import torch

from orchestrator.config.run import TransportConfig
from orchestrator.trainer import lora
from orchestrator.trainer.publish import compare_with_files, weights_root
from transports.adapters import COMPLETE, adapter_dir, published_adapters, write_adapter


class AdapterPublisher:
    """Writes the adapter of the model it was given as version v (`publish(v)`)."""

    # No bucketed refit plan travels with an adapter (Ready.plan_json is ""); no per-rank
    # publish memory is measured (the adapter is gathered whole: megabytes).
    plan_json = ""
    memory = None

    def __init__(self, model: torch.nn.Module, run_dir: str | os.PathLike, transport: TransportConfig,
                 rank: int = 0, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.rank = rank
        self.root = weights_root(run_dir)
        self.keep_last = transport.keep_last
        self.dtype = dtype  # None: the adapter's own dtype
        self.config = lora.adapter_config(model)

    @property
    def layout_json(self) -> str:
        """The adapter's tensor names and (whole) shapes: what every rank must agree on."""
        return json.dumps({name: list(p.shape) for name, p in lora.adapter_parameters(self.model).items()},
                          sort_keys=True)

    def is_complete(self, version: int) -> bool:
        return (adapter_dir(self.root, version) / COMPLETE).exists()

    def published(self) -> list[int]:
        return published_adapters(self.root)

    def compare(self, version: int) -> tuple[int, float]:
        """The adapter's tensors against published `version`'s: (tensors compared, max |diff|)."""
        return compare_with_files(lora.adapter_state(self.model), sorted(adapter_dir(self.root, version).glob("*.safetensors")))

    def load(self, version: int) -> None:
        """Set the adapter to published `version`'s, bit for bit (see `Publisher.load`)."""
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in sorted(adapter_dir(self.root, version).glob("*.safetensors")):
            state.update(load_file(str(file)))
        lora.load_adapter_state(self.model, state)  # cast to the adapter's own dtype

    def publish(self, version: int) -> float:
        """Write `version` (the adapter now in the model); returns the seconds it took. Under
        torchrun every rank calls it (the gather is collective); rank 0 writes."""
        started = time.perf_counter()
        tensors = lora.adapter_state(self.model)
        if self.rank == 0:
            if self.dtype is not None:
                tensors = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in tensors.items()}
            write_adapter(self.root, version, tensors, self.config, self.keep_last)
        return time.perf_counter() - started

    def close(self) -> None:
        """Nothing is held open between publishes."""
