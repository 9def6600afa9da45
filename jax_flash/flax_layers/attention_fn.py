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
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
from flax.linen import dtypes as linen_dtypes

from jax_flash import _validation
from jax_flash.jax_nn_compat import flax_compatible_attention

Array = jax.Array

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
    implementation: Literal["xla", "cudnn"] | None = None,
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

    Masks (padding masks, ``nn.make_causal_mask``, the ``decode`` cache mask),
    additive biases and attention dropout go to the kernels. A key-only mask
    (the ``decode`` cache mask, a key-padding mask) of a short query sequence
    runs as kv lengths and segment ids, so decoding takes the GQA-packed,
    split-KV path (see ``JAX_FLASH_KEY_MASKS`` in the README).
    Dropout masks are drawn independently for every (batch, head, query, key)
    element, as with Flax's ``broadcast_dropout=False``, whatever that flag says.
    Not supported (each raises ``NotImplementedError``): sowing the attention
    weights (``module``, i.e. ``sow_weights=True``), which fused kernels never
    materialise, and custom einsums.

    Args:
      query: queries, ``[batch..., q_length, num_heads, head_dim]``.
      key: keys, ``[batch..., kv_length, num_kv_heads, head_dim]``.
      value: values, ``[batch..., kv_length, num_kv_heads, head_dim]``.
      bias: additive score bias broadcastable to
        ``[batch..., num_heads, q_length, kv_length]`` (differentiable).
      mask: boolean mask (``False`` = masked out) broadcastable to
        ``[batch..., num_heads, q_length, kv_length]``.
      broadcast_dropout: Flax's dropout-broadcast flag; accepted, but masks are
        always independent per element.
      dropout_rng: PRNG key for dropout, required when dropout is active.
      dropout_rate: attention dropout probability.
      deterministic: Flax's meaning: ``True`` disables dropout. Not jax_flash's
        ``deterministic`` (a bit-reproducible backward pass).
      dtype: compute dtype; ``query``, ``key`` and ``value`` are promoted to it
        (default: their common dtype), as in Flax.
      precision: for float32 inputs on the GPU, as for Flax's einsums:
        ``None``, ``DEFAULT`` or ``HIGH`` multiplies on TF32 tensor cores,
        ``HIGHEST`` in exact float32 (see
        ``jax_flash.attention``'s ``float32_precision``). 16-bit inputs are
        multiplied in their dtype; accumulation is always float32.
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
        runs jax_flash's kernels, ``'xla'`` its pure-JAX reference, ``'cudnn'``
        cuDNN through ``jax.nn.dot_product_attention``.

    Returns:
      The attention output, ``[batch..., q_length, num_heads, head_dim]``, in the
      promoted dtype.

    Raises:
      NotImplementedError: for the unsupported arguments listed above.
      ValueError: if the ranks or batch dimensions of ``query``, ``key`` and
        ``value`` disagree.
    """
    _check_supported(
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
    # Flax's `deterministic` means "no dropout" (never jax_flash's reproducible backward).
    rate = 0.0 if deterministic else dropout_rate
    out = cast(jax.Array, flax_compatible_attention(  # no return_residual: the output alone
        query, key, value, bias, mask, is_causal=is_causal, implementation=implementation,
        dropout_rate=rate, dropout_rng=dropout_rng if rate > 0.0 else None,
        float32_precision=_float32_precision(precision),
    ))
    return out.reshape(batch_shape + out.shape[1:])


def _float32_precision(precision: Any) -> Any:
    """Flax's ``precision`` (None, a ``jax.lax.Precision`` or its name, or a pair of them) as jax_flash's
    ``float32_precision``: the more precise of a pair wins."""
    if precision is None:
        return "tf32"
    if isinstance(precision, (tuple, list)):
        tf32 = all(_validation.allow_tf32(_float32_precision(p)) for p in precision)
        return "tf32" if tf32 else "highest"
    return precision


def _check_supported(
    *,
    dropout_rate: float,
    deterministic: bool,
    module: Any | None,
    custom_einsums: tuple[Callable[..., Array] | None, ...],
    implementation: Literal["xla", "cudnn"] | None,
) -> None:
    """Raises for the Flax arguments the fused kernels cannot honour."""
    if dropout_rate > 0.0 and not deterministic and implementation == "cudnn":
        raise NotImplementedError("jax.nn's cuDNN path takes no attention dropout; use implementation=None")
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
