"""Refit maps per model family, from the layout transformers holds in memory (what a trainer
built on transformers' model classes has in `model.state_dict()`) to the checkpoint names and
shapes vLLM's `load_weights` takes.

* `HfLayoutMap`: the trainer holds checkpoint names (dense Qwen2 under transformers); a tied
  `lm_head.weight` (an alias of the embedding in `state_dict()`, absent from the checkpoint) is
  not sent.
* `Qwen3NextMap`: Qwen3-Next. The gated-DeltaNet tensors (`linear_attn.in_proj_qkvz`,
  `in_proj_ba`, `conv1d [C, 1, K]`, `A_log`, `dt_bias`, `norm`, `out_proj`), the gated full
  attention (`q_proj` twice as wide: query and gate), the shared expert and its
  `shared_expert_gate [1, H]` travel under their own names; routed experts are held fused
  (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`; transformers' `qwen2_moe`
  weight converter) and sent per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`).
* `Gemma4Map`: Gemma 4 text. Experts stay fused on the wire (`experts.gate_up_proj [E, 2I, H]`,
  `experts.down_proj [E, H, I]`): that is the checkpoint's layout and vLLM's fused-expert loader
  takes it whole. The router is three tensors (`router.proj.weight [E, H]`, `router.scale [H]`,
  `router.per_expert_scale [E]`); the per-layer embedding table is one packed tensor
  (`embed_tokens_per_layer.weight [V_ple, L*P]`) with its projection `[L*P, H]` and norm `[P]`.
  Their shapes are checked against the config before anything is sent.

`map_for_config(hf_config)` picks the map of a family. The Qwen3-Next and Gemma 4 maps raise
`RefitMismatchError` naming a trainer tensor they have no rule for, or whose shape disagrees
with the config. `transports.refit.vllm_check.vllm_accepts` checks a map's output against
vLLM's own model class; `tests/unit/test_refit_families.py` runs both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from transports.errors import RefitMismatchError, TransportConfigError
from transports.refit.maps import (
    DEFAULT_KEEP_FP32,
    FusedDenseMap,
    Mapped,
    Meta,
    NameMap,
    Qwen3MoeFusedExpertsMap,
)
from transports.refit.views import Transpose, ViewOp

#: Where the decoder lives: `model.` (the `...ForCausalLM` classes) or `model.language_model.`
#: (Gemma 4's multimodal class, whose checkpoint vLLM's text model also reads).
MODEL_PREFIXES = ("model.language_model.", "model.")
_LAYER = re.compile(r"^(?P<prefix>model\.(?:language_model\.)?)layers\.(?P<layer>\d+)\.(?P<suffix>.+)$")


def _layer_of(name: str) -> tuple[str, int, str] | None:
    m = _LAYER.match(name)
    return (m.group("prefix"), int(m.group("layer")), m.group("suffix")) if m else None


def _suffix(name: str) -> str:
    """A tensor's name inside its layer, or inside the decoder for a top-level tensor."""
    parsed = _layer_of(name)
    if parsed is not None:
        return parsed[2]
    for prefix in MODEL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


