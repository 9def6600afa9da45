"""Flax linen attention layers that run jax_flash's fused kernels.

Each class subclasses Flax's own layer and changes only the default
``attention_fn``, so attributes, call signature and parameter tree are Flax's:
variables initialised by one load into the other unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import linen

from jax_flash.flax_layers.attention_fn import dot_product_attention

Array = jax.Array


class MultiHeadDotProductAttention(linen.MultiHeadDotProductAttention):
    """``flax.linen.MultiHeadDotProductAttention`` on jax_flash's kernels.

    Inputs are ``[batch..., length, features]``; the heads the layer projects are
    ``[batch..., length, num_heads, qkv_features // num_heads]``. For a causal
    layer, bind the flag, since linen's layer has none::

        >>> import functools
        >>> import jax, jax.numpy as jnp
        >>> from jax_flash.flax_layers import dot_product_attention, linen
        >>> layer = linen.MultiHeadDotProductAttention(
        ...     num_heads=2, qkv_features=16,
        ...     attention_fn=functools.partial(dot_product_attention, is_causal=True))
        >>> x = jnp.ones((1, 8, 16))
        >>> variables = layer.init(jax.random.key(0), x)
        >>> layer.apply(variables, x).shape
        (1, 8, 16)

    The layer's ``mask`` argument (and so ``decode=True``), attention dropout in
    training and ``sow_weights=True`` raise; see
    ``jax_flash.flax_layers.dot_product_attention`` for what to use instead.
    """

    attention_fn: Callable[..., Array] = dot_product_attention


class MultiHeadAttention(linen.MultiHeadAttention):
    """``flax.linen.MultiHeadAttention`` on jax_flash's kernels.

    Flax's alias of ``MultiHeadDotProductAttention`` whose instances are named
    ``MultiHeadAttention_{index}``; kept so that checkpoints using that naming
    load unchanged. See ``MultiHeadDotProductAttention`` for usage and limits.
    """

    attention_fn: Callable[..., Array] = dot_product_attention
