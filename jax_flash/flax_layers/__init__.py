"""Flax integration: jax_flash attention as a linen/nnx ``attention_fn`` and layers.

``dot_product_attention`` plugs into Flax's own layers
(``attention_fn=jax_flash.flax_layers.dot_product_attention``);
``linen.MultiHeadDotProductAttention``, ``linen.MultiHeadAttention`` and
``nnx.MultiHeadAttention`` are Flax's layers with that default.
"""

from jax_flash.flax_layers import linen, nnx
from jax_flash.flax_layers.attention_fn import dot_product_attention

__all__ = ["dot_product_attention", "linen", "nnx"]