class HfLayoutMap:
    """The trainer holds the checkpoint's names and shapes. Only the tied output head differs:
    transformers' `state_dict()` lists `lm_head.weight` as an alias of the input embedding,
    the checkpoint (and vLLM's loader, which ties the head itself) has no such tensor."""

    def __init__(self, *, tie_word_embeddings: bool = False, keep_fp32: Sequence[str] = DEFAULT_KEEP_FP32):
        self.tied = tie_word_embeddings
        self.keep_fp32 = tuple(keep_fp32)

    @classmethod
    def from_hf_config(cls, config) -> HfLayoutMap:
        return cls(tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))

    def _sent(self, name: str) -> bool:
        return not (self.tied and name == "lm_head.weight")

    def refit(self, trainer_meta: Meta) -> Mapped:
        return [(name, name, ()) for name in trainer_meta if self._sent(name)]

    def load(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {name: t.clone() for name, t in hf_state_dict.items()}
        self._tie(out)
        return out

    def _tie(self, out: dict[str, torch.Tensor]) -> None:
        if not self.tied or "lm_head.weight" in out:
            return
        for prefix in MODEL_PREFIXES:
            if (embed := out.get(prefix + "embed_tokens.weight")) is not None:
                out["lm_head.weight"] = embed  # one tensor under two names, as in transformers
                return


class _FamilyMap(HfLayoutMap):
    """Shared machinery: a table of per-layer suffixes the family has (anything else is refused,
    naming the tensor), top-level names, and the shape checks a subclass adds."""

    family = "?"
    #: Tensors outside the layers, named inside the decoder (under one of `MODEL_PREFIXES`).
    top_level: tuple[str, ...] = ("embed_tokens.weight", "norm.weight")
    #: Regular expressions over a layer tensor's name inside its layer.
    layer_suffixes: tuple[str, ...] = ()

    def _check_name(self, name: str) -> None:
        if name == "lm_head.weight":
            return
        parsed = _layer_of(name)
        if parsed is None:
            if not (name.startswith(MODEL_PREFIXES) and _suffix(name) in self.top_level):
                raise RefitMismatchError(name, f"{self.family}: no refit rule for this trainer tensor")
            return
        suffix = parsed[2]
        if not any(re.fullmatch(p, suffix) for p in self.layer_suffixes):
            raise RefitMismatchError(name, f"{self.family}: no refit rule for layer tensor suffix {suffix!r}")

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:  # overridden per family
        pass

    def refit(self, trainer_meta: Meta) -> Mapped:
        out: Mapped = []
        for name, (shape, _) in trainer_meta.items():
            if not self._sent(name):
                continue
            self._check_name(name)
            self._check_shape(name, tuple(shape))
            out.extend(self._refit_one(name, trainer_meta[name]))
        return out

    def _refit_one(self, name: str, meta) -> Mapped:  # overridden where a tensor is not sent as it is
        return [(name, name, ())]

    def _fused_experts(self, prefix: str = "mlp.experts.") -> dict[str, tuple[tuple[int, ...], str]]:
        """Expected shapes of fused experts (`[E, 2I, H]` / `[E, H, I]`, or input-major)."""
        e, h, i = self.num_experts, self.hidden, self.inter
        return {prefix + "gate_up_proj": (((e, h, 2 * i) if self.input_major else (e, 2 * i, h)), "fused gate/up experts"),
                prefix + "down_proj": (((e, i, h) if self.input_major else (e, h, i)), "fused down experts")}

    @staticmethod
    def _expect(name: str, shape: tuple[int, ...], want: tuple[int, ...], what: str) -> None:
        if tuple(shape) != tuple(want):
            raise RefitMismatchError(name, f"shape {tuple(shape)} != {tuple(want)} expected for {what} from the config")


# ---------------------------------------------------------------------------------------------
# Qwen3-Next


class Qwen3NextMap(_FamilyMap):
    """See the module docstring. `input_major=True`: routed experts held in the grouped-GEMM
    layout (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`) instead of transformers'."""

    family = "Qwen3-Next"
    layer_suffixes = (
        r"(input_layernorm|post_attention_layernorm)\.weight",
        # gated DeltaNet (linear attention)
        r"linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj|norm)\.weight",
        r"linear_attn\.conv1d\.weight",
        r"linear_attn\.(A_log|dt_bias)",
        # gated full attention
        r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)",
        r"self_attn\.(q_norm|k_norm)\.weight",
        # sparse MoE block: router, fused routed experts, shared expert and its gate
        r"mlp\.gate\.weight",
        r"mlp\.experts\.(gate_up_proj|down_proj)",
        r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight",
        r"mlp\.shared_expert_gate\.weight",
        # dense MLP layers (`mlp_only_layers`, `decoder_sparse_step`)
        r"mlp\.(gate_proj|up_proj|down_proj)\.weight",
    )
    #: The decay parameters (`A_log`, `dt_bias`) and the scalar shared-expert gate are tiny and
    #: feed exponentials / a sigmoid: kept fp32 on the wire like norms and the router.
    KEEP_FP32 = (*DEFAULT_KEEP_FP32, "*.A_log", "*.dt_bias", "*shared_expert_gate.weight")

    def __init__(self, *, hidden_size: int, num_experts: int, moe_intermediate_size: int,
                 linear_num_key_heads: int, linear_num_value_heads: int, linear_key_head_dim: int,
                 linear_value_head_dim: int, linear_conv_kernel_dim: int, tie_word_embeddings: bool = False,
                 input_major: bool = False, keep_fp32: Sequence[str] = KEEP_FP32):
        super().__init__(tie_word_embeddings=tie_word_embeddings, keep_fp32=keep_fp32)
        self.hidden = hidden_size
        self.key_dim = linear_num_key_heads * linear_key_head_dim
        self.value_dim = linear_num_value_heads * linear_value_head_dim
        self.num_v_heads = linear_num_value_heads
        self.conv_kernel = linear_conv_kernel_dim
        self.num_experts = num_experts
        self.inter = moe_intermediate_size
        self.input_major = input_major
        self._experts = Qwen3MoeFusedExpertsMap(num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
                                                input_major=input_major, keep_fp32=keep_fp32)

    @classmethod
    def from_hf_config(cls, config, input_major: bool = False) -> Qwen3NextMap:
        return cls(hidden_size=config.hidden_size, num_experts=config.num_experts,
                   moe_intermediate_size=config.moe_intermediate_size,
                   linear_num_key_heads=config.linear_num_key_heads,
                   linear_num_value_heads=config.linear_num_value_heads,
                   linear_key_head_dim=config.linear_key_head_dim,
                   linear_value_head_dim=config.linear_value_head_dim,
                   linear_conv_kernel_dim=config.linear_conv_kernel_dim,
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   input_major=input_major)

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        suffix = _suffix(name)
        h, e = self.hidden, self.num_experts
        conv_dim = 2 * self.key_dim + self.value_dim
        expected = {
            "linear_attn.in_proj_qkvz.weight": ((2 * self.key_dim + 2 * self.value_dim, h), "q, k, v and z"),
            "linear_attn.in_proj_ba.weight": ((2 * self.num_v_heads, h), "b and a (one each per value head)"),
            "linear_attn.conv1d.weight": ((conv_dim, 1, self.conv_kernel), "the depthwise causal conv over q, k, v"),
            "linear_attn.A_log": ((self.num_v_heads,), "one decay per value head"),
            "linear_attn.dt_bias": ((self.num_v_heads,), "one time-step bias per value head"),
            "linear_attn.out_proj.weight": ((h, self.value_dim), "the DeltaNet output projection"),
            "mlp.shared_expert_gate.weight": ((1, h), "the shared expert's scalar gate"),
            "mlp.gate.weight": ((e, h), "the router"),
            **self._fused_experts(),
        }
        if suffix in expected:
            want, what = expected[suffix]
            self._expect(name, shape, want, what)

    def _refit_one(self, name: str, meta) -> Mapped:
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            return self._experts.refit({name: meta})
        return [(name, name, ())]

    def load(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self._experts.load(hf_state_dict)
        self._tie(out)
        return out


# ---------------------------------------------------------------------------------------------
# Gemma 4


class Gemma4Map(_FamilyMap):
    """See the module docstring. `input_major=True`: fused experts held as `[E, H, 2I]` /
    `[E, I, H]` (grouped-GEMM layout); they are then sent transposed (a view) into the
    checkpoint's `[E, 2I, H]` / `[E, H, I]`, still one tensor per layer."""

    family = "Gemma 4"
    top_level = ("embed_tokens.weight", "norm.weight", "embed_tokens_per_layer.weight",
                 "per_layer_model_projection.weight", "per_layer_projection_norm.weight")
    layer_suffixes = (
        r"(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm)\.weight",
        r"(post_feedforward_layernorm_1|post_feedforward_layernorm_2|pre_feedforward_layernorm_2)\.weight",
        r"layer_scalar",
        r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)",
        r"self_attn\.(q_norm|k_norm)\.weight",
        r"mlp\.(gate_proj|up_proj|down_proj)\.weight",
        # per-layer embeddings (PLE): this layer's gate and projection of its slice of the table
        r"(per_layer_input_gate|per_layer_projection)\.weight",
        r"post_per_layer_input_norm\.weight",
        # the MoE block beside the dense MLP: a three-tensor router and fused experts
        r"router\.(proj\.weight|scale|per_expert_scale)",
        r"experts\.(gate_up_proj|down_proj)",
    )
    #: `layer_scalar` multiplies the whole residual stream; router scales shape routing.
    KEEP_FP32 = (*DEFAULT_KEEP_FP32, "*.layer_scalar", "*router.scale", "*router.per_expert_scale")

    def __init__(self, *, hidden_size: int, num_hidden_layers: int, hidden_size_per_layer_input: int = 0,
                 vocab_size_per_layer_input: int | None = None, num_experts: int | None = None,
                 moe_intermediate_size: int | None = None, tie_word_embeddings: bool = True,
                 input_major: bool = False, keep_fp32: Sequence[str] = KEEP_FP32):
        super().__init__(tie_word_embeddings=tie_word_embeddings, keep_fp32=keep_fp32)
        self.hidden = hidden_size
        self.layers = num_hidden_layers
        self.ple = hidden_size_per_layer_input or 0
        self.ple_vocab = vocab_size_per_layer_input
        self.num_experts = num_experts
        self.inter = moe_intermediate_size
        self.input_major = input_major

    @classmethod
    def from_hf_config(cls, config, input_major: bool = False) -> Gemma4Map:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        moe = bool(getattr(config, "enable_moe_block", False))
        return cls(hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
                   hidden_size_per_layer_input=getattr(config, "hidden_size_per_layer_input", 0) or 0,
                   vocab_size_per_layer_input=getattr(config, "vocab_size_per_layer_input", None),
                   num_experts=config.num_experts if moe else None,
                   moe_intermediate_size=config.moe_intermediate_size if moe else None,
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)), input_major=input_major)

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        suffix = _suffix(name)
        h, lp = self.hidden, self.layers * self.ple
        expected: dict[str, tuple[tuple[int, ...], str]] = {}
        if self.ple:
            expected["per_layer_model_projection.weight"] = ((lp, h), "the per-layer input projection")
            expected["per_layer_projection_norm.weight"] = ((self.ple,), "the per-layer input norm")
            expected["per_layer_input_gate.weight"] = ((self.ple, h), "a layer's per-layer input gate")
            expected["per_layer_projection.weight"] = ((h, self.ple), "a layer's per-layer projection")
            if self.ple_vocab is not None:
                expected["embed_tokens_per_layer.weight"] = ((self.ple_vocab, lp), "the packed per-layer table")
        if self.num_experts is not None:
            e = self.num_experts
            expected["router.proj.weight"] = ((e, h), "the router projection")
            expected["router.scale"] = ((h,), "the router's input scale")
            expected["router.per_expert_scale"] = ((e,), "the router's per-expert scale")
            expected.update(self._fused_experts("experts."))
        if suffix in expected:
            want, what = expected[suffix]
            self._expect(name, shape, want, what)

    def _refit_one(self, name: str, meta) -> Mapped:
        views: tuple[ViewOp, ...] = ()
        if self.input_major and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            views = (Transpose(1, 2),)
        return [(name, name, views)]

    def load(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in hf_state_dict.items():
            if self.input_major and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                out[name] = t.transpose(1, 2).contiguous()
            else:
                out[name] = t.clone()
        self._tie(out)
        return out


# ---------------------------------------------------------------------------------------------
# choosing a map


def map_for_config(hf_config, *, fused_dense: bool = False, input_major: bool = False) -> NameMap:
    """The refit map for a transformers config of a supported family, for a trainer that holds
    the model as transformers does (`fused_dense=True`: a dense model held with fused qkv /
    gate_up and transposed kernels, `FusedDenseMap`; `input_major=True`: fused experts held in
    the grouped-GEMM layout)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in ("qwen2", "llama"):
        return FusedDenseMap.from_hf_config(hf_config) if fused_dense else HfLayoutMap.from_hf_config(hf_config)
    if model_type == "qwen3_moe":
        return Qwen3MoeFusedExpertsMap.from_hf_config(hf_config, input_major=input_major)
    if model_type == "qwen3_next":
        return Qwen3NextMap.from_hf_config(hf_config, input_major=input_major)
    if model_type in ("gemma4_text", "gemma4"):
        return Gemma4Map.from_hf_config(hf_config, input_major=input_major)
    raise TransportConfigError(f"model_type {model_type!r}: no refit map (known: qwen2, llama, qwen3_moe, "
                               f"qwen3_next, gemma4_text)")


__all__ = ["Gemma4Map", "HfLayoutMap", "Qwen3NextMap", "map_for_config"]
