"""The errors every transport raises (all derive from `TransportError`); a leaf module.

    TransportError                  anything a transport raises on purpose
    ├── TransportTimeoutError       a peer never joined, or stalled past the configured limit
    │                               (also a `TimeoutError`)
    ├── TransportUnavailableError   the transport cannot run here (package or device missing); says why
    ├── TransportConfigError        a request that cannot be honoured (also a `ValueError`),
    │                               e.g. a collective transport asked for a LoRA adapter
    ├── AdapterError                a published LoRA adapter directory that is missing a file or
    │                               is corrupt (`transports.adapters.check_adapter`); `.path`
    │                               names the file, `.tensor` the tensor when one is at fault
    └── RefitMismatchError          a received tensor disagrees with the refit info; `.tensor`
        │                           names it, `.reason` says how (shape, dtype, unexpected)
        ├── MissingTensorError      a tensor of the refit info never arrived
        ├── TruncatedBucketError    a bucket holds fewer bytes than its header promises
        └── ChecksumError           a tensor's bytes do not match the checksum the sender computed

They pickle, so an engine process's error reaches the trainer intact; `describe_error` /
`rebuild_error` carry them across boundaries that only carry text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class TransportError(Exception):
    """Anything a transport raises on purpose."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A peer never joined, or stalled mid-transfer, past the configured limit."""

    def __init__(self, what: str, timeout_s: float):
        self.what = what
        self.timeout_s = timeout_s
        super().__init__(f"{what}: no progress within {timeout_s:g} s")

    def __reduce__(self):  # survives pickling across processes
        return (type(self), (self.what, self.timeout_s))


class TransportUnavailableError(TransportError):
    """The transport cannot run on this machine; the message says why."""


class TransportConfigError(TransportError, ValueError):
    """A request the factory or a transport cannot honour."""


class AdapterError(TransportError):
    """A LoRA adapter directory that cannot be served as it is. `.path` names the file,
    `.tensor` the tensor at fault (None when the file itself is: missing, not JSON, a torn
    safetensors header, whose message then gives the byte offset)."""

    def __init__(self, path: str, reason: str, tensor: str | None = None):
        self.path = str(path)
        self.reason = reason
        self.tensor = tensor
        where = f"{self.path}: tensor {tensor!r}" if tensor is not None else self.path
        super().__init__(f"{where}: {reason}")

    def __reduce__(self):  # survives pickling across processes
        return (type(self), (self.path, self.reason, self.tensor))


class RefitMismatchError(TransportError):
    """A received tensor disagrees with the refit info. `.tensor` names it."""

    def __init__(self, tensor: str, reason: str):
        self.tensor = tensor
        self.reason = reason
        super().__init__(f"tensor {tensor!r}: {reason}")

    def __reduce__(self):  # survives pickling across processes
        return (type(self), (self.tensor, self.reason))


class MissingTensorError(RefitMismatchError):
    def __init__(self, tensor: str, reason: str = "never arrived"):
        super().__init__(tensor, reason)


class TruncatedBucketError(RefitMismatchError):
    pass


class ChecksumError(RefitMismatchError):
    pass


def describe_error(exc: BaseException) -> dict[str, Any]:
    """A JSON-able description of a transport error, for crossing a boundary that only carries
    text (a vLLM server's dev endpoints); `rebuild_error` turns it back into the same class."""
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, RefitMismatchError):
        out.update(tensor=exc.tensor, reason=exc.reason)
    elif isinstance(exc, TransportTimeoutError):
        out.update(what=exc.what, timeout_s=exc.timeout_s)
    elif isinstance(exc, AdapterError):
        out.update(path=exc.path, reason=exc.reason, tensor=exc.tensor)
    return out


def rebuild_error(info: Mapping[str, Any]) -> TransportError:
    """The inverse of `describe_error`; an error that is not one of ours becomes a
    `TransportError` carrying its type and message."""
    kind = info.get("type")
    if kind in _REFIT_ERRORS and "tensor" in info:
        return _REFIT_ERRORS[kind](info["tensor"], info.get("reason", ""))
    if kind == "TransportTimeoutError" and "what" in info:
        return TransportTimeoutError(info["what"], float(info.get("timeout_s", 0.0)))
    if kind == "AdapterError" and "path" in info:
        return AdapterError(info["path"], info.get("reason", ""), info.get("tensor"))
    if kind in _PLAIN_ERRORS:
        return _PLAIN_ERRORS[kind](info.get("message", ""))
    return TransportError(f"{kind}: {info.get('message', '')}")


_REFIT_ERRORS: dict[str, type[RefitMismatchError]] = {
    cls.__name__: cls for cls in (RefitMismatchError, MissingTensorError, TruncatedBucketError, ChecksumError)}
_PLAIN_ERRORS: dict[str, type[TransportError]] = {
    cls.__name__: cls for cls in (TransportError, TransportUnavailableError, TransportConfigError)}
