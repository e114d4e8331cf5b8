"""The trainer's place under torchrun and the collectives its ranks share: `Ranks` (RANK,
WORLD_SIZE, LOCAL_RANK), the process group (gloo on CPU, NCCL on GPU: written, not yet run on a
GPU), FSDP2 sharding per decoder layer, and rank 0's objects broadcast to the others."""

from __future__ import annotations

import os

import msgspec
import torch

from orchestrator.config.run import TrainerConfig


class Ranks(msgspec.Struct, frozen=True):
    """This process's place under torchrun (RANK, WORLD_SIZE, LOCAL_RANK); 0, 1, 0 alone."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1  # ranks on this host (LOCAL_WORLD_SIZE)

    @classmethod
    def from_env(cls) -> Ranks:
        env = os.environ
        return cls(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")),
                   int(env.get("LOCAL_WORLD_SIZE", "1")))

    @property
    def sharded(self) -> bool:
        return self.world > 1


def shard(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> torch.nn.Module:
    """FSDP2: every decoder layer its own unit (gathered for its forward only), then the root
    (embeddings, final norm, head; with LoRA the PeftModel that wraps them). Each rank keeps its
    rows of every parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (ranks.world,))
    layers = decoder_layers(model)
    if layers is None:
        raise RuntimeError(f"{type(model).__name__} has no model.layers: cannot shard it per decoder layer")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def decoder_layers(model: torch.nn.Module):
    """The transformers model's `model.layers`, through a PEFT wrapper (a LoRA run wraps the
    model before it is sharded); None when there is none."""
    inner = model.get_base_model() if callable(getattr(type(model), "get_base_model", None)) else model
    return getattr(getattr(inner, "model", None), "layers", None)


def share(obj, ranks: Ranks):
    """Rank 0's `obj`, on every rank (a collective)."""
    import torch.distributed as dist

    box = [obj if ranks.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def init_group(ranks: Ranks, tc: TrainerConfig) -> None:
    """The process group torchrun's environment describes (MASTER_ADDR/PORT, RANK, WORLD_SIZE):
    gloo for a CPU trainer, NCCL for trainer.device = "cuda" (written, not yet run on a GPU). Its timeout bounds every
    collective: a step, a publish, the start-up."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if tc.device == "cuda" else "gloo"  # trainer.device, checked at the trainer's start
    if backend == "nccl":
        torch.cuda.set_device(ranks.local_rank)
    timeout = datetime.timedelta(seconds=max(tc.start_timeout_s, tc.step_timeout_s))
    dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world, timeout=timeout)
