"""Replay records: what the log stores, as msgspec Structs.

One log holds a tagged union of record types (the msgpack map key ``"type"`` names the type):

    rollout      RolloutRecord     one terminal record per dispatched rollout
    activation   ActivationRecord  one per attempted activation of a policy version
    consumption  ConsumptionRecord which rollouts a trainer step consumed
    run_meta     RunMetaRecord     run identity and configuration

Rules for evolving these definitions (tests/unit/test_replay_records.py enforces them with a
golden list of field names and golden encoded bytes):

* append new fields at the end, always with a default; never reorder, rename or remove;
* records are msgpack maps keyed by field name, so an old reader skips fields it does not
  know and a new reader fills in defaults for fields an old writer did not write.

Token ids and logprobs are little-endian int32 / float32 byte blobs: msgspec copies a blob
in well under a microsecond, while decoding a 700-element Python list costs ~25x more.
A rollout's per-token policy versions are stored as run-length change points: token index
``version_starts[i]`` is the first token sampled under ``version_values[i]``.

Invariants (equal lengths, versions never decreasing, no NaN logprob) are checked in
``__post_init__``, which msgspec runs both when a record is built and when one is decoded,
so every write and every read checks them. Field types are checked on write by
``encode_record_into`` (the encoded bytes decoded once against the record's shape) and on
read by the typed decoder.
"""

from __future__ import annotations

import math
import re
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Final, Union

import msgspec
import numpy as np

from replay.errors import InvalidRecordError

INT32: Final = np.dtype("<i4")
FLOAT32: Final = np.dtype("<f4")

# Known drop reasons and activation outcomes. They are plain strings on disk (not Literals) so
# that a new value written by a newer orchestrator never makes an older reader fail.
DROP_STALE: Final = "stale"  # exceeded max_off_policy_steps before a trainer step consumed it
DROP_ABORTED: Final = "aborted"  # aborted by an activation under the `abort` KV policy
DROP_SHUTDOWN: Final = "shutdown"  # the run stopped while the rollout was in flight
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
    """The sampling parameters the engine used for this rollout."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


COMPLETED: Final = Completed()
DEFAULT_SAMPLING: Final = SamplingSettings()


class PolicyIdentity(msgspec.Struct, frozen=True):
    """What names the policy besides the version number."""

    base_checkpoint: str
    tokenizer_hash: str
    chat_template_hash: str
    serving_precision: str


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


# --------------------------------------------------------------------------------------------
# Top-level records (a tagged union keyed by "type").


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
    ) -> RolloutRecord:
        """Build a record from lists/arrays.

        Give the per-token versions either as `token_versions` (one per completion token) or
        as `version_changes` [(first_token_index, version), ...]; with neither, every token is
        attributed to `dispatched_version`.
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
    strategy: str = ""  # pause_swap, double_buffer or pause_free ("" in logs before it existed)
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
    record of its own; readers join it onto the rollouts)."""

    step: int
    rollout_ids: list[int]

    def __post_init__(self) -> None:
        _require_int("step", self.step)
        if self.step < 0:
            raise InvalidRecordError("step", f"must be >= 0, got {self.step}")


class RunMetaRecord(msgspec.Struct, frozen=True, tag="run_meta", tag_field="type"):
    """Who wrote this log: run id, policy identity and the run's configuration."""

    run_id: str
    created_at: float
    identity: PolicyIdentity | None = None
    config: dict[str, Any] = msgspec.field(default_factory=dict)


Record = RolloutRecord | ActivationRecord | ConsumptionRecord | RunMetaRecord
RECORD_TYPES: Final = (RolloutRecord, ActivationRecord, ConsumptionRecord, RunMetaRecord)


# --------------------------------------------------------------------------------------------
# Encoding with validation.

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_BACKTICK = re.compile(r"`([^`$]+)`")


