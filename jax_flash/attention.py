"""``jax_flash.attention``: FlashAttention with a custom VJP over the XLA FFI kernels."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, overload

import jax
import jax.numpy as jnp

from jax_flash import _key_masks, _validation, sharding
from jax_flash._config import DenseOperands, MaskOperands, ScoreConfig
from jax_flash.reference import attention_reference

Implementation = Literal["xla"] | None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _BackwardNeeds:
    """What the backward must produce beyond dq/dk/dv, decided in the forward from which inputs are perturbed."""

    dbias: bool


def _forward(q, k, v, masks: MaskOperands, dense: DenseOperands, config: ScoreConfig):
    return sharding.forward(q, k, v, masks, config, dense)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, dense: DenseOperands,
           config: ScoreConfig) -> tuple[jax.Array, jax.Array]:
    return _forward(q, k, v, masks, dense, config)


def _flash_forward(q, k, v, masks, dense, config):
    # symbolic_zeros=True: every argument arrives as a CustomVJPPrimal(value, perturbed), so dbias is computed
    # only when the caller differentiates with respect to the bias.
    needs = _BackwardNeeds(dbias=bool(dense.bias.perturbed) and dense.bias.value.shape[-1] != 0)
    q, k, v, masks, dense = jax.tree_util.tree_map(lambda x: x.value, (q, k, v, masks, dense))
    o, lse = _forward(q, k, v, masks, dense, config)
    return (o, lse), (q, k, v, masks, dense, o, lse, needs)


def _materialize(cotangent, like: jax.Array) -> jax.Array:
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros(like.shape, like.dtype)
    return cotangent


def _sum_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums ``x`` over the axes where ``shape`` (same rank) has size 1."""
    axes = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    return jnp.sum(x, axis=axes, keepdims=True).astype(jnp.float32)


def _flash_backward(config, residuals, cotangents):
    q, k, v, masks, dense, o, lse, needs = residuals
    d_o, d_lse = _materialize(cotangents[0], o), _materialize(cotangents[1], lse)
    # A bias constant along the keys cancels in the softmax and only shifts lse: its gradient is exactly the
    # lse cotangent. (The kernels' dS sums to it only up to the rounding of O in rowsum(dO * O).)
    key_broadcast = needs.dbias and dense.bias.shape[-1] == 1
    grads = sharding.backward(q, k, v, o, lse, d_o, d_lse, masks, config, dense,
                              want_dbias=needs.dbias and not key_broadcast)
    dq, dk, dv = grads[:3]
    dbias = None
    if key_broadcast:
        dbias = _sum_to_shape(jnp.where(jnp.isfinite(lse), d_lse, 0.0)[..., None], dense.bias.shape)
    elif needs.dbias:
        dbias = grads[3]
    # Mask operands are integers, booleans or (ALiBi slopes) constants: no cotangents.
    no_cotangents = jax.tree_util.tree_map(lambda _: None, masks)
    return dq, dk, dv, no_cotangents, DenseOperands(dbias, None, None)


_flash.defvjp(_flash_forward, _flash_backward, symbolic_zeros=True)


def run(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, config: ScoreConfig,
        implementation: Implementation, dense: DenseOperands | None = None) -> tuple[jax.Array, jax.Array]:
    """Dispatches validated, normalised arguments. Returns ``(o, lse)``. The kernels get a key-only mask of a
    decoding-shaped call as kv lengths and segment ids (``_key_masks``)."""
    dense = DenseOperands.absent(q.shape[0]) if dense is None else dense
    if implementation is None:
        masks, dense = _key_masks.as_lengths_and_segments(q, k, masks, config, dense)
        return _flash(q, k, v, masks, dense, config)
    if implementation == "xla":
        return attention_reference(q, k, v, masks, config, dense)
    raise ValueError(f"implementation must be None (the jax_flash kernels) or 'xla', got {implementation!r}")


@overload
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
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = False,
    return_lse: Literal[False] = False,
    implementation: Implementation = None,
    float32_precision: Literal["tf32", "highest"] | jax.lax.Precision = "tf32",
) -> jax.Array: ...


@overload
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
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = False,
    return_lse: Literal[True],
    implementation: Implementation = None,
    float32_precision: Literal["tf32", "highest"] | jax.lax.Precision = "tf32",
) -> tuple[jax.Array, jax.Array]: ...


