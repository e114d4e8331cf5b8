"""The trainer's configuration (`[trainer]`, `[trainer.lora]`), apart from the rest of
`orchestrator.config.run` (which re-exports it)."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from orchestrator.errors import ConfigError

# vLLM's engines take these LoRA ranks (its `max_lora_rank`); an adapter of another rank is
# served by the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[trainer.lora]`: train a PEFT LoRA adapter on the frozen base model. Each version is
    the adapter alone (megabytes, not the model), which the engines load natively beside the
    serving ones: no pause (docs/lora.md)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    # Hugging Face module names the adapter wraps (PEFT's `target_modules`).
    target_modules: list[str] = msgspec.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # Adapters an engine keeps loaded at once (vLLM's max_loras): the live one, the one being
    # staged, and those requests in flight still use. None: scheduler.max_off_policy_steps + 2.
    max_loras: int | None = None

    def validate(self) -> LoraConfig:
        if not 1 <= self.rank <= VLLM_LORA_RANKS[-1]:
            raise ConfigError("trainer.lora.rank", f"must be in [1, {VLLM_LORA_RANKS[-1]}], got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError("trainer.lora.alpha", f"must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError("trainer.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("trainer.lora.target_modules", "must name at least one module")
        if self.max_loras is not None and self.max_loras < 2:
            raise ConfigError("trainer.lora.max_loras",
                              f"must be >= 2 (the live adapter and the one being staged), got {self.max_loras}")
        return self

    @property
    def engine_rank(self) -> int:
        """The engine's `max_lora_rank`: the smallest vLLM accepts that holds `rank`."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)

    @property
    def identity(self) -> str:
        """What a run's policy identity records of its adapter (the version names which one)."""
        return f"lora r={self.rank} alpha={self.alpha:g} targets={','.join(self.target_modules)}"

    def resident(self, max_off_policy_steps: int) -> int:
        """Adapters an engine may hold at once (see `max_loras`)."""
        return self.max_loras if self.max_loras is not None else max_off_policy_steps + 2


class TrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The trainer process: optimizer, loss, publishing cadence, checkpoints."""

    lr: float = 3e-3
    # tis: decoupled objective, truncated importance weight min(pi/mu, is_cap) (default: it
    # tolerates staleness); ppo: clipped ratio against the sampled logprobs; icepop: tokens whose
    # ratio leaves [icepop_low, icepop_high] are masked out; plain: no correction.
    loss: Literal["tis", "ppo", "icepop", "plain"] = "tis"
    is_cap: float = 2.0
    ppo_clip: float = 0.2
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    # Group-normalised advantages: (r - mean) / (std + eps); false keeps r - mean (Dr. GRPO).
    normalize_std: bool = True
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    # Publish a new version every k optimizer steps.
    publish_every: int = 1
    # Checkpoint model and optimizer (atomically) at every published version, so --resume continues exactly.
    checkpoint: bool = True
    keep_checkpoints: int = 2
    seed: int = 0
    # torch threads, pinned off the engine's core 0 when it can be; "auto": every core, the
    # engine's too, a share per rank (docs/trainer.md, "Threads and cores": when it pays).
    threads: int | Literal["auto"] = 1
    cpus: list[int] | None = None
    # How long the orchestrator waits for the trainer to start and for one step. The start is
    # torch's import and the model's load, as long as an engine's on a busy host: its 300 s.
    start_timeout_s: float = 300.0
    step_timeout_s: float = 600.0
    # Trainer ranks on this host. 1: one process. N > 1: `torchrun --nproc-per-node N`, the model
    # sharded with FSDP2 (fully_shard) over gloo on CPU (NCCL on GPU); rank 0 speaks the link.
    world_size: int = 1
    # Extra torchrun flags, e.g. ["--nnodes=2", "--node-rank=0", "--master-addr=HOST",
    # "--master-port=29500"] to span hosts (docs/trainer.md); a list also starts torchrun when
    # world_size = 1. --nproc-per-node is world_size's.
    torchrun_args: list[str] = []
    # Publishing packs the weights into buckets of at most this many bytes (a larger tensor
    # travels alone): the trainer's extra memory while it publishes stays within two buckets
    # plus the largest tensor, on every rank.
    bucket_bytes: int = 64 << 20
    # Where the trainer holds and computes the model. "cuda" needs a CUDA device where the
    # trainer starts (else ConfigError at its start); under torchrun each rank takes
    # cuda:LOCAL_RANK. Written, not yet run on a GPU.
    device: Literal["cpu", "cuda"] = "cpu"
    # The dtype the trainer holds and computes the model in (its gradients and Adam state too:
    # no fp32 master copy). Published weights keep the engine's dtype (docs/trainer.md).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Gradient accumulation: each micro-batch's padded size (rows x its longest prompt +
    # completion) within this many tokens, samples bucketed by length, one optimizer step per
    # batch (the same as the whole batch at once). None: the whole batch in one pass.
    micro_batch_tokens: int | None = None
    # Train a LoRA adapter instead of the whole model (see LoraConfig); None: the whole model.
    lora: LoraConfig | None = None
    # 1: checkpoint (model + optimizer) at every published version. k > 1 (a multiple of
    # publish_every, one process only): every k-th step, each step between journaled (its
    # batch, kilobytes), and --resume trains those steps again from the checkpoint: the same
    # state on the same machine (docs/trainer.md, "Checkpoints").
    checkpoint_every: int = 1
    # Write each checkpoint from a snapshot in a background thread while the next step trains,
    # every step journaled meanwhile (docs/trainer.md, "Checkpoints"). None: on for one trainer
    # process, off under torchrun (its ranks gather the state together).
    checkpoint_background: bool | None = None
    # Background checkpoints skipped in a row (the writer still busy) before the next due one
    # waits for the writer and is written: bounds the steps a resume trains again (k + 2
    # checkpoint intervals at most) and so its time.
    checkpoint_max_skips: int = 2
    # A bound on one step's move of the policy, in nats a token: the rate is scaled down (at most
    # to lr / 1000) while steps move the sampled tokens' distribution by more than twice this,
    # back up towards `lr` while by less than half (orchestrator/trainer/kl_control.py;
    # docs/trainer.md, "One step's size"). Measured from samples older than the trainer, so a
    # synchronous loop (every sample lag 0) keeps `lr`. None: `lr` at every step.
    kl_target: float | None = None

    @property
    def torchrun(self) -> bool:
        """Started under torchrun (several ranks, or torchrun flags given)."""
        return self.world_size > 1 or bool(self.torchrun_args)

    @property
    def background_checkpoints(self) -> bool:
        if not self.checkpoint:
            return False
        return not self.torchrun if self.checkpoint_background is None else self.checkpoint_background

    @property
    def journaled(self) -> bool:
        """Steps without a checkpoint of their own are journaled (step_journal)."""
        return self.checkpoint and (self.checkpoint_every > 1 or self.background_checkpoints)

    def validate(self) -> TrainerConfig:
        for name in ("lr", "is_cap", "ppo_clip", "icepop_high", "start_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"trainer.{name}", f"must be > 0, got {getattr(self, name)}")
        if not 0 < self.icepop_low < self.icepop_high:
            raise ConfigError("trainer.icepop_low", f"must be in (0, icepop_high), got {self.icepop_low}")
        if self.threads != "auto" and self.threads < 1:
            raise ConfigError("trainer.threads", f'must be >= 1 or "auto", got {self.threads}')
        for name in ("publish_every", "keep_checkpoints", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every > 1 and self.checkpoint_every % self.publish_every:
            raise ConfigError("trainer.checkpoint_every", f"must be a multiple of trainer.publish_every "
                                                          f"({self.publish_every}), got {self.checkpoint_every}")
        if self.checkpoint_every > 1 and self.torchrun:
            raise ConfigError("trainer.checkpoint_every", "> 1 needs one trainer process (world_size = 1, no "
                                                          "torchrun_args): several ranks checkpoint every version")
        if self.checkpoint_background and self.torchrun:
            raise ConfigError("trainer.checkpoint_background", "needs one trainer process (world_size = 1, no "
                                                               "torchrun_args): under torchrun the ranks gather "
                                                               "each checkpoint together")
        if self.checkpoint_max_skips < 0:
            raise ConfigError("trainer.checkpoint_max_skips", f"must be >= 0, got {self.checkpoint_max_skips}")
        if self.kl_target is not None and not (self.kl_target > 0 and math.isfinite(self.kl_target)):
            raise ConfigError("trainer.kl_target", f"must be > 0 (or unset), got {self.kl_target}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("trainer.grad_clip" if self.grad_clip < 0 else "trainer.weight_decay", "must be >= 0")
        if self.world_size < 1:
            raise ConfigError("trainer.world_size", f"must be >= 1, got {self.world_size}")
        if self.bucket_bytes < 1:
            raise ConfigError("trainer.bucket_bytes", f"must be >= 1, got {self.bucket_bytes}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError("trainer.micro_batch_tokens", f"must be >= 1 (or unset), got {self.micro_batch_tokens}")
        for i, arg in enumerate(self.torchrun_args):
            flag = arg.split("=", 1)[0].replace("_", "-")
            if flag in ("--nproc-per-node", "-m", "--module", "--no-python"):
                raise ConfigError(f"trainer.torchrun_args[{i}]",
                                  f"{arg!r} is set by the launcher (ranks per host: trainer.world_size)")
            if not arg.startswith("-"):
                raise ConfigError(f"trainer.torchrun_args[{i}]",
                                  f"{arg!r} is not a flag: write each as --name=value")
            if flag == "--node-rank" and arg.split("=", 1)[1:] != ["0"]:
                raise ConfigError(f"trainer.torchrun_args[{i}]",
                                  f"{arg!r}: the orchestrator's host is node 0 (its rank 0 speaks the link on "
                                  "127.0.0.1); the other hosts run the logged trainer.command with their own "
                                  "--node-rank")
            if flag == "--max-restarts" and arg.split("=", 1)[1:] != ["0"]:
                # A restarted rank 0 would greet the orchestrator's link with a second Ready in the
                # middle of the run; the run resumes instead (`inflight run --resume`).
                raise ConfigError(f"trainer.torchrun_args[{i}]",
                                  f"{arg!r}: torchrun must not restart the trainer's ranks (a failed trainer "
                                  "stops the run, which then resumes from its checkpoint)")
        if self.lora is not None:
            self.lora.validate()
        flags = {a.split("=", 1)[0].replace("_", "-"): a.split("=", 1)[1:] for a in self.torchrun_args}
        if flags.get("--nnodes", ["1"]) != ["1"] and not flags.keys() & {"--master-addr", "--rdzv-endpoint"}:
            # Without one, the launcher's rendezvous is 127.0.0.1: no other host could join it.
            raise ConfigError("trainer.torchrun_args", "--nnodes other than 1 needs --master-addr (or "
                                                       "--rdzv-endpoint): the address the other hosts reach")
        return self
