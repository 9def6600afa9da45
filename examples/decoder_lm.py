"""The small decoder-only transformer (Flax nnx) that the examples train: pre-norm blocks of causal
self-attention through a pluggable ``attention_fn`` (jax_flash's Flax layer) and a GELU MLP."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_flash import flax_layers


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model shape; ``dtype`` is the compute dtype (parameters stay float32)."""

    vocab_size: int
    seq_len: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    dtype: jnp.dtype


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, config: ModelConfig, attention_fn: Callable[..., jax.Array], rngs: nnx.Rngs):
        d_model, dtype = config.d_model, config.dtype
        self.attention_norm = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.attention = flax_layers.nnx.MultiHeadAttention(
            num_heads=config.num_heads,
            in_features=d_model,
            num_kv_heads=config.num_kv_heads,
            use_bias=False,
            decode=False,
            dtype=dtype,
            attention_fn=attention_fn,
            rngs=rngs,
        )
        self.mlp_norm = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, 4 * d_model, dtype=dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d_model, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[batch, seq_len, d_model]`` -> same shape."""
        x = x + self.attention(self.attention_norm(x), is_causal=True)
        return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class DecoderLM(nnx.Module):
    """Token + learned position embeddings, ``num_layers`` blocks, tied output head."""

    def __init__(self, config: ModelConfig, attention_fn: Callable[..., jax.Array], rngs: nnx.Rngs):
        self.token_embed = nnx.Embed(config.vocab_size, config.d_model, dtype=config.dtype, rngs=rngs)
        self.position_embed = nnx.Embed(config.seq_len, config.d_model, dtype=config.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(config, attention_fn, rngs) for _ in range(config.num_layers)])
        self.final_norm = nnx.LayerNorm(config.d_model, dtype=config.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Int ``[batch, seq_len]`` tokens and their positions -> float32 ``[batch, seq_len, vocab]`` logits."""
        x = self.token_embed(tokens) + self.position_embed(positions)
        for block in self.blocks:
            x = block(x)
        return self.token_embed.attend(self.final_norm(x)).astype(jnp.float32)
