"""The trainer's place under torchrun and the collectives its ranks share: `Ranks` (RANK,
WORLD_SIZE, LOCAL_RANK), the process group (gloo on CPU, NCCL on GPU: written, not yet run on a
GPU), FSDP2 sharding per decoder layer, and rank 0's objects broadcast to the others."""

from __future__ import annotations

import os

import msgspec
import torch

from orchestrator.config.run import TrainerConfig
from orchestrator.observe.logging import get_logger

log = get_logger("orchestrator.trainer")


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


# How long ranks that end together wait for each other before tearing the group down.
LEAVE_TIMEOUT_S = 30.0


def leave_group(together: bool, timeout_s: float = LEAVE_TIMEOUT_S) -> None:
    """Tear the process group down. Ranks that end together first wait for each other
    (bounded), so that no rank tears its gloo group down while another still uses it: without
    this wait, a clean stop once failed in CI with rank 1 aborted at exit ("terminate called
    without an active exception", SIGABRT) while rank 0 was still cleaning up; it was seen once
    in about ten runs and not reproduced, so this is the likely cause, not a proven one. A rank
    that failed alone does not wait: the others may never come."""
    import datetime

    import torch.distributed as dist

    if together:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
            else:
                dist.barrier()  # NCCL: written, not yet run on a GPU
        except Exception as exc:  # noqa: BLE001 - a rank gone at the end: tear down all the same
            log.warning("trainer.leave_barrier_failed", error=str(exc))
    dist.destroy_process_group()
