"""Errors raised by the replay log.

    ReplayError                  base of every expected failure in `replay` (bad input, bad file)
    +-- CorruptRecordError       bytes on disk fail their frame check (length, CRC32C) before
    |                            the torn tail, or a whole segment is missing; names the
    |                            segment file and the byte offset
    +-- InvalidRecordError       a record whose content breaks the schema or an invariant
    |   |                        (wrong type, NaN logprob, unequal lengths, versions going
    |   |                        backwards); names the field, and the segment/offset when read
    |   +-- UnknownRecordTypeError   a record type this reader does not know (a newer
    |                                writer's); readers skip and count it instead of failing
    +-- LogNotFoundError         a directory that holds no replay log
    +-- AdapterError             a LoRA adapter version that cannot be merged into the base
                                 (unreadable, lora_A without lora_B, a target the base lacks,
                                 a shape that does not fit, a config the engines do not
                                 serve); names the file and the tensor or config key

`InvalidRecordError` deliberately does not derive from `ValueError`/`TypeError`: msgspec wraps
those when they escape `__post_init__` during decoding, and we want the field name to survive.
"""

from __future__ import annotations


class ReplayError(Exception):
    """Base class of every expected failure raised by `replay`."""


class CorruptRecordError(ReplayError):
    """A record whose frame (length or CRC32C) does not check out, before the torn tail."""

    def __init__(self, segment: str, offset: int, reason: str) -> None:
        self.segment = segment
        self.offset = offset
        self.reason = reason
        super().__init__(f"corrupt record in segment {segment} at byte offset {offset}: {reason}")


class InvalidRecordError(ReplayError):
    """A record that breaks the schema or an invariant; names the offending field."""

    def __init__(self, field: str, reason: str, *, segment: str | None = None,
                 offset: int | None = None) -> None:
        self.field = field
        self.reason = reason
        self.segment = segment
        self.offset = offset
        where = "" if segment is None else f" in segment {segment} at byte offset {offset}"
        super().__init__(f"invalid record{where}: field `{field}`: {reason}")

    def at(self, segment: str, offset: int) -> InvalidRecordError:
        """The same error, located in a file (used by readers)."""
        return InvalidRecordError(self.field, self.reason, segment=segment, offset=offset)


class UnknownRecordTypeError(InvalidRecordError):
    """A well-formed record whose type tag this reader does not know (written by a newer
    writer). Readers skip it and count it in `unknown_records`."""

    def __init__(self, record_type: str, *, segment: str | None = None,
                 offset: int | None = None) -> None:
        self.record_type = record_type
        super().__init__("type", f"unknown record type {record_type!r}", segment=segment,
                         offset=offset)

    def at(self, segment: str, offset: int) -> UnknownRecordTypeError:
        return UnknownRecordTypeError(self.record_type, segment=segment, offset=offset)


class LogNotFoundError(ReplayError):
    """The given directory holds no replay log segments."""


class AdapterError(ReplayError):
    """A LoRA adapter that cannot be merged into its base model; names the file and, when one
    is at fault, the tensor or the adapter_config.json key."""

    def __init__(self, file: str, reason: str, *, tensor: str | None = None, key: str | None = None) -> None:
        self.file = file
        self.reason = reason
        self.tensor = tensor
        self.key = key
        what = f"tensor `{tensor}`: " if tensor else f"`{key}`: " if key else ""
        super().__init__(f"adapter {file}: {what}{reason}")
