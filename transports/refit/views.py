"""The operations of a refit plan: the **views** read in place from a trainer tensor (select,
slice, transpose, reshape), the **allocating operations** replayed on arrival (dtype cast, FP8
block quantization), and dtype names. Used by the plan (`transports.refit.plan`), the name maps
(`transports.refit.maps`) and staging; imports nothing of this package but the errors.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from transports.errors import TransportError

class Select(msgspec.Struct, tag="select", frozen=True):
    dim: int
    index: int


class Slice(msgspec.Struct, tag="slice", frozen=True):
    dim: int
    start: int
    stop: int


class Transpose(msgspec.Struct, tag="transpose", frozen=True):
    dim0: int
    dim1: int


class Reshape(msgspec.Struct, tag="reshape", frozen=True):
    shape: tuple[int, ...]


ViewOp = Select | Slice | Transpose | Reshape


class Cast(msgspec.Struct, tag="cast", frozen=True):
    dtype: str


class Fp8BlockQuant(msgspec.Struct, tag="fp8_block", frozen=True):
    """DeepSeek-style block quantization: an fp8 e4m3 weight plus one fp32 `*_scale_inv` per
    block, so that weight_block * scale_inv reproduces the block."""

    block: tuple[int, int] = (128, 128)
    scale_suffix: str = "_scale_inv"


AllocOp = Cast | Fp8BlockQuant


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransportError(f"unknown dtype {name!r}")
    return dtype


def apply_view(tensor: torch.Tensor, op: ViewOp) -> torch.Tensor:
    match op:
        case Select(dim, index):
            return tensor.select(dim, index)
        case Slice(dim, start, stop):
            return tensor.narrow(dim, start, stop - start)
        case Transpose(dim0, dim1):
            return tensor.transpose(dim0, dim1)
        case Reshape(shape):
            return tensor.view(shape)  # a view or an error: reshapes that would copy are refused
    raise TypeError(op)


def apply_views(tensor: torch.Tensor, ops: Sequence[ViewOp]) -> torch.Tensor:
    for op in ops:
        tensor = apply_view(tensor, op)
    return tensor


def fp8_block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale_inv = amax / fp8_max
    quant = (blocks / scale_inv[:, None, :, None]).clamp(-fp8_max, fp8_max)
    quant = quant.view(nr * br, nc * bc)[:rows, :cols].to(torch.float8_e4m3fn)
    return quant.contiguous(), scale_inv.to(torch.float32)


def fp8_block_dequantize(quant: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = quant.shape
    br, bc = block
    scale = scale_inv.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return quant.to(torch.float32) * scale
