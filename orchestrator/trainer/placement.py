"""Where the trainer runs on this machine: its device (`trainer.device`), the dtype it publishes
in, and its cores and torch threads (`trainer.threads`, `trainer.cpus`)."""

from __future__ import annotations

import os

import torch

from orchestrator.config.run import RunConfig, TrainerConfig
from orchestrator.errors import ConfigError
from orchestrator.trainer.ranks import Ranks


def trainer_device(tc: TrainerConfig, ranks: Ranks) -> torch.device:
    """`trainer.device` on this machine: "cuda" is cuda:LOCAL_RANK (0 alone), and needs a device."""
    if tc.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device", "\"cuda\", but this machine has no CUDA device that torch can use "
                                            "(torch.cuda.is_available() is false): set \"cpu\"")
    return torch.device("cuda", ranks.local_rank)


def published_dtype(config: RunConfig) -> torch.dtype | None:
    """What the trainer publishes in. A float32 trainer publishes its own tensors, as ever
    (None); one that holds another dtype publishes in the engine's dtype, so that an fp32 engine
    still receives fp32 tensors (of the trainer's values) and a bf16 one bf16 ("auto": fp32,
    the widest; the engine casts what it loads to its own)."""
    if config.trainer.dtype == "float32":
        return None
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "auto": torch.float32}[config.engine.dtype]


def pin(tc: TrainerConfig, local_ranks: int = 1) -> tuple[set[int], int]:
    """The trainer's cores and torch threads. By default it keeps off the engine's core (vLLM's
    CPU worker pins itself to core 0); threads = "auto" takes every core this process may use,
    the engine's included, a share per rank on this host."""
    available = os.sched_getaffinity(0)
    if tc.cpus:
        cpus = set(tc.cpus)
    elif tc.threads == "auto":
        cpus = set(available)
    else:
        cpus = (available - {0}) or available
    os.sched_setaffinity(0, cpus)
    threads = max(1, len(cpus) // max(1, local_ranks)) if tc.threads == "auto" else tc.threads
    torch.set_num_threads(threads)
    torch.manual_seed(tc.seed)
    return cpus, threads
