"""``jax_flash.dot_product_attention``: a drop-in for ``jax.nn.dot_product_attention`` on the jax_flash kernels."""

from __future__ import annotations

import math
from typing import Literal, overload

import jax
import jax.numpy as jnp

from jax_flash import _validation
from jax_flash._config import ScoreConfig
from jax_flash.attention import run


def _local_window(local_window_size: int | tuple[int, int] | None) -> tuple[int, int]:
    if local_window_size is None:
        return (-1, -1)
    if isinstance(local_window_size, int) and not isinstance(local_window_size, bool):
        if local_window_size < 0:
            raise ValueError(f"local_window_size must be >= 0, got {local_window_size}")
        return (local_window_size, local_window_size)
    left, right = _validation.window("local_window_size", local_window_size)
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size entries must be >= 0, got {local_window_size!r}")
    return (left, right)


@overload
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: Literal[False] = False,
) -> jax.Array: ...


@overload
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: Literal[True],
) -> tuple[jax.Array, jax.Array]: ...


@overload
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Signature- and semantics-compatible with ``jax.nn.dot_product_attention``.

    Unlike ``jax_flash.attention``, the causal mask and local window are aligned top-left (query ``i`` sees
    keys ``j <= i``), as in ``jax.nn``. Rows that see no key (e.g. padding rows past ``query_seq_lengths``)
    give 0 here, where ``jax.nn``'s XLA path gives an average of the values. float32 inputs on the GPU run on
    TF32 tensor cores, as ``jax.nn``'s XLA path does at the default matmul precision; for exact float32 use
    ``jax_flash.attention(..., float32_precision="highest")``.

    Args:
      query: ``[batch, seqlen_q, heads_q, head_dim]`` or ``[seqlen_q, heads_q, head_dim]``.
      key: ``[batch, seqlen_k, heads_kv, head_dim]`` (or without batch), ``heads_q % heads_kv == 0``.
      value: like ``key``.
      bias: additive bias broadcastable to ``[batch, heads_q, seqlen_q, seqlen_k]`` (differentiable).
      mask: boolean, broadcastable likewise; True attends.
      scale: multiplies ``q·k``; defaults to ``1 / sqrt(head_dim)``.
      is_causal: top-left aligned causal mask.
      query_seq_lengths: ``[batch]`` int32 valid query lengths.
      key_value_seq_lengths: ``[batch]`` int32 valid key/value lengths.
      local_window_size: ``(left, right)`` or a symmetric int window.
      implementation: ``None`` for the jax_flash kernels, ``"xla"`` for jax_flash's pure-JAX path, ``"cudnn"``
        to call ``jax.nn.dot_product_attention(implementation="cudnn")`` itself.
      return_residual: also return the log-sum-exp, ``[batch, seqlen_q, heads_q]`` in the output dtype.

    Returns:
      The attention output shaped like ``query`` (and the residual when ``return_residual``).
    """
    return flax_compatible_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
        implementation=implementation, return_residual=return_residual)


def flax_compatible_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    float32_precision: Literal["tf32", "highest"] | jax.lax.Precision = "tf32",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``dot_product_attention`` plus attention dropout (for the Flax adapter); same arguments otherwise."""
    if implementation == "cudnn":
        if dropout_rate > 0.0:
            raise NotImplementedError("jax.nn's cuDNN path takes no dropout; use implementation=None")
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
            implementation="cudnn", return_residual=return_residual)  # type: ignore[call-overload,misc]
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) not in (3, 4):
            raise ValueError(f"{name} must have rank 3 or 4, got shape {getattr(x, 'shape', None)}")
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(f"query, key and value must have the same rank, got {query.ndim}, {key.ndim}, "
                         f"{value.ndim}")
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    _validation.check_qkv(query, key, value, allow_float64=implementation == "xla")

    softmax_scale = (1.0 / math.sqrt(query.shape[-1]) if scale is None
                     else _validation.static_float("scale", scale))
    left, right = _local_window(local_window_size)
    rate = _validation.dropout_rate(dropout_rate)
    config = ScoreConfig(softmax_scale=softmax_scale, causal=_validation.static_bool("is_causal", is_causal),
                         align_to_sequence_end=False, window_left=left, window_right=right, dropout_rate=rate,
                         allow_tf32=_validation.allow_tf32(float32_precision))
    masks = _validation.mask_operands(query, key, alibi_slopes=None, q_seqlens=query_seq_lengths,
                                      kv_seqlens=key_value_seq_lengths, q_segment_ids=None, kv_segment_ids=None)
    dense = _validation.dense_operands(query, key, bias=bias, mask=mask, dropout_rate=rate, dropout_rng=dropout_rng)
    out, lse = run(query, key, value, masks, config, implementation, dense)
    residual = jnp.transpose(lse, (0, 2, 1)).astype(out.dtype)
    if unbatched:
        out, residual = out[0], residual[0]
    return (out, residual) if return_residual else out
