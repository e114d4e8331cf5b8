"""A Flax NNX implementation of the Qwen2 architecture (the project's models), fp32 by default.

Parameters are stored the way Flax stores them, under the names of the fused dense trainer
layout that `transports.refit.maps.FusedDenseMap` refits (`refit.py` relies on it):

    embed.weight                 [V, H]
    layers.i.attn_norm.scale     [H]
    layers.i.attn.qkv.kernel     [H, Q+2K]   q | k | v, kernels [in, out]
    layers.i.attn.qkv.bias       [Q+2K]      (Qwen2 has q/k/v biases, no o bias)
    layers.i.attn.o.kernel       [Q, H]
    layers.i.mlp_norm.scale      [H]
    layers.i.mlp.gate_up.kernel  [H, 2I]     gate | up
    layers.i.mlp.down.kernel     [I, H]
    final_norm.scale             [H]
    lm_head.kernel               [H, V]      absent when the embeddings are tied

The forward is the one transformers' `Qwen2ForCausalLM` computes (RMSNorm in fp32, default
rotary embedding with the halves rotated, grouped-query attention, SwiGLU): the unit tests
compare logits with it. Matmuls ask for `Precision.HIGHEST` so that an accelerator does not
quietly run fp32 matmuls in a reduced precision (on a CPU it changes nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import msgspec
from flax import nnx

HIGHEST = jax.lax.Precision.HIGHEST


class Qwen2Config(msgspec.Struct, frozen=True):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    dtype: str = "float32"  # of the parameters and the activations

    @classmethod
    def from_hf(cls, config, dtype: str = "float32") -> Qwen2Config:
        """From a transformers `Qwen2Config` (v4: `rope_theta`; v5: `rope_parameters`). Features
        this model does not implement are refused, naming the field, rather than ignored."""
        if getattr(config, "model_type", None) != "qwen2":
            raise ValueError(f"model_type: {getattr(config, 'model_type', None)!r} is not qwen2")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("use_sliding_window: sliding-window attention is not implemented")
        act = getattr(config, "hidden_act", None)
        if act not in ("silu", "swish"):  # the MLP computes SwiGLU whatever the config says
            raise ValueError(f"hidden_act: {act!r} is not implemented (only 'silu')")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_parameters.rope_type: {rope_type!r} is not implemented (only 'default')")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ValueError("rope_theta: absent from the config")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                   num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                   head_dim=head_dim, rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(theta),
                   tie_word_embeddings=bool(config.tie_word_embeddings), dtype=dtype)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


class Embed(nnx.Module):
    """Token embeddings `[V, H]` under the name `weight` (the trainer layout's name)."""

    def __init__(self, vocab: int, hidden: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, hidden), dtype) * 0.02)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, *, dtype):
        self.scale = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * h.astype(x.dtype)


def _linear(n_in: int, n_out: int, *, bias: bool, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, precision=HIGHEST, rngs=rngs)


def rotary(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[T, head_dim]` of the default rotary embedding (frequencies repeated for the
    two halves, as transformers' `rotate_half` convention wants)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    # x: [B, T, heads, D]; cos/sin: [T, D]
    return x * cos[None, :, None, :].astype(x.dtype) + rotated * sin[None, :, None, :].astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen2Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.qkv = _linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=True, dtype=dtype, rngs=rngs)
        self.o = _linear(cfg.q_size, cfg.hidden_size, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x.shape
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = self.qkv(x)
        q = qkv[..., :cfg.q_size].reshape(b, t, heads, d)
        k = qkv[..., cfg.q_size:cfg.q_size + cfg.kv_size].reshape(b, t, kv_heads, d)
        v = qkv[..., cfg.q_size + cfg.kv_size:].reshape(b, t, kv_heads, d)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = heads // kv_heads
        # Query head h uses kv head h // groups (transformers' repeat_kv order).
        q = q.reshape(b, t, kv_heads, groups, d)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=HIGHEST).astype(jnp.float32) / jnp.sqrt(
            jnp.float32(d))
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v, precision=HIGHEST).reshape(b, t, heads * d)
        return self.o(out)


class MLP(nnx.Module):
    def __init__(self, cfg: Qwen2Config, *, dtype, rngs: nnx.Rngs):
        self.inter = cfg.intermediate_size
        self.gate_up = _linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=dtype, rngs=rngs)
        self.down = _linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_up = self.gate_up(x)
        return self.down(jax.nn.silu(gate_up[..., :self.inter]) * gate_up[..., self.inter:])


class Block(nnx.Module):
    def __init__(self, cfg: Qwen2Config, *, dtype, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Qwen2(nnx.Module):
    """`Qwen2(cfg, rngs=nnx.Rngs(0))` initialises random weights; `refit.load_from_hf` builds one
    from an HF state dict without initialising anything first."""

    def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Logits `[B, T, V]` for right-padded `input_ids [B, T]`; `attention_mask [B, T]` (1 =
        token, 0 = padding) keeps padding out of every key set. Positions count from 0."""
        _, t = input_ids.shape
        x = self.embed(input_ids)
        cos, sin = rotary(jnp.arange(t), self.cfg.head_dim, self.cfg.rope_theta)
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))[None]
        if attention_mask is not None:
            mask = mask & attention_mask.astype(bool)[:, None, :]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.final_norm(x)
        if self.cfg.tie_word_embeddings:
            return jnp.einsum("bth,vh->btv", x, self.embed.weight[...], precision=HIGHEST)
        return self.lm_head(x)
