"""A Flax nnx attention layer that runs jax_flash's fused kernels.

The class subclasses ``flax.nnx.MultiHeadAttention`` and changes only the
default ``attention_fn``, so constructor, call signature and state are those of
the installed Flax: a state split from one merges into the other.
"""

from __future__ import annotations

import inspect
from typing import Any

from flax import nnx

from jax_flash.flax_layers.attention_fn import dot_product_attention


class MultiHeadAttention(nnx.MultiHeadAttention):
    """``flax.nnx.MultiHeadAttention`` on jax_flash's kernels.

    Inputs are ``[batch..., length, in_features]``; the heads the layer projects
    are ``[batch..., length, num_heads, qkv_features // num_heads]``. Where the
    installed Flax has ``num_kv_heads``, fewer key/value heads run as
    grouped-query attention without repeating them. For causal self-attention
    call with ``is_causal=True`` where the installed Flax's ``__call__`` has that
    argument (it then always passes it, overriding a value bound into
    ``attention_fn``); on older Flax bind it instead,
    ``attention_fn=functools.partial(dot_product_attention, is_causal=True)``::

        >>> import jax.numpy as jnp
        >>> from flax import nnx as flax_nnx
        >>> from jax_flash.flax_layers import nnx
        >>> layer = nnx.MultiHeadAttention(
        ...     num_heads=4, in_features=32, num_kv_heads=2, decode=False,
        ...     rngs=flax_nnx.Rngs(0))
        >>> layer(jnp.ones((1, 8, 32)), is_causal=True).shape
        (1, 8, 32)

    The ``mask`` argument (and so ``decode=True``), attention dropout in
    training and ``sow_weights=True`` raise; see
    ``jax_flash.flax_layers.dot_product_attention`` for what to use instead.
    """

    # Forwarding *args/**kwargs rather than restating Flax's parameters keeps
    # this constructor identical to whichever Flax is installed (they changed
    # between 0.10 and 0.12); __signature__ below publishes that signature.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("attention_fn", dot_product_attention)
        super().__init__(*args, **kwargs)


def _signature_with_our_default() -> inspect.Signature:
    """Flax's constructor signature with our ``attention_fn`` as the default."""
    signature = inspect.signature(nnx.MultiHeadAttention.__init__)
    parameters = [
        p.replace(default=dot_product_attention) if p.name == "attention_fn" else p
        for p in signature.parameters.values()
    ]
    return signature.replace(parameters=parameters)


MultiHeadAttention.__init__.__signature__ = _signature_with_our_default()  # type: ignore[attr-defined]