@overload
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
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    implementation: Implementation = None,
    float32_precision: Literal["tf32", "highest"] | jax.lax.Precision = "tf32",
) -> jax.Array | tuple[jax.Array, jax.Array]: ...


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
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    implementation: Implementation = None,
    float32_precision: Literal["tf32", "highest"] | jax.lax.Precision = "tf32",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Multi-head attention ``softmax(mask(score(q kᵀ))) v`` without materialising the score matrix.

    Scores follow, in order: ``s = softmax_scale * q·k``; if ``softcap > 0``, ``s = softcap * tanh(s / softcap)``;
    with ALiBi, ``s -= slope * |i + Sk - Sq - j|``; then the masks (causal, window, lengths, segments) set
    ``-inf``. Causal and window masks are aligned bottom-right when ``Sq != Sk`` (query ``i`` sees keys
    ``j <= i + Sk - Sq``). With ``q_seqlens``/``kv_seqlens``, ``Sq`` and ``Sk`` in both formulas are each
    sequence's own lengths.
    Rows that see no key give ``o = 0`` and ``lse = -inf``, never NaN.

    Args:
      q: ``[batch, seqlen_q, heads_q, head_dim]``, float32, bfloat16 or float16 (float32: see
        ``float32_precision``).
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
      bias: additive score bias broadcastable to ``[batch, heads_q, seqlen_q, seqlen_k]`` (added after ALiBi;
        size-1 axes are read with stride 0, never materialised). Differentiable: its gradient is summed over the
        broadcast axes, and computed only when asked for.
      mask: boolean, broadcastable like ``bias``; False hides the key from the query.
      dropout_rate: probability of dropping each attention probability (kept ones scale by
        ``1 / (1 - dropout_rate)``); the kernels and ``implementation="xla"`` drop the same elements for the
        same key (Philox, see ``csrc/common/philox.h``).
      dropout_rng: JAX PRNG key, required when ``dropout_rate > 0``.
      deterministic: make the backward pass bit-reproducible (FlashAttention's meaning, not Flax's).
      return_lse: also return the log-sum-exp of each row's scores, ``[batch, heads_q, seqlen_q]`` float32
        (differentiable).
      implementation: ``None`` for the jax_flash kernels of the current platform, ``"xla"`` for the pure-JAX
        reference path (materialises the score matrix; also accepts float64).
      float32_precision: for float32 inputs on the GPU (ignored otherwise): ``"tf32"`` (default, like XLA's
        default float32 matmul precision on the GPU) multiplies on TF32 tensor cores with float32 accumulation
        (on compute capability 9.x its backward runs on float16 operands scaled by powers of two, which keep TF32's
        significant bits); ``"highest"`` gives float32's accuracy: on compute capability 9.x at head_dim <= 128
        mostly on the tensor cores (operands split into two TF32 or float16 parts, three products per product;
        dropout, and in the backward softcap, ALiBi, bias and mask, excepted), elsewhere every product and sum in
        float32 (SIMT FMA, slower). README's switch table names each path's switch and where it applies. Forward
        and backward use the same mode. Also accepts ``jax.lax.Precision`` as XLA reads it for float32 on the GPU:
        ``DEFAULT`` and ``HIGH`` are ``"tf32"``, ``HIGHEST`` is ``"highest"``. The CPU kernels are always exact.
        ``bias``, ``mask`` and dropout work in both modes.

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
    rate = _validation.dropout_rate(dropout_rate)
    left, right = _validation.window("window_size", window_size)
    config = ScoreConfig(
        softmax_scale=scale,
        softcap=_validation.static_float("softcap", softcap, minimum=0.0),
        causal=_validation.static_bool("causal", causal),
        align_to_sequence_end=True,
        window_left=left,
        window_right=right,
        deterministic=_validation.static_bool("deterministic", deterministic),
        dropout_rate=rate,
        allow_tf32=_validation.allow_tf32(float32_precision),
    )
    masks = _validation.mask_operands(q, k, alibi_slopes=alibi_slopes, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    dense = _validation.dense_operands(q, k, bias=bias, mask=mask, dropout_rate=rate, dropout_rng=dropout_rng)
    o, lse = run(q, k, v, masks, config, implementation, dense)
    if _validation.static_bool("return_lse", return_lse):
        return o, lse.astype(jnp.float32)
    return o