def _shape_of(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """A Struct that decodes like `cls` (same names, order, tag, types, defaults) but without
    the blob fields and without __post_init__: it checks field types only, for the write path."""
    config = cls.__struct_config__
    fields: list[Any] = []
    for info in msgspec.structs.fields(cls):
        if info.type is bytes:
            # Blob types and lengths were checked when the (frozen) record was built. Left out
            # of the shape, the decoder skips them without allocating anything (a Raw field
            # would copy its bytes out of a bytearray).
            continue
        if info.default is not msgspec.NODEFAULT:
            fields.append((info.name, info.type, info.default))
        elif info.default_factory is not msgspec.NODEFAULT:
            fields.append((info.name, info.type, msgspec.field(default_factory=info.default_factory)))
        else:
            fields.append((info.name, info.type))
    return msgspec.defstruct(f"{cls.__name__}Shape", fields, tag=config.tag,
                             tag_field=config.tag_field, frozen=True)


_shape_decoder = msgspec.msgpack.Decoder(Union[tuple(_shape_of(cls) for cls in RECORD_TYPES)])  # noqa: UP007



def encode_record(record: Record) -> bytes:
    """Encode a record, refusing it (InvalidRecordError naming the field) if it is not valid."""
    buffer = bytearray()
    encode_record_into(record, buffer, 0)
    return bytes(buffer)


def encode_record_into(record: Record, buffer: bytearray, offset: int) -> None:
    """Encode a record into `buffer[offset:]` (the buffer is resized to fit), refusing it
    (InvalidRecordError naming the field; `buffer` cut back to `offset`) if it is not valid.

    Invariants were checked when the (frozen) record was built; the few that involve mutable
    containers (rewards, engine list) are checked again here. Structs do not check field
    types when built, so the encoded bytes are decoded once against the record's
    shape (blobs skipped): that checks every field's type exactly as a reader will, so nothing
    is written that a reader would refuse. (A per-field check in Python costs several times
    more than this one decode in C.)
    """
    _check_before_encoding(record)
    try:
        # encode() then one append measured ~4x faster than `encode_into` at the tail of the
        # log's write buffer (2 vs 8 us for a 5.4 KB record): encode_into resizes the buffer
        # to the exact length on every call, which defeats bytearray's over-allocation.
        payload = _encoder.encode(record)
        _check_shape(payload)
        buffer[offset:] = payload
    except (TypeError, ValueError, OverflowError) as exc:
        del buffer[offset:]
        raise InvalidRecordError(_unencodable_field(record), str(exc)) from None
    except InvalidRecordError:
        del buffer[offset:]
        raise


def _check_before_encoding(record: Record) -> None:
    if isinstance(record, RolloutRecord):
        _check_rewards(record.rewards)
    elif isinstance(record, ActivationRecord):
        record.__post_init__()
    elif not isinstance(record, RECORD_TYPES):
        raise InvalidRecordError("type", f"not a replay record: {type(record).__name__}")


def _check_shape(payload: bytes | memoryview) -> None:
    """The exact type check: decode against the record's shape (as a reader would)."""
    try:
        _shape_decoder.decode(payload)
        return
    except msgspec.ValidationError as exc:
        message = str(exc)
    # Drop the view before raising: the traceback keeps this frame, and a live view would stop
    # the caller from cutting the refused record out of its buffer.
    del payload
    raise InvalidRecordError(_field_from_message(message), message)


def decode_record(payload: bytes | memoryview) -> Record:
    """Decode and validate one record; InvalidRecordError names the offending field."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise InvalidRecordError(_field_from_message(str(exc)), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRecordError("type", f"not a msgpack record: {exc}") from None


def _field_from_message(message: str) -> str:
    match = _PATH.search(message)
    if match and match.group(1):
        return match.group(1)
    match = _BACKTICK.search(message)  # "Object missing required field `rollout_id`"
    return match.group(1) if match else "type"


def _unencodable_field(record: msgspec.Struct) -> str:
    """Which field made the encoder fail (only called on the error path)."""
    for name in record.__struct_fields__:
        try:
            _encoder.encode(getattr(record, name))
        except (TypeError, ValueError, OverflowError):
            return name
    return "type"


# --------------------------------------------------------------------------------------------
# Invariant checks (run on build and on decode; kept cheap: they sit on the scan path).


_BLOB_FIELDS: Final = ("prompt_token_ids", "completion_token_ids", "completion_logprobs",
                       "version_starts", "version_values")


def _check_rollout(rec: RolloutRecord) -> None:
    # This runs for every record read, so the common case is kept to a few cheap operations;
    # the slow paths only work out which field to name.
    prompt, completion, logprobs = rec.prompt_token_ids, rec.completion_token_ids, rec.completion_logprobs
    starts, values = rec.version_starts, rec.version_values
    if (type(prompt) is not bytes or type(completion) is not bytes or type(logprobs) is not bytes
            or type(starts) is not bytes or type(values) is not bytes
            or (len(prompt) | len(completion) | len(starts) | len(values)) & 3):
        _name_bad_blob(rec)
    if type(rec.dispatched_version) is not int:
        _require_int("dispatched_version", rec.dispatched_version)
    n_bytes = len(completion)
    if len(logprobs) != n_bytes:
        raise InvalidRecordError("completion_logprobs", f"{len(logprobs) // 4} logprobs for "
                                                        f"{n_bytes // 4} completion tokens")
    if len(starts) != len(values):
        raise InvalidRecordError("version_values", f"{len(values) // 4} versions for "
                                                   f"{len(starts) // 4} change points")
    if n_bytes:
        if len(starts) == 4 and starts == _ZERO_INT32:  # one version: the common case
            if int.from_bytes(values, "little", signed=True) < rec.dispatched_version:
                _check_change_points(rec, n_bytes // 4)
        else:
            _check_change_points(rec, n_bytes // 4)
        _check_logprobs(logprobs)
    elif starts:
        raise InvalidRecordError("version_starts", "change points given for an empty completion")
    if rec.rewards:
        _check_rewards(rec.rewards)


_ZERO_INT32: Final = bytes(4)


def _name_bad_blob(rec: RolloutRecord) -> None:
    for name in _BLOB_FIELDS:
        blob = getattr(rec, name)
        if not isinstance(blob, bytes):
            raise InvalidRecordError(name, f"expected bytes (a little-endian 4-byte array), got "
                                           f"{type(blob).__name__}; build with RolloutRecord.from_lists")
        if len(blob) % 4:
            raise InvalidRecordError(name, f"length {len(blob)} is not a multiple of 4")


def _check_change_points(rec: RolloutRecord, n_tokens: int) -> None:
    starts = int32_values(rec.version_starts)
    values = int32_values(rec.version_values)
    if not starts or starts[0] != 0:
        raise InvalidRecordError("version_starts", "must start at token 0")
    for previous, current in zip(starts, starts[1:]):
        if current <= previous:
            raise InvalidRecordError("version_starts", f"not increasing: {previous} then {current}")
    if starts[-1] >= n_tokens:
        raise InvalidRecordError("version_starts",
                                 f"change point {starts[-1]} past the last token ({n_tokens} tokens)")
    if values[0] < rec.dispatched_version:
        raise InvalidRecordError("version_values", f"version {values[0]} is older than the "
                                                   f"dispatched version {rec.dispatched_version}")
    for previous, current in zip(values, values[1:]):
        if current < previous:
            raise InvalidRecordError("version_values", f"versions go backwards: {previous} then {current}")


def _check_logprobs(blob: bytes) -> None:
    # NaN and +inf have every exponent bit set, so the top byte of each (every 4th byte,
    # little-endian) is 0x7f or 0xff; a finite logprob has that only if |x| >= 2**127. One
    # C-level pass over a quarter of the bytes clears the common case for a fraction of the
    # cost of a numpy reduction on a small array.
    top_bytes = blob[3::4]
    if b"\x7f" not in top_bytes and b"\xff" not in top_bytes:
        return
    logprobs = np.frombuffer(blob, FLOAT32)
    # max() propagates NaN, and `NaN < inf` is false: one vectorised pass finds NaN and +inf.
    if not logprobs.max() < np.inf:
        index = int(np.flatnonzero(~(logprobs < np.inf))[0])
        raise InvalidRecordError("completion_logprobs", f"{logprobs[index]} at token {index}")


def _check_rewards(rewards: Any) -> None:
    if not isinstance(rewards, dict):
        return  # a wrong type is reported by the typed decoder with its path
    try:
        if math.isfinite(sum(rewards.values())):  # NaN and inf survive a sum: one cheap test
            return
    except TypeError:
        return  # not numbers: the typed decoder names the field
    for name, value in rewards.items():
        if isinstance(value, int | float) and not math.isfinite(value):
            raise InvalidRecordError(f"rewards.{name}", f"must be finite, got {value}")


def _require_int(field: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRecordError(field, f"expected int, got {type(value).__name__}")


# --------------------------------------------------------------------------------------------
# Blob helpers.


def int32_values(blob: bytes) -> list[int]:
    """A little-endian int32 blob as a Python list (fast for the few change points)."""
    values = array("i", blob)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _as_blob(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def _change_points(
    n_tokens: int,
    dispatched_version: int,
    token_versions: Sequence[int] | np.ndarray | None,
    version_changes: Sequence[tuple[int, int]] | None,
) -> tuple[bytes, bytes]:
    if token_versions is not None and version_changes is not None:
        raise ValueError("give token_versions or version_changes, not both")
    if n_tokens == 0:
        return b"", b""
    if version_changes is not None:
        starts = [start for start, _ in version_changes]
        values = [version for _, version in version_changes]
    elif token_versions is not None:
        versions = np.asarray(token_versions, dtype=np.int64)
        if len(versions) != n_tokens:
            raise InvalidRecordError("version_values",
                                     f"{len(versions)} token versions for {n_tokens} tokens")
        starts_array = np.flatnonzero(np.diff(versions, prepend=versions[0] - 1))
        starts, values = starts_array.tolist(), versions[starts_array].tolist()
    else:
        starts, values = [0], [dispatched_version]
    return _as_blob(starts, INT32), _as_blob(values, INT32)


make_rollout = RolloutRecord.from_lists
