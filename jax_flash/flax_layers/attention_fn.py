"""A Flax ``attention_fn`` that runs jax_flash's fused attention kernels.

Flax's attention layers call ``attention_fn(query, key, value, **kwargs)``:
linen's ``MultiHeadDotProductAttention`` keeps only the keyword arguments the
function's signature names, nnx's ``MultiHeadAttention`` passes its full set
unfiltered. ``dot_product_attention`` below names every argument either of them
(Flax 0.10 onward) passes, so it drops into both, and it refuses, with an error
that says what to use instead, every argument the fused kernels cannot honour.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import dtypes as linen_dtypes

import jax_flash

Array = jax.Array

_MASK_ALTERNATIVES = (
    "express it with what the kernels support instead: `is_causal=True` "
    "(a causal mask), per-sequence lengths (`q_seqlens` / `kv_seqlens` of "
    "`jax_flash.attention`, for padding), or segment ids (`q_segment_ids` / "
    "`kv_segment_ids`, for packed sequences); or compute it unfused by "
    "binding `implementation='xla'`, e.g. "
    "`attention_fn=functools.partial(jax_flash.flax_layers.dot_product_attention, "
    "implementation='xla')`."
)


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any | None = None,
    precision: Any = None,
    module: Any | None = None,
    *,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
    promote_dtype: Callable[..., Sequence[Array]] | None = None,
    is_causal: bool = False,
    implementation: str | None = None,
) -> Array:
    """Fused dot-product attention with the signature of Flax's ``attention_fn``.

    Drop-in for ``flax.linen.dot_product_attention`` and
    ``flax.nnx.dot_product_attention``: pass it as ``attention_fn`` to
    ``flax.linen.MultiHeadDotProductAttention`` or ``flax.nnx.MultiHeadAttention``.
    The softmax scale is ``1 / sqrt(head_dim)`` as in Flax. Fewer key/value heads
    than query heads (grouped-query attention) are supported when
    ``num_heads % num_kv_heads == 0``.

    Linen's module has no causal flag; bind one with
    ``functools.partial(dot_product_attention, is_causal=True)``. The causal mask
    is aligned top-left (query ``i`` sees keys ``j <= i``), as in Flax and
    ``jax.nn.dot_product_attention``.

    Not supported by the fused kernels (each raises ``NotImplementedError`` whose
    message names the alternatives): an explicit ``mask`` or ``bias`` (this
    includes the mask Flax builds for autoregressive ``decode``), attention
    dropout (``dropout_rate > 0`` with ``deterministic=False``), sowing the
    attention weights (``module``, i.e. ``sow_weights=True``), which fused
    kernels never materialise, and custom einsums. With ``implementation='xla'``
    a ``mask`` or ``bias`` is applied unfused by ``jax.nn.dot_product_attention``'s
    XLA path (what Flax's own ``attention_fn`` runs); with ``'cudnn'`` cuDNN
    applies it.

    Args:
      query: queries, ``[batch..., q_length, num_heads, head_dim]``.
      key: keys, ``[batch..., kv_length, num_kv_heads, head_dim]``.
      value: values, ``[batch..., kv_length, num_kv_heads, head_dim]``.
      bias: additive score bias broadcastable to
        ``[batch..., num_heads, q_length, kv_length]``; only with
        ``implementation`` ``'xla'`` or ``'cudnn'``.
      mask: boolean mask (``False`` = masked out) broadcastable to
        ``[batch..., num_heads, q_length, kv_length]``; only with
        ``implementation`` ``'xla'`` or ``'cudnn'``.
      broadcast_dropout: Flax's dropout-broadcast flag; unused, since dropout is
        not supported yet.
      dropout_rng: PRNG key for dropout; unused, since dropout is not supported
        yet.
      dropout_rate: attention dropout probability.
      deterministic: Flax's meaning: ``True`` disables dropout. Not jax_flash's
        ``deterministic`` (a bit-reproducible backward pass).
      dtype: compute dtype; ``query``, ``key`` and ``value`` are promoted to it
        (default: their common dtype), as in Flax.
      precision: accepted for compatibility; the kernels multiply in the input
        dtype and always accumulate in float32.
      module: the module Flax passes when ``sow_weights=True``; must be ``None``.
      force_fp32_for_softmax: accepted for compatibility; the kernels always
        compute the softmax in float32.
      einsum_dot_general: linen's custom ``dot_general``; must be ``None``.
      qk_attn_weights_einsum: linen's custom (e.g. quantized) einsum; must be
        ``None``.
      attn_weights_value_einsum: linen's custom einsum; must be ``None``.
      promote_dtype: nnx's promotion function, called as
        ``promote_dtype((query, key, value), dtype=dtype)``; default: linen's
        ``promote_dtype``.
      is_causal: apply a top-left aligned causal mask.
      implementation: forwarded to ``jax_flash.dot_product_attention``: ``None``
        runs jax_flash's kernels, ``'xla'`` its pure-JAX reference (or, given a
        ``mask`` or ``bias``, ``jax.nn``'s XLA path), ``'cudnn'`` cuDNN through
        ``jax.nn.dot_product_attention``.

    Returns:
      The attention output, ``[batch..., q_length, num_heads, head_dim]``, in the
      promoted dtype.

    Raises:
      NotImplementedError: for the unsupported arguments listed above.
      ValueError: if the ranks or batch dimensions of ``query``, ``key`` and
        ``value`` disagree.
    """
    _check_supported(
        bias=bias,
        mask=mask,
        dropout_rate=dropout_rate,
        deterministic=deterministic,
        module=module,
        custom_einsums=(
            einsum_dot_general,
            qk_attn_weights_einsum,
            attn_weights_value_einsum,
        ),
        implementation=implementation,
    )
    if promote_dtype is None:
        query, key, value = linen_dtypes.promote_dtype(query, key, value, dtype=dtype)
    else:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    batch_shape = _batch_shape(query, key, value)

    # The kernels take exactly one batch axis; Flax allows any number, so fold
    # them into one (a free reshape) and unfold the output.
    query, key, value = (_fold_batch(x, batch_shape) for x in (query, key, value))
    if bias is not None:
        bias = _fold_batch(bias, batch_shape)
    if mask is not None:
        mask = _fold_batch(mask.astype(jnp.bool_), batch_shape)
    if implementation == "xla" and (mask is not None or bias is not None):
        # jax_flash's reference mirrors the kernels and so takes no arbitrary
        # mask; jax.nn's XLA path does, with the semantics Flax users expect.
        out = jax.nn.dot_product_attention(
            query, key, value, bias, mask, is_causal=is_causal, implementation="xla"
        )
    else:
        out = jax_flash.dot_product_attention(
            query, key, value, bias, mask, is_causal=is_causal, implementation=implementation
        )
    return out.reshape(batch_shape + out.shape[1:])


def _check_supported(
    *,
    bias: Array | None,
    mask: Array | None,
    dropout_rate: float,
    deterministic: bool,
    module: Any | None,
    custom_einsums: tuple[Callable[..., Array] | None, ...],
    implementation: str | None,
) -> None:
    """Raises for the Flax arguments the fused kernels cannot honour."""
    if implementation not in ("xla", "cudnn"):
        for name, array in (("mask", mask), ("bias", bias)):
            if array is not None:
                raise NotImplementedError(
                    f"jax_flash's fused kernels do not take an arbitrary attention "
                    f"{name} (Flax passes one for padding masks, "
                    f"`nn.make_causal_mask` and `decode=True`); {_MASK_ALTERNATIVES}"
                )
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(
            "jax_flash's kernels do not implement attention dropout yet: use "
            "dropout_rate=0.0, call the layer with deterministic=True, or use "
            "Flax's own attention_fn for training with attention dropout."
        )
    if module is not None:
        raise NotImplementedError(
            "sow_weights=True asks for the attention weights, which fused kernels "
            "never materialise; call the layer with sow_weights=False, or use "
            "Flax's own attention_fn where the weights are needed."
        )
    if any(einsum is not None for einsum in custom_einsums):
        raise NotImplementedError(
            "custom einsums (einsum_dot_general, qk_attn_weights_einsum_cls, "
            "attn_weights_value_einsum_cls, e.g. for quantization) cannot replace "
            "the fused kernel's matrix products; use Flax's own attention_fn."
        )


def _batch_shape(query: Array, key: Array, value: Array) -> tuple[int, ...]:
    """Returns the common leading batch shape of ``[batch..., L, H, D]`` inputs."""
    if not query.ndim == key.ndim == value.ndim >= 3:
        raise ValueError(
            "query, key and value must have the same rank >= 3 "
            "([batch..., length, num_heads, head_dim]); got shapes "
            f"{query.shape}, {key.shape}, {value.shape}."
        )
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
        raise ValueError(
            "query, key and value batch dimensions must match; got shapes "
            f"{query.shape}, {key.shape}, {value.shape}."
        )
    return batch_shape


def _fold_batch(x: Array, batch_shape: tuple[int, ...]) -> Array:
    """Folds ``batch_shape`` into one leading axis of a ``[batch..., a, b, c]`` array.

    ``x`` may broadcast against ``batch_shape`` (masks and biases often carry
    size-1 or missing batch axes); such axes are broadcast first.
    """
    x = x.reshape((1,) * (len(batch_shape) + 3 - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, batch_shape + x.shape[-3:])
    return x.reshape((math.prod(batch_shape),) + x.shape[-3:])
