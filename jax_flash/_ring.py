"""Attention over a sharded sequence axis, on one device's shards inside a collective context (``shard_map`` or a
custom-partitioning lowering): ring attention when keys/values are sharded, per-shard diagonals when only the
queries are.

Forward: each step runs the kernels on the key/value block at hand (the plan of ``_block_plan``) while the block
moves on to the next device with ``ppermute``; partial results merge exactly through their log-sum-exp.
Backward: the kernels' own backward, fed the *global* ``o`` and ``lse``, gives each block's exact share of the
gradients (``P = exp(s - lse)`` is then the global probability); dQ accumulates locally while dK/dV accumulators
travel with their block and one final hop brings them home. Accumulators are float32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flash import _ffi_calls
from jax_flash._block_plan import BlockCall, BlockPlan, RingSchedule, position_mask, ring_schedule
from jax_flash._config import MaskOperands, ScoreConfig
from jax_flash.sequence_layout import SequenceLayout

AxisName = Hashable | tuple[Hashable, ...]


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """Everything static about a sharded-sequence call (hashable).

    Attributes:
      config: the global score config (diagonal relative to the global sequences).
      q_layout: how the query sequence is split over the mesh axis.
      kv_layout: the same for keys/values; ``num_shards == 1`` means replicated (no ring).
      schedule: the block plans.
    """

    config: ScoreConfig
    q_layout: SequenceLayout
    kv_layout: SequenceLayout
    schedule: RingSchedule


def ring_spec(config: ScoreConfig, q_layout: SequenceLayout, kv_layout: SequenceLayout, *, has_alibi: bool,
              has_seqlens: bool) -> RingSpec | None:
    """The spec, or ``None`` when the diagonal depends on per-sequence lengths (see ``position_mask``)."""
    mask = position_mask(config, seqlen_q=q_layout.seqlen, seqlen_k=kv_layout.seqlen, has_alibi=has_alibi,
                         has_seqlens=has_seqlens)
    if mask is None:
        return None
    return RingSpec(config, q_layout, kv_layout, ring_schedule(q_layout, kv_layout, mask))


class _BlockMasks(NamedTuple):
    """Mask operands of one block. Counts are valid rows/columns per local chunk (``[B, chunks]``, or ``[B, 0]``
    when absent): a chunk-ordered prefix, so a call over consecutive chunks sums them."""

    alibi_slopes: jax.Array
    q_counts: jax.Array
    kv_counts: jax.Array
    q_segment_ids: jax.Array
    kv_segment_ids: jax.Array


def _chunk_counts(seqlens: jax.Array, layout: SequenceLayout, shard: jax.Array | int) -> jax.Array:
    """Valid elements of each local chunk of ``shard`` given global lengths ``seqlens`` ``[B, 1]``."""
    if not seqlens.shape[-1]:
        return seqlens
    starts = jnp.asarray(layout.start_table())[shard]
    return jnp.clip(seqlens - starts[None, :], 0, layout.chunk_len)


def _rows(slots: tuple[int, ...], chunk_len: int) -> slice:
    return slice(slots[0] * chunk_len, (slots[-1] + 1) * chunk_len)


def _call_masks(masks: _BlockMasks, call: BlockCall, q_rows: slice, kv_rows: slice) -> MaskOperands:
    def count(counts: jax.Array, slots: tuple[int, ...]) -> jax.Array:
        if not counts.shape[-1]:
            return counts
        return jnp.sum(counts[:, slots[0]:slots[-1] + 1], axis=1, keepdims=True)

    def rows(segment_ids: jax.Array, selected: slice) -> jax.Array:
        return segment_ids[:, selected] if segment_ids.shape[-1] else segment_ids

    return MaskOperands(masks.alibi_slopes, count(masks.q_counts, call.q_slots),
                        count(masks.kv_counts, call.kv_slots), rows(masks.q_segment_ids, q_rows),
                        rows(masks.kv_segment_ids, kv_rows))


def _call_config(config: ScoreConfig, call: BlockCall) -> ScoreConfig:
    return dataclasses.replace(config, causal=call.causal, align_to_sequence_end=False,
                               diagonal_offset=call.diagonal_offset, window_left=call.window_left,
                               window_right=call.window_right)


def _row_weights(weights: jax.Array) -> jax.Array:
    """``[B, H, S]`` -> ``[B, S, H, 1]``, to scale outputs."""
    return jnp.swapaxes(weights, 1, 2)[..., None]


def _merge(o_acc: jax.Array, lse_acc: jax.Array, o_new: jax.Array,
           lse_new: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact softmax merge of two partial results over disjoint key sets; rows empty in both stay (0, -inf)."""
    lse = jnp.logaddexp(lse_acc, lse_new)
    reference = jnp.where(jnp.isneginf(lse), 0.0, lse)  # keeps exp(-inf - reference) = 0, never NaN
    o = (o_acc * _row_weights(jnp.exp(lse_acc - reference))
         + o_new.astype(jnp.float32) * _row_weights(jnp.exp(lse_new - reference)))
    return o, lse


