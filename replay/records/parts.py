"""The nested parts of records, the status union and the known reason strings."""

from __future__ import annotations

import math
from typing import Any, Final

import msgspec

from replay.errors import InvalidRecordError

# Known drop reasons and activation outcomes. They are plain strings on disk (not Literals) so
# that a new value written by a newer orchestrator never makes an older reader fail.
DROP_STALE: Final = "stale"  # exceeded max_off_policy_steps before a trainer step consumed it
DROP_ABORTED: Final = "aborted"  # aborted by an activation under the `abort` KV policy
DROP_SHUTDOWN: Final = "shutdown"  # the run stopped while the rollout was in flight
DROP_GROUP_FAILED: Final = "group_failed"  # another rollout of its group failed
# Why a *completed* rollout was discarded (DiscardRecord.reason), same rules as above.
DISCARD_STALE: Final = "stale"  # completed, but too old for the next trainer step
DISCARD_TRAINER_LOST: Final = "trainer_lost"  # consumed by a trainer step that crashed unfinished
DISCARD_GROUP_FAILED: Final = "group_failed"  # another rollout of its group failed
DISCARD_SHUTDOWN: Final = "shutdown"  # the run stopped before a trainer step consumed it
# RolloutRecord.finish_reason of a completion or episode cut by a length limit (vLLM's word).
FINISH_LENGTH: Final = "length"
ACTIVATED: Final = "activated"
ROLLED_BACK: Final = "rolled_back"
ENGINE_FENCED: Final = "engine_fenced"


# --------------------------------------------------------------------------------------------
# Terminal status: a tagged union nested in the rollout record ({"status": "dropped", ...}).


class Completed(msgspec.Struct, frozen=True, tag="completed", tag_field="status"):
    """The engine finished the completion (stop token, stop string or length limit)."""


class Dropped(msgspec.Struct, frozen=True, tag="dropped", tag_field="status"):
    """The orchestrator discarded the rollout on purpose (see the DROP_* reasons)."""

    reason: str


class Errored(msgspec.Struct, frozen=True, tag="errored", tag_field="status"):
    """The rollout failed: `kind` is a stable short name (e.g. "engine_died"), `message` text."""

    kind: str
    message: str = ""


Status = Completed | Dropped | Errored
STATUS_NAMES: Final = ("completed", "dropped", "errored")


# --------------------------------------------------------------------------------------------
# Nested parts of a rollout record.


class SamplingSettings(msgspec.Struct, frozen=True):
    """The sampling parameters the engine used for this rollout: the one type for sampling
    settings (the orchestrator configures engines with it, the log records it).

    `validate()` checks the ranges (records read from a log are not range-checked, so that an
    old log always reads); `to_vllm()` gives the keyword arguments of `vllm.SamplingParams`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1: disabled
    min_p: float = 0.0
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> SamplingSettings:
        """Return self if every setting is in range, else raise InvalidRecordError naming
        `sampling.<field>`."""
        temperature = _number("temperature", self.temperature)
        if not math.isfinite(temperature) or temperature < 0:
            _bad_sampling("temperature", f"must be finite and >= 0, got {temperature!r}")
        top_p = _number("top_p", self.top_p)
        if not 0 < top_p <= 1:  # also refuses NaN
            _bad_sampling("top_p", f"must be in (0, 1], got {top_p!r}")
        if _integer("top_k", self.top_k) < -1:
            _bad_sampling("top_k", f"must be >= -1 (0 or -1 disable it), got {self.top_k}")
        min_p = _number("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            _bad_sampling("min_p", f"must be in [0, 1], got {min_p!r}")
        if self.max_tokens is not None and _integer("max_tokens", self.max_tokens) < 1:
            _bad_sampling("max_tokens", f"must be None or >= 1, got {self.max_tokens}")
        if _integer("min_tokens", self.min_tokens) < 0:
            _bad_sampling("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad_sampling("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.seed is not None and _integer("seed", self.seed) < 0:
            _bad_sampling("seed", f"must be None or >= 0, got {self.seed}")
        if not isinstance(self.stop, tuple | list) or not all(isinstance(s, str) for s in self.stop):
            _bad_sampling("stop", f"expected a tuple of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple | list):
            _bad_sampling("stop_token_ids", f"expected a tuple of ints, got {self.stop_token_ids!r}")
        for i, token in enumerate(self.stop_token_ids):
            if _integer(f"stop_token_ids[{i}]", token) < 0:
                _bad_sampling(f"stop_token_ids[{i}]", f"must be >= 0, got {token}")
        if not isinstance(self.ignore_eos, bool):
            _bad_sampling("ignore_eos", f"expected bool, got {type(self.ignore_eos).__name__}")
        return self

    def to_vllm(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.SamplingParams` (logprobs=0: the sampled token's own)."""
        kwargs: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "min_tokens": self.min_tokens, "seed": self.seed,
            "stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos, "logprobs": 0,
        }
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        return kwargs


def _bad_sampling(field: str, reason: str) -> None:
    raise InvalidRecordError(f"sampling.{field}", reason)


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _bad_sampling(field, f"expected a number, got {type(value).__name__}")
    return float(value)


def _integer(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _bad_sampling(field, f"expected int, got {type(value).__name__}")
    return value


COMPLETED: Final = Completed()
DEFAULT_SAMPLING: Final = SamplingSettings()


class PolicyIdentity(msgspec.Struct, frozen=True):
    """What names the policy besides the version number."""

    base_checkpoint: str
    tokenizer_hash: str
    chat_template_hash: str
    serving_precision: str
    # Which distribution the recorded logprobs come from: "raw_logprobs" (the model's, before
    # temperature and other processing) or "processed_logprobs" (what was sampled from).
    logprobs_mode: str | None = None
    # A LoRA run: the adapter trained on the frozen base (e.g. "lora r=16 alpha=32 targets=q_proj,
    # v_proj"); the record's version names which adapter. None: the whole model is trained.
    adapter: str | None = None


class Timings(msgspec.Struct, frozen=True):
    """Wall-clock instants (seconds since the epoch) in the life of a rollout."""

    dispatched_at: float
    first_token_at: float | None = None
    finished_at: float | None = None


class EngineActivation(msgspec.Struct, frozen=True):
    """One engine's part in an activation."""

    engine_id: str
    transfer_s: float
    pause_s: float
    outcome: str = ACTIVATED


