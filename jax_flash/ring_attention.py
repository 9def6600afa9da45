"""``jax_flash.ring_attention``: context-parallel attention for code that already runs per device
(``jax.shard_map``), with the sequence sharded over a named mesh axis."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _ring, _validation
from jax_flash._config import MaskOperands, ScoreConfig
from jax_flash.sequence_layout import LAYOUTS, LayoutName, SequenceLayout


@dataclasses.dataclass(frozen=True)
class _RingCall:
    config: ScoreConfig
    layout: LayoutName
    axis_name: _ring.AxisName


def _spec(call: _RingCall, q: jax.Array, k: jax.Array, masks: MaskOperands) -> _ring.RingSpec:
    num_shards = lax.axis_size(call.axis_name)
    q_layout = SequenceLayout(call.layout, num_shards, q.shape[1] * num_shards)
    kv_layout = SequenceLayout(call.layout, num_shards, k.shape[1] * num_shards)
    spec = _ring.ring_spec(call.config, q_layout, kv_layout, has_alibi=bool(masks.alibi_slopes.shape[-1]),
                           has_seqlens=bool(masks.q_seqlens.shape[-1] or masks.kv_seqlens.shape[-1]))
    if spec is None:
        raise NotImplementedError(
            "ring_attention cannot combine q_seqlens/kv_seqlens with causal, window or ALiBi masks: with "
            "bottom-right alignment each sequence's diagonal moves with its own lengths, which a shard of the "
            "sequence cannot express. Mark padding with q_segment_ids/kv_segment_ids instead.")
    return spec


# Absent mask operands (zero-size arrays) never cross the custom_vjp boundary: as residuals they would become
# zero-size operands of the backward shard_map, on which XLA's GPU Shardy partitioner (jax 0.11.2) segfaults.
# They are passed as None and rebuilt where needed.
_MASK_DTYPES = MaskOperands(jnp.float32, jnp.int32, jnp.int32, jnp.int32, jnp.int32)


def _present(masks: MaskOperands) -> MaskOperands:
    return MaskOperands._make(x if x.size else None for x in masks)


def _complete(masks: MaskOperands, batch: int) -> MaskOperands:
    return MaskOperands(*(jnp.zeros((batch, 0), dtype) if x is None else x for x, dtype in zip(masks, _MASK_DTYPES)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring_flash(q: jax.Array, k: jax.Array, v: jax.Array, present: MaskOperands,
                call: _RingCall) -> tuple[jax.Array, jax.Array]:
    return _ring_flash_forward(q, k, v, present, call)[0]


def _ring_flash_forward(q, k, v, present, call):
    masks = _complete(present, q.shape[0])
    o, lse = _ring.ring_forward(q, k, v, masks, _spec(call, q, k, masks), call.axis_name)
    return (o, lse), (q, k, v, present, o, lse)


def _ring_flash_backward(call, residuals, cotangents):
    q, k, v, present, o, lse = residuals
    masks = _complete(present, q.shape[0])
    d_o, d_lse = cotangents
    dq, dk, dv = _ring.ring_backward(q, k, v, o, lse, d_o, d_lse, masks, _spec(call, q, k, masks), call.axis_name)
    return dq, dk, dv, jax.tree_util.tree_map(lambda _: None, present)


_ring_flash.defvjp(_ring_flash_forward, _ring_flash_backward)


@overload
def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: _ring.AxisName,
    layout: LayoutName = "contiguous",
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: jax.Array | None = None,
    q_seqlens: jax.Array | None = None,
    kv_seqlens: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    deterministic: bool = False,
    return_lse: Literal[False] = False,
) -> jax.Array: ...


@overload
def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: _ring.AxisName,
    layout: LayoutName = "contiguous",
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: jax.Array | None = None,
    q_seqlens: jax.Array | None = None,
    kv_seqlens: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    deterministic: bool = False,
    return_lse: Literal[True],
) -> tuple[jax.Array, jax.Array]: ...


@overload
def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: _ring.AxisName,
    layout: LayoutName = "contiguous",
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: jax.Array | None = None,
    q_seqlens: jax.Array | None = None,
    kv_seqlens: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]: ...


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: _ring.AxisName,
    layout: LayoutName = "contiguous",
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: jax.Array | None = None,
    q_seqlens: jax.Array | None = None,
    kv_seqlens: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``jax_flash.attention`` over a sequence sharded along the mesh axis ``axis_name``: ring attention.

    Call it inside ``jax.shard_map`` (or any context where ``axis_name`` is bound) with this device's shards.
    Key/value blocks travel around the ring with ``ppermute`` while each device runs the kernels on the block
    it holds; partial results merge exactly through their log-sum-exp. The backward pass is the kernels' own
    backward with the global ``lse``, dK/dV travelling back around the ring. Masks mean exactly what they mean
    in ``jax_flash.attention`` on the global (unsharded) sequences, including the bottom-right alignment.
    Blocks the causal/window mask hides entirely are skipped. With ``causal=True`` use ``layout="zigzag"``
    (and :func:`jax_flash.to_zigzag` on the global inputs) so every device has the same work in every step.

    Args:
      q: this device's queries ``[batch, seqlen_q / n, heads_q, head_dim]``, ``n`` the size of ``axis_name``.
      k: this device's keys ``[batch, seqlen_k / n, heads_kv, head_dim]``, in the same layout.
      v: like ``k``.
      axis_name: mesh axis name (or tuple of names) the sequence axis is sharded over.
      layout: ``"contiguous"`` (device ``r`` holds the ``r``-th slice of the sequence, as ``NamedSharding``
        shards it) or ``"zigzag"`` (see ``jax_flash.sequence_layout``).
      causal: see ``jax_flash.attention``.
      softmax_scale: see ``jax_flash.attention``.
      window_size: see ``jax_flash.attention``.
      softcap: see ``jax_flash.attention``.
      alibi_slopes: ``[heads_q]`` or ``[batch, heads_q]`` for this device's heads.
      q_seqlens: ``[batch]`` global valid query lengths (not per shard); not combinable with causal, window or
        ALiBi masks here (raises), use segment ids for padding.
      kv_seqlens: ``[batch]`` global valid key lengths; same restriction.
      q_segment_ids: this device's ``[batch, seqlen_q / n]`` segment ids, in the layout of ``q``.
      kv_segment_ids: this device's ``[batch, seqlen_k / n]`` segment ids, in the layout of ``k``.
      deterministic: bit-reproducible backward (the ring's summation order is fixed anyway).
      return_lse: also return this device's ``[batch, heads_q, seqlen_q / n]`` float32 log-sum-exp.

    Returns:
      This device's output ``[batch, seqlen_q / n, heads_q, head_dim]`` (and lse when ``return_lse``).

    Example::

      mesh = jax.make_mesh((4,), ("seq",))
      attend = jax.shard_map(
          functools.partial(jax_flash.ring_attention, axis_name="seq", layout="zigzag", causal=True),
          mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
      o = jax_flash.from_zigzag(attend(*(jax_flash.to_zigzag(x, 4) for x in (q, k, v))), 4)
    """
    _validation.check_qkv(q, k, v)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    left, right = _validation.window("window_size", window_size)
    config = ScoreConfig(
        softmax_scale=(1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None
                       else _validation.static_float("softmax_scale", softmax_scale)),
        softcap=_validation.static_float("softcap", softcap, minimum=0.0),
        causal=_validation.static_bool("causal", causal),
        align_to_sequence_end=True,
        window_left=left,
        window_right=right,
        deterministic=_validation.static_bool("deterministic", deterministic),
    )
    masks = _validation.mask_operands(q, k, alibi_slopes=alibi_slopes, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    o, lse = _ring_flash(q, k, v, _present(masks), _RingCall(config, layout, axis_name))
    if _validation.static_bool("return_lse", return_lse):
        return o, lse
    return o