def _block_forward(plan: BlockPlan, spec: RingSpec, q: jax.Array, k: jax.Array, v: jax.Array,
                   masks: _BlockMasks, o_acc: jax.Array, lse_acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    for call in plan:
        q_rows = _rows(call.q_slots, spec.q_layout.chunk_len)
        kv_rows = _rows(call.kv_slots, spec.kv_layout.chunk_len)
        o_call, lse_call = _ffi_calls.forward(q[:, q_rows], k[:, kv_rows], v[:, kv_rows],
                                              _call_masks(masks, call, q_rows, kv_rows),
                                              _call_config(spec.config, call))
        o_rows, lse_rows = _merge(o_acc[:, q_rows], lse_acc[:, :, q_rows], o_call, lse_call)
        o_acc = o_acc.at[:, q_rows].set(o_rows)
        lse_acc = lse_acc.at[:, :, q_rows].set(lse_rows)
    return o_acc, lse_acc


def _block_backward(plan: BlockPlan, spec: RingSpec, q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array,
                    lse: jax.Array, d_o: jax.Array, d_lse: jax.Array, masks: _BlockMasks,
                    dq_acc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adds the block's dQ to ``dq_acc``; returns it with the block's own float32 dK, dV."""
    dk = jnp.zeros_like(k, jnp.float32)
    dv = jnp.zeros_like(v, jnp.float32)
    for call in plan:
        q_rows = _rows(call.q_slots, spec.q_layout.chunk_len)
        kv_rows = _rows(call.kv_slots, spec.kv_layout.chunk_len)
        dq_call, dk_call, dv_call = _ffi_calls.backward(
            q[:, q_rows], k[:, kv_rows], v[:, kv_rows], o[:, q_rows], lse[:, :, q_rows], d_o[:, q_rows],
            d_lse[:, :, q_rows], _call_masks(masks, call, q_rows, kv_rows), _call_config(spec.config, call))
        dq_acc = dq_acc.at[:, q_rows].add(dq_call.astype(jnp.float32))
        dk = dk.at[:, kv_rows].add(dk_call.astype(jnp.float32))
        dv = dv.at[:, kv_rows].add(dv_call.astype(jnp.float32))
    return dq_acc, dk, dv


def _run_plan(schedule: RingSchedule, step: jax.Array | int, shard: jax.Array | int,
              branch: Callable[[BlockPlan], Callable[..., tuple[jax.Array, ...]]], *operands: object):
    """Runs the plan of (step, shard): directly when known at trace time, else through ``lax.switch``."""
    if len(schedule.plans) == 1:
        return branch(schedule.plans[0])(*operands)
    if isinstance(step, int) and isinstance(shard, int):
        return branch(schedule.plans[schedule.table[step][shard]])(*operands)
    index = jnp.asarray(np.asarray(schedule.table, np.int32))[step, shard]
    return lax.switch(index, [branch(plan) for plan in schedule.plans], *operands)


def _shard_index(layout: SequenceLayout, axis_name: AxisName) -> jax.Array | int:
    return lax.axis_index(axis_name) if layout.num_shards > 1 else 0


def _forward_step(spec: RingSpec, q: jax.Array, masks: MaskOperands, shard: jax.Array | int,
                  q_counts: jax.Array, step: jax.Array | int, block: Sequence[jax.Array],
                  acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    k, v, *segments = block
    source = (shard - step) % spec.kv_layout.num_shards
    block_masks = _BlockMasks(masks.alibi_slopes, q_counts, _chunk_counts(masks.kv_seqlens, spec.kv_layout, source),
                              masks.q_segment_ids, segments[0] if segments else masks.kv_segment_ids)
    branch = lambda plan: functools.partial(_block_forward, plan, spec)
    return _run_plan(spec.schedule, step, shard, branch, q, k, v, block_masks, *acc)


def _ring_permutation(num_shards: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % num_shards) for i in range(num_shards)]


def ring_forward(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, spec: RingSpec,
                 axis_name: AxisName) -> tuple[jax.Array, jax.Array]:
    """Local shards in, local shards out: ``(o [B, Sq_local, Hq, D], lse [B, Hq, Sq_local] float32)``.

    Args:
      q: this device's query chunks ``[B, Sq_local, Hq, D]`` (``spec.q_layout``).
      k: this device's key chunks ``[B, Sk_local, Hkv, D]`` (``spec.kv_layout``; the whole sequence when it
        has one shard).
      v: like ``k``.
      masks: ALiBi slopes; global ``q_seqlens``/``kv_seqlens``; this device's segment ids.
      spec: static description (``ring_spec``).
      axis_name: the mesh axis (or axes) the sequence is sharded over.
    """
    shard = _shard_index(spec.q_layout, axis_name)
    q_counts = _chunk_counts(masks.q_seqlens, spec.q_layout, shard)
    step_fn = functools.partial(_forward_step, spec, q, masks, shard, q_counts)
    # zeros_like/full_like keep q's shard_map typing (varying over its mesh axes), so loop carries type-check.
    acc = (jnp.zeros_like(q, jnp.float32), jnp.swapaxes(jnp.full_like(q[..., 0], -jnp.inf, jnp.float32), 1, 2))
    block = (k, v) + ((masks.kv_segment_ids,) if masks.kv_segment_ids.shape[-1] else ())
    steps = spec.schedule.steps
    if steps > 1:
        permutation = _ring_permutation(steps)

        def body(step, carry):
            acc, block = carry
            # Sent before the compute that does not depend on it, so the transfer can overlap the kernels.
            next_block = lax.ppermute(block, axis_name, permutation)
            return step_fn(step, block, acc), next_block

        acc, block = lax.fori_loop(0, steps - 1, body, (acc, block))
    o, lse = step_fn(steps - 1, block, acc)
    return o.astype(q.dtype), lse


def _backward_step(spec: RingSpec, q: jax.Array, o: jax.Array, lse: jax.Array, d_o: jax.Array, d_lse: jax.Array,
                   masks: MaskOperands, shard: jax.Array | int, q_counts: jax.Array, step: jax.Array | int,
                   block: Sequence[jax.Array], dq_acc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    k, v, *segments = block
    source = (shard - step) % spec.kv_layout.num_shards
    block_masks = _BlockMasks(masks.alibi_slopes, q_counts, _chunk_counts(masks.kv_seqlens, spec.kv_layout, source),
                              masks.q_segment_ids, segments[0] if segments else masks.kv_segment_ids)
    branch = lambda plan: functools.partial(_block_backward, plan, spec)
    return _run_plan(spec.schedule, step, shard, branch, q, k, v, o, lse, d_o, d_lse, block_masks, dq_acc)


def ring_backward(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, d_o: jax.Array,
                  d_lse: jax.Array, masks: MaskOperands, spec: RingSpec,
                  axis_name: AxisName) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``ring_forward`` given the cotangents of its two outputs; local shards like the inputs.

    With keys/values replicated (one kv shard) and queries sharded, every device holds part of dK/dV: they are
    summed over ``axis_name``.
    """
    shard = _shard_index(spec.q_layout, axis_name)
    q_counts = _chunk_counts(masks.q_seqlens, spec.q_layout, shard)
    step_fn = functools.partial(_backward_step, spec, q, o, lse, d_o, d_lse, masks, shard, q_counts)
    dq = jnp.zeros_like(q, jnp.float32)
    block = (k, v) + ((masks.kv_segment_ids,) if masks.kv_segment_ids.shape[-1] else ())
    steps = spec.schedule.steps
    if steps == 1:
        dq, dk, dv = step_fn(0, block, dq)
        if spec.q_layout.num_shards > 1:
            dk, dv = lax.psum((dk, dv), axis_name)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    permutation = _ring_permutation(steps)

    def body(step, carry):
        dq, block, dk, dv = carry
        next_block = lax.ppermute(block, axis_name, permutation)
        dq, dk_block, dv_block = step_fn(step, block, dq)
        # The accumulators belong to the block just used: they follow it to the next device.
        dk, dv = lax.ppermute((dk + dk_block, dv + dv_block), axis_name, permutation)
        return dq, next_block, dk, dv

    carry = (dq, block, jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))
    dq, block, dk, dv = lax.fori_loop(0, steps - 1, body, carry)
    dq, dk_block, dv_block = step_fn(steps - 1, block, dq)
    # After the last step each device holds the next device's block: one more hop brings dK/dV home.
    dk, dv = lax.ppermute((dk + dk_block, dv + dv_block), axis_name, permutation)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
