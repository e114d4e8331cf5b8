"""One vLLM engine's settings (`[engine]`, `[[engines]]`): how to start or reach it."""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from orchestrator.errors import ConfigError


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to start (or reach) one vLLM engine."""

    model: str = "models/tiny"
    kind: Literal["inproc", "server"] = "inproc"
    # For kind="server": attach to this URL instead of starting a process.
    url: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    seed: int = 0
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    kv_cache_gib: int = 1
    # Imported in every worker before the model loads (weight-transfer receivers live there).
    worker_extension_cls: str | None = None
    weight_transfer_backend: str | None = None
    start_timeout_s: float = 300.0
    # Longest wait for the next streamed chunk of one request before EngineTimeoutError.
    chunk_timeout_s: float = 120.0
    # Pause/resume/abort/health and other control calls.
    control_timeout_s: float = 60.0
    port: int | None = None  # kind="server": None picks a free port on 127.0.0.1
    # Which distribution the sampled logprobs come from: vLLM's default "raw_logprobs" (before
    # temperature / top-k / top-p) or "processed_logprobs" (what was sampled from). None: vLLM's
    # default. `inflight run` picks processed_logprobs when the sampling is not plain.
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = None
    # LoRA adapters served natively (vLLM's enable_lora, max_lora_rank, max_loras): set by
    # `inflight run` from [trainer.lora]; requests name their adapter (`Engine.load_adapter`).
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    # kind="server": vLLM's --shutdown-timeout (seconds a SIGTERM lets in-flight requests finish
    # while new ones are refused); set by `inflight run` from fleet.drain_s. None: vLLM's (abort).
    shutdown_timeout_s: int | None = None
    # How vLLM starts the engine's processes. "fork" (transports.server_main): a server's engine
    # core and worker are forked from its API server, an in-process engine's worker from its
    # engine core (which is spawned: its parent is the orchestrator), so vLLM is not imported
    # again in each; about half a server's start-up. "spawn": vLLM's own (its CPU platform's
    # choice), for a vLLM where fork misbehaves.
    start_method: Literal["fork", "spawn"] = "fork"
    # kind="server", CPU builds: the cores the engine's worker binds (vLLM's
    # VLLM_CPU_OMP_THREADS_BIND: "1", "0-3", "0,2"). None: vLLM's own choice (`auto`, which binds
    # every engine of a host to the same cores: two engines on one host then take turns there).
    cpu_bind: str | None = None

    def validate(self) -> EngineConfig:
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ConfigError("engine.max_model_len", f"must be >= 16, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError("engine.max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_gib <= 0:
            raise ConfigError("engine.kv_cache_gib", f"must be > 0, got {self.kv_cache_gib}")
        for name in ("start_timeout_s", "chunk_timeout_s", "control_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"engine.{name}", f"must be > 0, got {getattr(self, name)}")
        if self.enable_lora and self.max_loras < 1:
            raise ConfigError("engine.max_loras", f"must be >= 1, got {self.max_loras}")
        if self.kind == "inproc" and self.url is not None:
            raise ConfigError("engine.url", "only meaningful with kind = \"server\"")
        if self.cpu_bind is not None:
            if self.kind != "server" or self.url is not None:
                raise ConfigError("engine.cpu_bind", "only for a server engine the run starts (kind = \"server\", "
                                  "no url): an in-process engine's worker binds what the orchestrator's "
                                  "VLLM_CPU_OMP_THREADS_BIND says, an attached server what it was started with")
            if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", self.cpu_bind):
                raise ConfigError("engine.cpu_bind", f"cores as vLLM's VLLM_CPU_OMP_THREADS_BIND takes them "
                                  f"(\"1\", \"0-3\", \"0,2\"), got {self.cpu_bind!r}")
        return self
