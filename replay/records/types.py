"""The top-level records: a tagged union keyed by "type"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import numpy as np

from replay.errors import InvalidRecordError
from replay.records.checks import (
    FLOAT32,
    INT32,
    _as_blob,
    _change_points,
    _check_float_blob,
    _check_metrics,
    _check_rollout,
    _require_int,
    int32_values,
)
from replay.records.parts import (
    COMPLETED,
    DEFAULT_SAMPLING,
    EngineActivation,
    PolicyIdentity,
    SamplingSettings,
    Status,
    Timings,
)


class RolloutRecord(msgspec.Struct, frozen=True, tag="rollout", tag_field="type"):
    """One sampled completion for one prompt, written once when it reaches a terminal status.

    Build one from Python lists or numpy arrays with `RolloutRecord.from_lists(...)`.
    """

    rollout_id: int
    group_id: int
    prompt_id: str
    engine_id: str
    prompt_token_ids: bytes  # int32 little-endian
    completion_token_ids: bytes  # int32 little-endian
    completion_logprobs: bytes  # float32 little-endian, one per completion token
    version_starts: bytes  # int32: first token index of each version run (0, then increasing)
    version_values: bytes  # int32: the version of each run (never decreasing)
    dispatched_version: int  # the live version when the rollout's group was dispatched
    kv_carried_across_versions: bool  # keys/values computed by an older version were kept
    status: Status
    rewards: dict[str, float]
    sampling: SamplingSettings
    identity: PolicyIdentity
    timings: Timings
    consumed_step: int | None = None  # trainer step that consumed it (see ConsumptionRecord)
    # A multi-turn episode: int32 (start, end) pairs, the completion-token ranges the environment
    # wrote (tool output, feedback, the chat template's turn delimiters): never sampled, so their
    # logprobs are NaN (absent) and the trainer's loss leaves them out. Empty: every completion
    # token was sampled (a single-turn rollout, and every log written before episodes existed).
    environment_spans: bytes = b""
    # Why a multi-turn episode ended: "done" (its environment or agent said so), "max_turns",
    # "max_episode_tokens", "malformed_tool_call"; None: not an episode (or no episode ran).
    episode_end: str | None = None
    # Why generation ended, as observed: the engine's finish reason ("stop", "length", "abort")
    # of a single-turn completion, of an episode's last turn, or "length" for an episode cut at
    # its max_episode_tokens (a truncation: scored, never retried). None: not observed (no engine
    # answered, or a log written before this field).
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        _check_rollout(self)

    # -- building -----------------------------------------------------------------------------

    @classmethod
    def from_lists(
        cls,
        *,
        rollout_id: int,
        group_id: int,
        prompt_id: str,
        engine_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        completion_token_ids: Sequence[int] | np.ndarray,
        completion_logprobs: Sequence[float] | np.ndarray,
        dispatched_version: int,
        identity: PolicyIdentity,
        timings: Timings,
        token_versions: Sequence[int] | np.ndarray | None = None,
        version_changes: Sequence[tuple[int, int]] | None = None,
        kv_carried_across_versions: bool = False,
        status: Status = COMPLETED,
        rewards: dict[str, float] | None = None,
        sampling: SamplingSettings = DEFAULT_SAMPLING,
        consumed_step: int | None = None,
        environment_spans: Sequence[tuple[int, int]] | None = None,
        episode_end: str | None = None,
        finish_reason: str | None = None,
    ) -> RolloutRecord:
        """Build a record from lists/arrays.

        Give the per-token versions either as `token_versions` (one per completion token) or
        as `version_changes` [(first_token_index, version), ...]; with neither, every token is
        attributed to `dispatched_version`. `environment_spans` [(start, end), ...]: the
        completion tokens the environment wrote (their logprobs must be NaN: none exists).
        """
        completion = _as_blob(completion_token_ids, INT32)
        n_tokens = len(completion) // 4
        starts, values = _change_points(n_tokens, dispatched_version, token_versions, version_changes)
        return cls(
            rollout_id=rollout_id,
            group_id=group_id,
            prompt_id=prompt_id,
            engine_id=engine_id,
            prompt_token_ids=_as_blob(prompt_token_ids, INT32),
            completion_token_ids=completion,
            completion_logprobs=_as_blob(completion_logprobs, FLOAT32),
            version_starts=starts,
            version_values=values,
            dispatched_version=dispatched_version,
            kv_carried_across_versions=kv_carried_across_versions,
            status=status,
            rewards=dict(rewards or {}),
            sampling=sampling,
            identity=identity,
            timings=timings,
            consumed_step=consumed_step,
            environment_spans=_as_blob([x for span in environment_spans or () for x in span], INT32),
            episode_end=episode_end,
            finish_reason=finish_reason,
        )

    # -- reading ------------------------------------------------------------------------------

    def prompt_tokens(self) -> np.ndarray:
        return np.frombuffer(self.prompt_token_ids, INT32)

    def completion_tokens(self) -> np.ndarray:
        return np.frombuffer(self.completion_token_ids, INT32)

    def logprobs(self) -> np.ndarray:
        return np.frombuffer(self.completion_logprobs, FLOAT32)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_token_ids) // 4

    def environment_ranges(self) -> list[tuple[int, int]]:
        """[(start, end), ...]: completion tokens the environment wrote (none: all sampled)."""
        flat = int32_values(self.environment_spans)
        return list(zip(flat[0::2], flat[1::2], strict=True))

    def sampled_mask(self) -> np.ndarray:
        """Per completion token: True where the model sampled it."""
        mask = np.ones(self.num_completion_tokens, dtype=bool)
        for start, end in self.environment_ranges():
            mask[start:end] = False
        return mask

    @property
    def turns(self) -> int:
        """Model turns: each environment span sits between two of them; 0 with no completion."""
        return len(self.environment_spans) // 8 + 1 if self.completion_token_ids else 0

    def change_points(self) -> list[tuple[int, int]]:
        """[(first_token_index, version), ...]"""
        return list(zip(int32_values(self.version_starts), int32_values(self.version_values), strict=True))

    def expand_versions(self) -> np.ndarray:
        """The policy version of every completion token (int32 array)."""
        starts = np.frombuffer(self.version_starts, INT32).astype(np.int64)
        values = np.frombuffer(self.version_values, INT32)
        run_lengths = np.diff(np.append(starts, self.num_completion_tokens))
        return np.repeat(values, run_lengths).astype(np.int32)

    @property
    def version_span(self) -> tuple[int, int]:
        """(first, last) version of the completion's tokens; the dispatched version if none."""
        values = int32_values(self.version_values)
        if not values:
            return (self.dispatched_version, self.dispatched_version)
        return (values[0], values[-1])

    @property
    def status_name(self) -> str:
        return type(self.status).__struct_config__.tag  # type: ignore[return-value]


