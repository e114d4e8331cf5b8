"""Invariant checks and blob helpers of the replay records (run on build and on decode, so
kept cheap: they sit on the scan path). They take records by attribute, so this module does
not import the record types."""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from replay.errors import InvalidRecordError

INT32: Final = np.dtype("<i4")
FLOAT32: Final = np.dtype("<f4")

_BLOB_FIELDS: Final = ("prompt_token_ids", "completion_token_ids", "completion_logprobs",
                       "version_starts", "version_values")


def _check_rollout(rec: Any) -> None:
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
        spans = rec.environment_spans
        if spans:
            _check_episode(spans, logprobs, n_bytes // 4)
        else:
            _check_logprobs(logprobs)
    elif rec.environment_spans:
        raise InvalidRecordError("environment_spans", "given for an empty completion")
    elif starts:
        raise InvalidRecordError("version_starts", "change points given for an empty completion")
    if rec.rewards:
        _check_rewards(rec.rewards)


_ZERO_INT32: Final = bytes(4)


def _name_bad_blob(rec: Any) -> None:
    for name in _BLOB_FIELDS:
        blob = getattr(rec, name)
        if not isinstance(blob, bytes):
            raise InvalidRecordError(name, f"expected bytes (a little-endian 4-byte array), got "
                                           f"{type(blob).__name__}; build with RolloutRecord.from_lists")
        if len(blob) % 4:
            raise InvalidRecordError(name, f"length {len(blob)} is not a multiple of 4")


def _check_change_points(rec: Any, n_tokens: int) -> None:
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


def _check_episode(spans: Any, logprobs: bytes, n_tokens: int) -> None:
    """Environment spans: (start, end) int32 pairs, increasing, disjoint, within the completion;
    the logprobs NaN exactly there (no logprob exists) and finite everywhere else."""
    if type(spans) is not bytes or len(spans) % 8:
        raise InvalidRecordError("environment_spans", "expected (start, end) int32 pairs as bytes")
    flat = int32_values(spans)
    previous_end = 0
    mask = np.ones(n_tokens, dtype=bool)
    for i in range(0, len(flat), 2):
        start, end = flat[i], flat[i + 1]
        if not previous_end <= start < end <= n_tokens or (i and start == previous_end):
            raise InvalidRecordError(f"environment_spans[{i // 2}]",
                                     f"({start}, {end}) is not a non-empty range after the previous span's end "
                                     f"{previous_end} and within the {n_tokens} completion tokens (adjacent spans "
                                     "are one span)")
        mask[start:end] = False
        previous_end = end
    values = np.frombuffer(logprobs, FLOAT32)
    sampled_bad = mask & ~(values < np.inf)
    if sampled_bad.any():
        index = int(np.flatnonzero(sampled_bad)[0])
        raise InvalidRecordError("completion_logprobs", f"{values[index]} at sampled token {index}")
    written = ~mask & ~np.isnan(values)
    if written.any():
        index = int(np.flatnonzero(written)[0])
        raise InvalidRecordError("completion_logprobs", f"{values[index]} at token {index}, which the environment "
                                                        "wrote: it has no logprob (NaN)")


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


def _check_float_blob(name: str, blob: Any, count: int) -> None:
    if type(blob) is not bytes:
        raise InvalidRecordError(name, f"expected bytes (a little-endian float32 array), got "
                                       f"{type(blob).__name__}; build with from_arrays")
    if blob and len(blob) != 4 * count:
        raise InvalidRecordError(name, f"{len(blob)} bytes for {count} rollout ids "
                                       f"(expected 0 or {4 * count})")
    if blob:
        values = np.frombuffer(blob, FLOAT32)
        nan = np.isnan(values)
        if nan.any():
            raise InvalidRecordError(name, f"NaN at rollout {int(np.flatnonzero(nan)[0])}")


def _check_metrics(metrics: Any) -> None:
    if not isinstance(metrics, dict):
        return  # a wrong type is reported by the typed decoder with its path
    for name, value in metrics.items():
        if isinstance(value, float) and math.isnan(value):
            raise InvalidRecordError(f"metrics.{name}", "NaN (leave it out when it is not known)")


def _require_int(field: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRecordError(field, f"expected int, got {type(value).__name__}")


# Blob helpers.


def int32_values(blob: bytes) -> list[int]:
    """A little-endian int32 blob as a Python list (fast for the few change points)."""
    values = array("i", blob)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _as_blob(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: np.dtype) -> bytes:
    # A list or tuple of Python numbers (every record the run builds): struct packs it about 3x
    # faster than numpy converts it, to the same bytes (both are C casts to int32/float32), and a
    # compiled Struct a length about 1.6x faster again than parsing the format on every call.
    # Anything struct refuses (out of range, not a number) goes the numpy way, as before.
    code = _STRUCT_CODES.get(dtype) if type(values) in (list, tuple) else None
    if code is not None:
        pack = _PACKERS.get((code, len(values)))
        if pack is None:
            pack = _packer(code, len(values))
        try:
            return pack(*values)
        except (struct.error, OverflowError, TypeError, ValueError):
            pass
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def _packer(code: str, n: int):
    if len(_PACKERS) >= _PACKERS_KEPT:  # bounded: start again (a run uses a few thousand lengths)
        _PACKERS.clear()
    pack = _PACKERS[(code, n)] = struct.Struct(f"<{n}{code}").pack
    return pack


_PACKERS: Final[dict[tuple[str, int], Any]] = {}  # (struct code, length) -> its compiled pack
_PACKERS_KEPT: Final = 8192  # a few per completion length a run uses; each a few hundred bytes


_STRUCT_CODES: Final = {INT32: "i", FLOAT32: "f"}


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

