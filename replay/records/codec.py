"""Encoding with validation, and decoding (unknown record types named as such)."""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any, Final, Union

import msgspec

from replay.errors import InvalidRecordError, UnknownRecordTypeError
from replay.records.checks import _check_rewards
from replay.records.types import (
    RECORD_TAGS,
    RECORD_TYPES,
    ActivationRecord,
    ConsumptionRecord,
    Record,
    RolloutRecord,
)

_encoder = msgspec.msgpack.Encoder()
_encode_into = _encoder.encode_into
_isfinite = math.isfinite
_decoder = msgspec.msgpack.Decoder(Record)


class _TypeTag(msgspec.Struct):
    """Just the tag of a record (other keys skipped without decoding them)."""

    type: str


_tag_decoder = msgspec.msgpack.Decoder(_TypeTag)
# "... - at `$.sampling.temperature`", or for a dict key "... - at `key` in `$.rewards`"
_PATH = re.compile(r"(?:at|in) `\$\.?([^`]*)`")
_BACKTICK = re.compile(r"`([^`$]+)`")


def _shape_of(cls: type[msgspec.Struct], *, blobs: bool = False) -> type[msgspec.Struct]:
    """A Struct that decodes like `cls` (same names, order, tag, types, defaults) but without
    the blob fields (unless `blobs`) and without __post_init__: it checks field types only,
    for the write path. Nested structs become shapes too, and no shape is tracked by the
    garbage collector (decoded only to be dropped at once: ~10% less time per decode)."""
    config = cls.__struct_config__
    fields: list[Any] = []
    for info in msgspec.structs.fields(cls):
        if info.type is bytes and not blobs:
            # Blob types and lengths were checked when the (frozen) record was built. Left out
            # of the shape, the decoder skips them without allocating anything (a Raw field
            # would copy its bytes out of a bytearray).
            continue
        kind = _shape_type(info.type)
        if info.default is not msgspec.NODEFAULT:
            fields.append((info.name, kind, info.default))
        elif info.default_factory is not msgspec.NODEFAULT:
            fields.append((info.name, kind, msgspec.field(default_factory=info.default_factory)))
        else:
            fields.append((info.name, kind))
    return msgspec.defstruct(f"{cls.__name__}Shape", fields, tag=config.tag,
                             tag_field=config.tag_field, frozen=True, gc=False)


_NESTED_SHAPES: dict[type, type] = {}


def _shape_type(kind: Any) -> Any:
    """`kind` with every Struct type in it replaced by its shape (blobs kept: nested structs
    are not checked when built). A nested struct with a __post_init__ (none today) is kept as
    it is, so that the write path still runs its checks."""
    if (isinstance(kind, type) and issubclass(kind, msgspec.Struct)
            and not hasattr(kind, "__post_init__")):
        if kind not in _NESTED_SHAPES:
            _NESTED_SHAPES[kind] = _shape_of(kind, blobs=True)
        return _NESTED_SHAPES[kind]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if not args:
        return kind
    shaped = tuple(_shape_type(arg) for arg in args)
    if shaped == args:
        return kind
    if origin is Union or origin is types.UnionType:
        return Union[shaped]  # noqa: UP007
    return origin[shaped]


# One decoder per record type (a record's type is known when it is written), and the union for
# payloads of unknown type.
_SHAPE_DECODERS: Final = {cls: msgspec.msgpack.Decoder(_shape_of(cls)) for cls in RECORD_TYPES}
_shape_decoder = msgspec.msgpack.Decoder(Union[tuple(_shape_of(cls) for cls in RECORD_TYPES)])  # noqa: UP007


def encode_record(record: Record) -> bytes:
    """Encode a record, refusing it (InvalidRecordError naming the field) if it is not valid.

    The bytes are encoded once, checked as they are and returned without a copy. See
    `encode_record_into` for what is checked."""
    _check_before_encoding(record)
    try:
        payload = _encoder.encode(record)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRecordError(_unencodable_field(record), str(exc)) from None
    _check_shape(payload, type(record))
    return payload


def encode_record_to(record: Record, scratch: bytearray) -> None:
    """Encode a record into `scratch`, replacing what it held, refusing it
    (InvalidRecordError naming the field; `scratch` then holds nothing useful) if it is not
    valid; the checks are those of `encode_record_into`.

    For a writer that reuses one scratch buffer: msgspec writes into it in place and keeps its
    allocation from call to call (measured about twice as fast as `encode()`, which grows a new
    buffer from 512 bytes for every record). The log calls this for every append, so the
    common case (a rollout record) is written out here rather than through helpers.
    """
    cls = type(record)
    if cls is RolloutRecord:
        rewards = record.rewards  # a dict inside a frozen record can still change
        if rewards:
            try:
                finite = _isfinite(sum(rewards.values()))  # NaN and inf survive a sum
            except (TypeError, AttributeError, OverflowError):
                finite = True  # not a dict of numbers: the typed decode names the field
            if not finite:
                _check_rewards(rewards)
    else:
        _check_before_encoding(record)
    try:
        _encode_into(record, scratch)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRecordError(_unencodable_field(record), str(exc)) from None
    decoder = _SHAPE_DECODERS.get(cls)
    if decoder is None:
        _check_shape(scratch)
        return
    try:
        decoder.decode(scratch)
    except msgspec.ValidationError:
        _check_shape(scratch, cls)  # raises, naming the field


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
        _check_shape(payload, type(record))
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
    elif isinstance(record, ActivationRecord | ConsumptionRecord):
        record.__post_init__()  # lists and dicts inside a frozen record can still change
    elif not isinstance(record, RECORD_TYPES):
        raise InvalidRecordError("type", f"not a replay record: {type(record).__name__}")


def _check_shape(payload: bytes | bytearray | memoryview, cls: type | None = None) -> None:
    """The exact type check: decode against the record's shape (as a reader would)."""
    try:
        _SHAPE_DECODERS.get(cls, _shape_decoder).decode(payload)  # type: ignore[call-overload]
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
        message = str(exc)
    except msgspec.DecodeError as exc:
        raise InvalidRecordError("type", f"not a msgpack record: {exc}") from None
    tag = _unknown_tag(payload)
    if tag is not None:
        raise UnknownRecordTypeError(tag) from None
    raise InvalidRecordError(_field_from_message(message), message) from None


def _unknown_tag(payload: bytes | memoryview) -> str | None:
    """The record type of a msgpack map whose "type" is a string no record has (a newer
    writer's record), else None. Only called on the error path."""
    try:
        tag = _tag_decoder.decode(payload).type
    except msgspec.MsgspecError:
        return None
    return None if tag in RECORD_TAGS else tag


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