class ActivationRecord(msgspec.Struct, frozen=True, tag="activation", tag_field="type"):
    """One attempt to make `version` live on every engine."""

    version: int
    outcome: str  # ACTIVATED, ROLLED_BACK, ENGINE_FENCED or another short name
    engines: list[EngineActivation]
    activated_at: float | None = None
    message: str = ""
    strategy: str = ""  # pause_swap, double_buffer, pause_free or adapter ("" in logs before it existed)
    kv_policy: str = ""  # recompute, keep, drain or abort
    kv_carried: bool = False  # some in-flight request kept keys/values of the older version

    def __post_init__(self) -> None:
        _require_int("version", self.version)
        for i, engine in enumerate(self.engines):
            for name in ("transfer_s", "pause_s"):
                value = getattr(engine, name, None)
                if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                    raise InvalidRecordError(f"engines[{i}].{name}",
                                             f"expected a finite duration >= 0, got {value!r}")


class ConsumptionRecord(msgspec.Struct, frozen=True, tag="consumption", tag_field="type"):
    """Trainer step `step` consumed these rollouts (the log is append-only, so consumption is a
    record of its own; readers join it onto the rollouts), and what the step measured.

    Per-rollout values are little-endian float32 blobs aligned with `rollout_ids` (empty: not
    recorded); build them with `ConsumptionRecord.from_arrays`. A rollout consumed twice is an
    error of the writer: readers keep the first consumption in log order (replay.query.ledger).
    """

    step: int
    rollout_ids: list[int]
    advantages: bytes = b""  # float32 per rollout
    log_ratio_mean: bytes = b""  # float32 per rollout: mean over its tokens of trainer - recorded logprob
    log_ratio_max_abs: bytes = b""  # float32 per rollout: max |trainer - recorded logprob|
    reward_mean: float | None = None
    loss: float | None = None
    version: int | None = None  # the version this step published; None if it published none
    metrics: dict[str, float] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        _require_int("step", self.step)
        if self.step < 0:
            raise InvalidRecordError("step", f"must be >= 0, got {self.step}")
        if self.version is not None:
            _require_int("version", self.version)
            if self.version < 0:
                raise InvalidRecordError("version", f"must be >= 0, got {self.version}")
        if self.advantages or self.log_ratio_mean or self.log_ratio_max_abs:
            for name in _CONSUMPTION_BLOBS:
                _check_float_blob(name, getattr(self, name), len(self.rollout_ids))
        for name in ("reward_mean", "loss"):
            value = getattr(self, name)
            if isinstance(value, float) and math.isnan(value):
                raise InvalidRecordError(name, "NaN (leave it None when it is not known)")
        if self.metrics:
            _check_metrics(self.metrics)

    @classmethod
    def from_arrays(
        cls,
        *,
        step: int,
        rollout_ids: Sequence[int] | np.ndarray,
        advantages: Sequence[float] | np.ndarray | None = None,
        log_ratio_mean: Sequence[float] | np.ndarray | None = None,
        log_ratio_max_abs: Sequence[float] | np.ndarray | None = None,
        reward_mean: float | None = None,
        loss: float | None = None,
        version: int | None = None,
        metrics: dict[str, float] | None = None,
    ) -> ConsumptionRecord:
        """Build one from lists/arrays (None: not recorded)."""
        def blob(values: Sequence[float] | np.ndarray | None) -> bytes:
            return b"" if values is None else _as_blob(values, FLOAT32)

        return cls(step=step, rollout_ids=[int(i) for i in rollout_ids],
                   advantages=blob(advantages), log_ratio_mean=blob(log_ratio_mean),
                   log_ratio_max_abs=blob(log_ratio_max_abs), reward_mean=reward_mean, loss=loss,
                   version=version, metrics=dict(metrics or {}))

    def values(self, name: str) -> np.ndarray | None:
        """A per-rollout blob (`advantages`, `log_ratio_mean`, `log_ratio_max_abs`) as a float32
        array aligned with `rollout_ids`, or None when it was not recorded."""
        if name not in _CONSUMPTION_BLOBS:
            raise KeyError(name)
        blob = getattr(self, name)
        return np.frombuffer(blob, FLOAT32) if blob else None


