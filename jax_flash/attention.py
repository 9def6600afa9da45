"""``jax_flash.attention``: FlashAttention with a custom VJP over the XLA FFI kernels."""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from jax_flash import _validation, sharding
from jax_flash._config import MaskOperands, ScoreConfig
from jax_flash.reference import attention_reference

Implementation = Literal["xla"] | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands,
           config: ScoreConfig) -> tuple[jax.Array, jax.Array]:
    return sharding.forward(q, k, v, masks, config)


def _flash_forward(q, k, v, masks, config):
    o, lse = sharding.forward(q, k, v, masks, config)
    return (o, lse), (q, k, v, masks, o, lse)


def _flash_backward(config, residuals, cotangents):
    q, k, v, masks, o, lse = residuals
    d_o, d_lse = cotangents
    dq, dk, dv = sharding.backward(q, k, v, o, lse, d_o, d_lse, masks, config)
    # Mask operands are integers or (ALiBi slopes) not differentiated: zero cotangents.
    return dq, dk, dv, jax.tree_util.tree_map(lambda _: None, masks)


_flash.defvjp(_flash_forward, _flash_backward)


def run(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, config: ScoreConfig,
        implementation: Implementation) -> tuple[jax.Array, jax.Array]:
    """Dispatches validated, normalised arguments. Returns ``(o, lse)``."""
    if implementation is None:
        return _flash(q, k, v, masks, config)
    if implementation == "xla":
        return attention_reference(q, k, v, masks, config)
    raise ValueError(f"implementation must be None (the jax_flash kernels) or 'xla', got {implementation!r}")


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: jax.Array | None = None,
    q_seqlens: jax.Array | None = None,
    kv_seqlens: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    implementation: Implementation = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Multi-head attention ``softmax(mask(score(q kᵀ))) v`` without materialising the score matrix.

    Scores follow, in order: ``s = softmax_scale * q·k``; if ``softcap > 0``, ``s = softcap * tanh(s / softcap)``;
    with ALiBi, ``s -= slope * |i + Sk - Sq - j|``; then the masks (causal, window, lengths, segments) set
    ``-inf``. Causal and window masks are aligned bottom-right when ``Sq != Sk`` (query ``i`` sees keys
    ``j <= i + Sk - Sq``, using each sequence's own lengths when ``q_seqlens``/``kv_seqlens`` are given).
    Rows that see no key give ``o = 0`` and ``lse = -inf``, never NaN.

    Args:
      q: ``[batch, seqlen_q, heads_q, head_dim]``, float32, bfloat16 or float16.
      k: ``[batch, seqlen_k, heads_kv, head_dim]``, same dtype; ``heads_q`` a multiple of ``heads_kv``
        (grouped-query / multi-query attention).
      v: like ``k``.
      causal: mask keys after the (bottom-right aligned) diagonal.
      softmax_scale: multiplies ``q·k``; defaults to ``1 / sqrt(head_dim)``.
      window_size: ``(left, right)`` sliding window around the diagonal, ``-1`` for unbounded.
      softcap: if positive, scores are squashed by ``softcap * tanh(s / softcap)``.
      alibi_slopes: ``[heads_q]`` or ``[batch, heads_q]`` ALiBi slopes (not differentiated).
      q_seqlens: ``[batch]`` int: rows at or past ``q_seqlens[b]`` are padding.
      kv_seqlens: ``[batch]`` int: keys at or past ``kv_seqlens[b]`` are padding.
      q_segment_ids: ``[batch, seqlen_q]`` int: with ``kv_segment_ids`` (``[batch, seqlen_k]``), a query only
        sees keys of the same segment (packed sequences); combines with the position-based masks.
      kv_segment_ids: see ``q_segment_ids``.
      dropout_rate: attention dropout; only 0 is supported so far.
      dropout_rng: PRNG key for dropout (unused while dropout is unsupported).
      deterministic: make the backward pass bit-reproducible (FlashAttention's meaning, not Flax's).
      return_lse: also return the log-sum-exp of each row's scores, ``[batch, heads_q, seqlen_q]`` float32
        (differentiable).
      implementation: ``None`` for the jax_flash kernels of the current platform, ``"xla"`` for the pure-JAX
        reference path (materialises the score matrix; also accepts float64).

    Returns:
      ``o`` of shape ``[batch, seqlen_q, heads_q, head_dim]`` in the input dtype, or ``(o, lse)`` when
      ``return_lse``.

    Example:
      >>> import jax, jax.numpy as jnp, jax_flash
      >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 128, 8, 64), jnp.bfloat16)
      >>> jax_flash.attention(q, k, v, causal=True).shape
      (2, 128, 8, 64)
    """
    _validation.check_qkv(q, k, v, allow_float64=implementation == "xla")
    head_dim = q.shape[-1]
    scale = (1.0 / math.sqrt(head_dim) if softmax_scale is None
             else _validation.static_float("softmax_scale", softmax_scale))
    rate = _validation.static_float("dropout_rate", dropout_rate, minimum=0.0)
    if rate >= 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
    if rate > 0.0:
        raise NotImplementedError("dropout_rate > 0 is not supported by the jax_flash kernels yet; use "
                                  "dropout_rate=0 or implementation='xla' with jax.nn-style dropout outside")
    del dropout_rng
    left, right = _validation.window("window_size", window_size)
    config = ScoreConfig(
        softmax_scale=scale,
        softcap=_validation.static_float("softcap", softcap, minimum=0.0),
        causal=_validation.static_bool("causal", causal),
        align_to_sequence_end=True,
        window_left=left,
        window_right=right,
        deterministic=_validation.static_bool("deterministic", deterministic),
    )
    masks = _validation.mask_operands(q, k, alibi_slopes=alibi_slopes, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    o, lse = run(q, k, v, masks, config, implementation)
    if _validation.static_bool("return_lse", return_lse):
        return o, lse.astype(jnp.float32)
    return o
