"""The wire format of a bucket: `BucketHeader` / `TensorMeta` (msgpack) and the checksum; a
leaf module (it imports nothing from this package but the errors)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from transports.errors import TransportError

if TYPE_CHECKING:
    import torch

#: Type of `prepare_refit_info()`: the engine-side name, shape and dtype of every tensor.
RefitInfo = dict[str, tuple[tuple[int, ...], "torch.dtype"]]


class TensorMeta(msgspec.Struct, frozen=True):
    """One tensor inside a bucket: where its bytes lie and what they must decode to."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # wire dtype, e.g. "bfloat16"
    offset: int  # byte offset inside the bucket payload
    nbytes: int
    checksum: int = 0  # crc32 of the bytes; 0 with checksums off


class BucketHeader(msgspec.Struct, frozen=True):
    """Describes one bucket of one version. `count` is the number of buckets in the version."""

    version: int
    index: int
    count: int
    nbytes: int
    tensors: tuple[TensorMeta, ...]
    checksums: bool = True
    kv_scales: dict[str, float] | None = None
    attempt: int = 0  # which try at sending this version: buckets of an abandoned try are dropped


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(BucketHeader)


def encode_header(header: BucketHeader) -> bytes:
    return _header_encoder.encode(header)


def decode_header(data: bytes | memoryview) -> BucketHeader:
    try:
        return _header_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise TransportError(f"undecodable bucket header: {exc}") from exc


def checksum(data: memoryview | bytes) -> int:
    """crc32c where the `crc32c` package imports (hardware speed), zlib crc32 otherwise.

    Sender and receiver of one deployment run the same code, so they agree on the function.
    The value is never 0, so that 0 can mean "not computed".
    """
    return (_crc(data) & 0xFFFFFFFF) or 1


def _pick_crc() -> Callable[[Any], int]:
    try:
        import crc32c

        return crc32c.crc32c
    except ImportError:  # pragma: no cover - crc32c is a declared dependency
        return zlib.crc32


_crc = _pick_crc()


def checksum_update(data: memoryview | bytes, value: int = 0) -> int:
    """The running checksum after `data`, for bytes that arrive (or are read) in pieces; start
    at 0 and finish with `checksum_final`: the result equals `checksum` of all the pieces."""
    return _crc(data, value)


def checksum_final(value: int) -> int:
    return (value & 0xFFFFFFFF) or 1
