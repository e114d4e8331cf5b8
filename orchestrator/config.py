"""Configuration types (msgspec Structs), loaded from TOML. A bad field names itself."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from orchestrator.engines.base import SamplingSettings
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
        if self.kind == "inproc" and self.url is not None:
            raise ConfigError("engine.url", "only meaningful with kind = \"server\"")
        return self


class ActivationConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a staged version becomes live on the fleet (docs/activation.md)."""

    # pause_swap: copy staged weights in during a pause; double_buffer: flip to a second,
    # engine-ready copy during a pause; pause_free: that flip between two engine steps.
    strategy: Literal["pause_swap", "double_buffer", "pause_free"] = "pause_swap"
    # What happens to requests in flight at the swap.
    kv_policy: Literal["recompute", "keep", "drain", "abort"] = "recompute"
    stage_s: float = 120.0
    drain_s: float = 30.0
    pause_s: float = 30.0
    swap_s: float = 60.0
    resume_s: float = 30.0
    rejoin_s: float = 180.0

    def validate(self) -> ActivationConfig:
        for name in ("stage_s", "drain_s", "pause_s", "swap_s", "resume_s", "rejoin_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"activation.{name}", f"must be > 0, got {getattr(self, name)}")
        if self.strategy == "pause_free" and self.kv_policy == "recompute":
            # Recomputing in-flight keys/values needs the engine paused; the flip has no pause.
            raise ConfigError("activation.kv_policy",
                              "recompute needs a pause; with strategy pause_free use keep, drain or abort")
        return self

    def timeouts(self):
        from orchestrator.activation import PhaseTimeouts

        return PhaseTimeouts(stage_s=self.stage_s, drain_s=self.drain_s, pause_s=self.pause_s,
                             swap_s=self.swap_s, resume_s=self.resume_s, rejoin_s=self.rejoin_s)


class RunConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A TOML config file: `[engine]` and `[activation]` tables (more to come with `inflight run`)."""

    engine: EngineConfig = EngineConfig()
    engines: int = 1
    activation: ActivationConfig = ActivationConfig()

    def validate(self) -> RunConfig:
        if self.engines < 1:
            raise ConfigError("engines", f"must be >= 1, got {self.engines}")
        self.engine.validate()
        self.activation.validate()
        return self


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a TOML config; errors name the field, e.g. `activation.kv_policy`."""
    return convert(_load_toml(Path(path)), RunConfig, "").validate()


def _load_toml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(str(path), "config file does not exist")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None


def convert(data: object, type_: type, where: str):
    """msgspec conversion whose error names the field path, e.g. `engine.max_num_seqs`."""
    try:
        return msgspec.convert(data, type_, strict=True)
    except msgspec.ValidationError as exc:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.engine.max_num_seqs`".
        message = str(exc)
        field = where
        if " - at `$" in message:
            message, _, path = message.partition(" - at `$")
            field = (where + path.rstrip("`")).strip(".") if where else path.rstrip("`").lstrip(".")
        raise ConfigError(field or "config", message) from None


__all__ = ["ActivationConfig", "ConfigError", "EngineConfig", "RunConfig", "SamplingSettings",
           "convert", "load_config"]
