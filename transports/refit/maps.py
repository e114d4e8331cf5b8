"""Name maps: from the trainer's parameter layout to the engine's (HF checkpoint) layout.

Each map has two directions:

* `refit(trainer_meta)` -> `[(engine_name, trainer_name, views)]`: how each engine tensor is
  *read* from a trainer tensor with views only (select, slice, transpose), so the sender never
  copies a fused tensor whole;
* `load(hf_state_dict)` -> trainer state dict: the trainer's loader (it may allocate: cat,
  contiguous transposes).

Each `refit` is the exact inverse of its `load`: applying the views to `load(hf)` reproduces
`hf` bit for bit (tested for every map).

Maps here:
* `IdentityMap`: the trainer holds HF names (optionally behind wrapper prefixes such as
  `_orig_mod.` or `module.`).
* `FusedDenseMap`: a dense Qwen2/Llama-style model held with fused `qkv` and `gate_up` and
  kernels stored transposed (`[in, out]`, JAX/Flax style).
* `Qwen3MoeFusedExpertsMap`: experts held fused per layer (transformers v5 `gate_up_proj
  [E, 2I, H]`, or the grouped-GEMM `[E, H, 2I]`) -> per-expert `experts.{e}.{gate,up,down}_proj`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from transports.refit.views import Select, Slice, Transpose, ViewOp

Meta = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
Mapped = list[tuple[str, str, tuple[ViewOp, ...]]]

#: Norm weights and biases are small and precision-sensitive: kept fp32 on the wire.
DEFAULT_KEEP_FP32: tuple[str, ...] = ("*norm.weight", "*layernorm.weight", "*.bias", "*router*", "*mlp.gate.weight")


class NameMap(Protocol):
    keep_fp32: Sequence[str]

    def refit(self, trainer_meta: Meta) -> Mapped: ...

    def load(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class IdentityMap:
    def __init__(self, strip_prefixes: Sequence[str] = ("_orig_mod.", "module._fsdp_wrapped_module.", "module."),
                 keep_fp32: Sequence[str] = DEFAULT_KEEP_FP32):
        self.strip_prefixes = tuple(strip_prefixes)
        self.keep_fp32 = tuple(keep_fp32)

    def engine_name(self, trainer_name: str) -> str:
        name = trainer_name
        changed = True
        while changed:
            changed = False
            for prefix in self.strip_prefixes:
                if name.startswith(prefix):
                    name, changed = name[len(prefix):], True
        return name

    def refit(self, trainer_meta: Meta) -> Mapped:
        return [(self.engine_name(name), name, ()) for name in trainer_meta]

    def load(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in hf_state_dict.items()}


# ---------------------------------------------------------------------------------------------
# fused dense


class FusedDenseMap:
    """Trainer names (per layer i) and their engine counterparts:

        embed.weight                   [V, H]      model.embed_tokens.weight
        layers.i.attn_norm.scale       [H]         model.layers.i.input_layernorm.weight
        layers.i.attn.qkv.kernel       [H, Q+2K]   q_proj/k_proj/v_proj.weight   (slice + transpose)
        layers.i.attn.qkv.bias         [Q+2K]      q_proj/k_proj/v_proj.bias     (slice)
        layers.i.attn.o.kernel         [Q, H]      o_proj.weight                 (transpose)
        layers.i.mlp_norm.scale        [H]         post_attention_layernorm.weight
        layers.i.mlp.gate_up.kernel    [H, 2I]     mlp.gate_proj/up_proj.weight  (slice + transpose)
        layers.i.mlp.down.kernel       [I, H]      mlp.down_proj.weight          (transpose)
        final_norm.scale               [H]         model.norm.weight
        lm_head.kernel                 [H, V]      lm_head.weight                (transpose; absent when tied)
    """

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 keep_fp32: Sequence[str] = DEFAULT_KEEP_FP32):
        self.q = num_heads * head_dim
        self.kv = num_kv_heads * head_dim
        self.inter = intermediate_size
        self.keep_fp32 = tuple(keep_fp32)

    @classmethod
    def from_hf_config(cls, config) -> FusedDenseMap:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                   head_dim=head_dim, intermediate_size=config.intermediate_size)

    # (trainer suffix, [(engine suffix, size)], fused dim in the trainer tensor, transposed)
    def _rules(self) -> list[tuple[str, list[tuple[str, int]], int, bool]]:
        q, kv, inter = self.q, self.kv, self.inter
        return [
            ("attn_norm.scale", [("input_layernorm.weight", 0)], 0, False),
            ("attn.qkv.kernel", [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv),
                                 ("self_attn.v_proj.weight", kv)], 1, True),
            ("attn.qkv.bias", [("self_attn.q_proj.bias", q), ("self_attn.k_proj.bias", kv),
                               ("self_attn.v_proj.bias", kv)], 0, False),
            ("attn.o.kernel", [("self_attn.o_proj.weight", 0)], 0, True),
            ("mlp_norm.scale", [("post_attention_layernorm.weight", 0)], 0, False),
            ("mlp.gate_up.kernel", [("mlp.gate_proj.weight", inter), ("mlp.up_proj.weight", inter)], 1, True),
            ("mlp.down.kernel", [("mlp.down_proj.weight", 0)], 0, True),
        ]

    _GLOBAL = {"embed.weight": ("model.embed_tokens.weight", False),
               "final_norm.scale": ("model.norm.weight", False),
               "lm_head.kernel": ("lm_head.weight", True)}

    def refit(self, trainer_meta: Meta) -> Mapped:
        out: Mapped = []
        for name in trainer_meta:
            if name in self._GLOBAL:
                engine, transposed = self._GLOBAL[name]
                out.append((engine, name, (Transpose(0, 1),) if transposed else ()))
                continue
            layer, suffix = _split_layer(name, "layers.")
            rule = next((r for r in self._rules() if r[0] == suffix), None)
            if rule is None:
                raise KeyError(f"FusedDenseMap: no rule for trainer tensor {name!r}")
            _, parts, dim, transposed = rule
            offset = 0
            for engine_suffix, size in parts:
                views: list[ViewOp] = []
                if len(parts) > 1:
                    views.append(Slice(dim, offset, offset + size))
                    offset += size
                if transposed:
                    views.append(Transpose(0, 1))
                out.append((f"model.layers.{layer}.{engine_suffix}", name, tuple(views)))
        return out

    def load(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for trainer, (engine, transposed) in self._GLOBAL.items():
            if engine in hf_state_dict:
                t = hf_state_dict[engine]
                out[trainer] = (t.T if transposed else t).contiguous().clone()
        layers = sorted({int(m.group(1)) for k in hf_state_dict if (m := re.match(r"model\.layers\.(\d+)\.", k))})
        for i in layers:
            for suffix, parts, dim, transposed in self._rules():
                names = [f"model.layers.{i}.{p}" for p, _ in parts]
                if not all(n in hf_state_dict for n in names):
                    continue  # e.g. no attention bias
                pieces = [hf_state_dict[n].T if transposed else hf_state_dict[n] for n in names]
                out[f"layers.{i}.{suffix}"] = torch.cat(pieces, dim=dim).contiguous() if len(pieces) > 1 \
                    else pieces[0].contiguous().clone()
        return out


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE fused experts


class Qwen3MoeFusedExpertsMap:
    """Experts held fused per layer; every other tensor under its HF name.

    `input_major=False` (default) is the transformers v5 in-memory layout:
    `mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`.
    `input_major=True` is the grouped-GEMM layout: `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`.
    Engine (checkpoint) names: `mlp.experts.e.{gate_proj,up_proj}.weight [I, H]`,
    `mlp.experts.e.down_proj.weight [H, I]`.
    """

    def __init__(self, *, num_experts: int, moe_intermediate_size: int, input_major: bool = False,
                 keep_fp32: Sequence[str] = DEFAULT_KEEP_FP32):
        self.num_experts = num_experts
        self.inter = moe_intermediate_size
        self.input_major = input_major
        self.keep_fp32 = tuple(keep_fp32)
        self._identity = IdentityMap(keep_fp32=keep_fp32)

    @classmethod
    def from_hf_config(cls, config, input_major: bool = False) -> Qwen3MoeFusedExpertsMap:
        return cls(num_experts=config.num_experts, moe_intermediate_size=config.moe_intermediate_size,
                   input_major=input_major)

    def refit(self, trainer_meta: Meta) -> Mapped:
        out: Mapped = []
        inter = self.inter
        # In the input-major layout the fused dim is the last one and each slice is transposed.
        fused_dim, tail = (1, (Transpose(0, 1),)) if self.input_major else (0, ())
        for name in trainer_meta:
            if name.endswith(".mlp.experts.gate_up_proj"):
                prefix = name.removesuffix("gate_up_proj")
                for e in range(self.num_experts):
                    out.append((f"{prefix}{e}.gate_proj.weight", name, (Select(0, e), Slice(fused_dim, 0, inter), *tail)))
                    out.append((f"{prefix}{e}.up_proj.weight", name,
                                (Select(0, e), Slice(fused_dim, inter, 2 * inter), *tail)))
            elif name.endswith(".mlp.experts.down_proj"):
                prefix = name.removesuffix("down_proj")
                for e in range(self.num_experts):
                    out.append((f"{prefix}{e}.down_proj.weight", name, (Select(0, e), *tail)))
            else:
                out.extend(self._identity.refit({name: trainer_meta[name]}))
        return out

    def load(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        expert = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
        out: dict[str, torch.Tensor] = {}
        prefixes: list[str] = []
        for name, tensor in hf_state_dict.items():
            if m := expert.match(name):
                if m.group(1) not in prefixes:
                    prefixes.append(m.group(1))
            else:
                out[name] = tensor.clone()
        orient = (lambda t: t.T) if self.input_major else (lambda t: t)
        fused_dim = 1 if self.input_major else 0
        for prefix in prefixes:
            experts = range(self.num_experts)
            get = lambda e, p: orient(hf_state_dict[f"{prefix}{e}.{p}.weight"])  # noqa: E731
            out[prefix + "gate_up_proj"] = torch.stack(
                [torch.cat([get(e, "gate_proj"), get(e, "up_proj")], dim=fused_dim) for e in experts]).contiguous()
            out[prefix + "down_proj"] = torch.stack([get(e, "down_proj") for e in experts]).contiguous()
        return out


def _split_layer(name: str, prefix: str) -> tuple[int, str]:
    m = re.match(re.escape(prefix) + r"(\d+)\.(.+)$", name)
    if m is None:
        raise KeyError(f"not a per-layer tensor: {name!r}")
    return int(m.group(1)), m.group(2)