_CONSUMPTION_BLOBS: Final = ("advantages", "log_ratio_mean", "log_ratio_max_abs")


class DiscardRecord(msgspec.Struct, frozen=True, tag="discard", tag_field="type"):
    """Completed rollouts that no trainer step will consume (see the DISCARD_* reasons).

    `step` is the trainer step they were too stale for, or were lost with; `at` when (epoch
    seconds). A rollout both consumed and discarded: the first record in log order counts.
    """

    rollout_ids: list[int]
    reason: str
    step: int | None = None
    at: float | None = None

    def __post_init__(self) -> None:
        if self.step is not None:
            _require_int("step", self.step)
            if self.step < 0:
                raise InvalidRecordError("step", f"must be >= 0, got {self.step}")


class RunMetaRecord(msgspec.Struct, frozen=True, tag="run_meta", tag_field="type"):
    """Who wrote this log: run id, policy identity and the run's configuration."""

    run_id: str
    created_at: float
    identity: PolicyIdentity | None = None
    config: dict[str, Any] = msgspec.field(default_factory=dict)


class EvalPrompt(msgspec.Struct, frozen=True):
    """One evaluated prompt: the rewards of its samples, in the order they were drawn."""

    prompt_id: str
    rewards: list[float]  # one per sample that was scored (errored samples are absent)
    completion_tokens: list[int]  # the same samples' completion lengths
    errored: int = 0  # samples that ended without a score (engine error, reward error)
    # The same samples' versions: for each, every version that sampled one of its tokens (sorted;
    # two or more when an activation landed while it ran). Empty in logs written before versions
    # were recorded per sample (each sample then had the record's `version`).
    versions: list[list[int]] = msgspec.field(default_factory=list)


class EvalRecord(msgspec.Struct, frozen=True, tag="eval", tag_field="type"):
    """A held-out evaluation: never consumed by the trainer, left out of every staleness
    statistic. It runs beside activations (orchestrator/run/eval.py), so its tokens may come from
    several versions: `versions` names them all, `version` the one that sampled the most of its
    tokens, `mixed` counts the scored samples whose own tokens span two versions or more. A log
    written before these fields (`versions` empty) held one version per evaluation: `version`."""

    step: int  # trainer steps done when it ran (0: before the first)
    version: int
    task: str
    k: int  # samples per prompt
    prompts: int
    mean_at_k: float | None  # mean reward over every scored sample; None when none was scored
    pass_at_k: float | None  # share of prompts with a sample whose reward >= pass_threshold
    pass_threshold: float
    results: list[EvalPrompt]
    components: dict[str, float] = msgspec.field(default_factory=dict)  # mean of each reward component
    at: float | None = None
    seconds: float | None = None
    versions: list[int] = msgspec.field(default_factory=list)  # every version that sampled a token of it, sorted
    mixed: int = 0  # scored samples whose tokens came from two versions or more
    due_version: int | None = None  # the live version that made it due (live when it began)
    started_at: float | None = None  # time.time() when it began (`at`: when it ended)

    def __post_init__(self) -> None:
        for name in ("step", "version", "k", "prompts"):
            _require_int(name, getattr(self, name))
            if getattr(self, name) < 0:
                raise InvalidRecordError(name, f"must be >= 0, got {getattr(self, name)}")


Record = RolloutRecord | ActivationRecord | ConsumptionRecord | RunMetaRecord | DiscardRecord | EvalRecord
RECORD_TYPES: Final = (RolloutRecord, ActivationRecord, ConsumptionRecord, RunMetaRecord,
                       DiscardRecord, EvalRecord)
RECORD_TAGS: Final = frozenset(cls.__struct_config__.tag for cls in RECORD_TYPES)

make_rollout = RolloutRecord.from_lists
