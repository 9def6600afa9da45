"""Attention over a sharded sequence axis, on one device's shards inside a collective context (``shard_map`` or a
custom-partitioning lowering): ring attention when keys/values are sharded, per-shard diagonals when only the
queries are.

Forward: each step runs the kernels on the key/value block at hand (the plan of ``_block_plan``) while the block
moves on to the next device with ``ppermute``; partial results merge exactly through their log-sum-exp.
Backward: the kernels' own backward, fed the *global* ``o`` and ``lse``, gives each block's exact share of the
gradients (``P = exp(s - lse)`` is then the global probability); dQ accumulates locally while dK/dV accumulators
travel with their block and one final hop brings them home. Accumulators are float32.

A bias or boolean mask keeps its whole key axis on every device (its query axis is sharded like the queries, so
the key axis cannot also follow the travelling key/value shard over the same mesh axes): each step cuts out the
columns of the block at hand, and dbias accumulates locally in the same columns. Dropout is never sharded over a
sequence (its bits depend on global positions, see ``jax_flash.sharding``).
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
from jax_flash import sequence_layout
from jax_flash._config import DenseOperands, MaskOperands, ScoreConfig
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
        return _take(segment_ids, {1: selected}) if segment_ids.shape[-1] else segment_ids

    return MaskOperands(masks.alibi_slopes, count(masks.q_counts, call.q_slots),
                        count(masks.kv_counts, call.kv_slots), rows(masks.q_segment_ids, q_rows),
                        rows(masks.kv_segment_ids, kv_rows))


# Sub-blocks are read with lax.slice and written with lax.dynamic_update_slice at static offsets, never with
# `x.at[...]`: a scatter over whole-axis slices carries an empty int32 index constant, which jax hoists into a
# zero-size operand of the enclosing shard_map, and XLA's GPU Shardy partitioner (jax 0.11.2) segfaults on it.
def _take(x: jax.Array, windows: dict[int, slice]) -> jax.Array:
    """``x`` restricted to ``windows`` (axis -> static slice)."""
    for axis, rows in windows.items():
        x = lax.slice_in_dim(x, rows.start, rows.stop, axis=axis)
    return x


def _put_into(x: jax.Array, windows: dict[int, slice], value: jax.Array) -> jax.Array:
    """``x`` with its ``windows`` sub-block replaced by ``value``."""
    value = value.astype(x.dtype)
    if all(rows.start == 0 and rows.stop == x.shape[axis] for axis, rows in windows.items()):
        return value
    return lax.dynamic_update_slice(x, value, [windows[axis].start if axis in windows else 0 for axis in range(x.ndim)])


def _add_into(x: jax.Array, windows: dict[int, slice], value: jax.Array) -> jax.Array:
    """``x`` with ``value`` added to its ``windows`` sub-block."""
    return _put_into(x, windows, _take(x, windows) + value)


def _call_dense(dense: DenseOperands, q_rows: slice, kv_rows: slice) -> DenseOperands:
    """The call's rows and columns of a block's bias and mask (broadcast axes and absent operands as they are)."""
    def cut(x: jax.Array) -> jax.Array:
        return _take(x, _dense_windows(x.shape, q_rows, kv_rows)) if x.shape[-1] else x

    return dense._replace(bias=cut(dense.bias), mask=cut(dense.mask))


def _dense_windows(shape: tuple[int, ...], q_rows: slice, kv_rows: slice) -> dict[int, slice]:
    """The query-row and key-column windows of a ``[B|1, H|1, Sq|1, Sk|1]`` operand (none on broadcast axes)."""
    windows = {}
    if shape[2] != 1:
        windows[2] = q_rows
    if shape[3] != 1:
        windows[3] = kv_rows
    return windows


def _key_width(spec: RingSpec) -> int:
    return spec.kv_layout.seqlen // spec.kv_layout.num_shards


def _has_key_axis(x: jax.Array, spec: RingSpec) -> bool:
    """Whether a bias/mask (or its gradient) has a whole key axis to cut into key/value shards."""
    return spec.kv_layout.num_shards > 1 and x.shape[-1] > 1


def _keys_in_layout(dense: DenseOperands, spec: RingSpec, inverse: bool = False) -> DenseOperands:
    """Orders the bias/mask key axis like the key/value shards (zigzag), so shard ``r`` owns columns
    ``[r * width, (r + 1) * width)``."""
    if spec.kv_layout.name != "zigzag":
        return dense
    move = sequence_layout.from_zigzag if inverse else sequence_layout.to_zigzag
    order = lambda x: move(x, spec.kv_layout.num_shards, axis=3) if _has_key_axis(x, spec) else x
    return dense._replace(bias=order(dense.bias), mask=order(dense.mask))


def _source_columns(dense: DenseOperands, spec: RingSpec, source: jax.Array | int) -> DenseOperands:
    """The bias/mask columns of key/value shard ``source``."""
    width = _key_width(spec)
    cut = lambda x: lax.dynamic_slice_in_dim(x, source * width, width, axis=3) if _has_key_axis(x, spec) else x
    return dense._replace(bias=cut(dense.bias), mask=cut(dense.mask))


def _add_source_columns(dbias: jax.Array, block: jax.Array, spec: RingSpec, source: jax.Array | int) -> jax.Array:
    if not _has_key_axis(dbias, spec):
        return dbias + block
    width = _key_width(spec)
    columns = lax.dynamic_slice_in_dim(dbias, source * width, width, axis=3)
    return lax.dynamic_update_slice_in_dim(dbias, columns + block, source * width, axis=3)


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
                   masks: _BlockMasks, dense: DenseOperands, o_acc: jax.Array,
                   lse_acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    for call in plan:
        q_rows = _rows(call.q_slots, spec.q_layout.chunk_len)
        kv_rows = _rows(call.kv_slots, spec.kv_layout.chunk_len)
        rows, lse_rows, cols = {1: q_rows}, {2: q_rows}, {1: kv_rows}
        o_call, lse_call = _ffi_calls.forward(_take(q, rows), _take(k, cols), _take(v, cols),
                                              _call_masks(masks, call, q_rows, kv_rows),
                                              _call_config(spec.config, call),
                                              _call_dense(dense, q_rows, kv_rows))
        o_new, lse_new = _merge(_take(o_acc, rows), _take(lse_acc, lse_rows), o_call, lse_call)
        o_acc = _put_into(o_acc, rows, o_new)
        lse_acc = _put_into(lse_acc, lse_rows, lse_new)
    return o_acc, lse_acc


def _block_backward(plan: BlockPlan, spec: RingSpec, want_dbias: bool, q: jax.Array, k: jax.Array, v: jax.Array,
                    o: jax.Array, lse: jax.Array, d_o: jax.Array, d_lse: jax.Array, masks: _BlockMasks,
                    dense: DenseOperands, dq_acc: jax.Array) -> tuple[jax.Array, ...]:
    """Adds the block's dQ to ``dq_acc``; returns it with the block's own float32 dK, dV (and dbias, shaped like
    the block's bias, when ``want_dbias``)."""
    dk = jnp.zeros_like(k, jnp.float32)
    dv = jnp.zeros_like(v, jnp.float32)
    dbias = jnp.zeros_like(dense.bias)
    for call in plan:
        q_rows = _rows(call.q_slots, spec.q_layout.chunk_len)
        kv_rows = _rows(call.kv_slots, spec.kv_layout.chunk_len)
        rows, lse_rows, cols = {1: q_rows}, {2: q_rows}, {1: kv_rows}
        grads = _ffi_calls.backward(
            _take(q, rows), _take(k, cols), _take(v, cols), _take(o, rows), _take(lse, lse_rows), _take(d_o, rows),
            _take(d_lse, lse_rows), _call_masks(masks, call, q_rows, kv_rows), _call_config(spec.config, call),
            _call_dense(dense, q_rows, kv_rows), want_dbias=want_dbias)
        dq_acc = _add_into(dq_acc, rows, grads[0].astype(jnp.float32))
        dk = _add_into(dk, cols, grads[1].astype(jnp.float32))
        dv = _add_into(dv, cols, grads[2].astype(jnp.float32))
        if want_dbias:
            dbias = _add_into(dbias, _dense_windows(dbias.shape, q_rows, kv_rows), grads[3])
    return (dq_acc, dk, dv, dbias) if want_dbias else (dq_acc, dk, dv)


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


def _forward_step(spec: RingSpec, q: jax.Array, masks: MaskOperands, dense: DenseOperands, shard: jax.Array | int,
                  q_counts: jax.Array, step: jax.Array | int, block: Sequence[jax.Array],
                  acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    k, v, *segments = block
    source = (shard - step) % spec.kv_layout.num_shards
    block_masks = _BlockMasks(masks.alibi_slopes, q_counts, _chunk_counts(masks.kv_seqlens, spec.kv_layout, source),
                              masks.q_segment_ids, segments[0] if segments else masks.kv_segment_ids)
    branch = lambda plan: functools.partial(_block_forward, plan, spec)
    return _run_plan(spec.schedule, step, shard, branch, q, k, v, block_masks,
                     _source_columns(dense, spec, source), *acc)


def _ring_permutation(num_shards: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % num_shards) for i in range(num_shards)]


def ring_forward(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, spec: RingSpec,
                 axis_name: AxisName, dense: DenseOperands | None = None) -> tuple[jax.Array, jax.Array]:
    """Local shards in, local shards out: ``(o [B, Sq_local, Hq, D], lse [B, Hq, Sq_local] float32)``.

    Args:
      q: this device's query chunks ``[B, Sq_local, Hq, D]`` (``spec.q_layout``).
      k: this device's key chunks ``[B, Sk_local, Hkv, D]`` (``spec.kv_layout``; the whole sequence when it
        has one shard).
      v: like ``k``.
      masks: ALiBi slopes; global ``q_seqlens``/``kv_seqlens``; this device's segment ids.
      spec: static description (``ring_spec``).
      axis_name: the mesh axis (or axes) the sequence is sharded over.
      dense: bias and mask with this device's query rows (in ``spec.q_layout``) and every key column (in natural
        order); no dropout.
    """
    dense = _keys_in_layout(DenseOperands.absent(q.shape[0]) if dense is None else dense, spec)
    shard = _shard_index(spec.q_layout, axis_name)
    q_counts = _chunk_counts(masks.q_seqlens, spec.q_layout, shard)
    step_fn = functools.partial(_forward_step, spec, q, masks, dense, shard, q_counts)
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
                   masks: MaskOperands, dense: DenseOperands, shard: jax.Array | int, q_counts: jax.Array,
                   step: jax.Array | int, block: Sequence[jax.Array], dq_acc: jax.Array,
                   dbias: jax.Array | None) -> tuple[jax.Array, ...]:
    """Returns ``(dq_acc, dk_block, dv_block, dbias)``, the block's dbias columns added to ``dbias`` (the whole
    key axis) when given."""
    k, v, *segments = block
    source = (shard - step) % spec.kv_layout.num_shards
    block_masks = _BlockMasks(masks.alibi_slopes, q_counts, _chunk_counts(masks.kv_seqlens, spec.kv_layout, source),
                              masks.q_segment_ids, segments[0] if segments else masks.kv_segment_ids)
    branch = lambda plan: functools.partial(_block_backward, plan, spec, dbias is not None)
    grads = _run_plan(spec.schedule, step, shard, branch, q, k, v, o, lse, d_o, d_lse, block_masks,
                      _source_columns(dense, spec, source), dq_acc)
    if dbias is not None:
        dbias = _add_source_columns(dbias, grads[3], spec, source)
    return (*grads[:3], dbias)


def ring_backward(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, d_o: jax.Array,
                  d_lse: jax.Array, masks: MaskOperands, spec: RingSpec, axis_name: AxisName,
                  dense: DenseOperands | None = None, want_dbias: bool = False) -> tuple[jax.Array, ...]:
    """Gradients of ``ring_forward`` given the cotangents of its two outputs; local shards like the inputs, and
    this device's float32 dbias (like ``dense.bias``) after them when ``want_dbias``.

    With keys/values replicated (one kv shard) and queries sharded, every device holds part of dK/dV: they are
    summed over ``axis_name``. dbias is this device's queries' share: the caller sums a query-broadcast one.
    """
    dense = _keys_in_layout(DenseOperands.absent(q.shape[0]) if dense is None else dense, spec)
    shard = _shard_index(spec.q_layout, axis_name)
    q_counts = _chunk_counts(masks.q_seqlens, spec.q_layout, shard)
    step_fn = functools.partial(_backward_step, spec, q, o, lse, d_o, d_lse, masks, dense, shard, q_counts)
    dq = jnp.zeros_like(q, jnp.float32)
    dbias = jnp.zeros_like(dense.bias) if want_dbias else None
    block = (k, v) + ((masks.kv_segment_ids,) if masks.kv_segment_ids.shape[-1] else ())
    steps = spec.schedule.steps
    if steps == 1:
        dq, dk, dv, dbias = step_fn(0, block, dq, dbias)
        if spec.q_layout.num_shards > 1:
            dk, dv = lax.psum((dk, dv), axis_name)
    else:
        permutation = _ring_permutation(steps)

        def body(step, carry):
            dq, block, dk, dv, dbias = carry
            next_block = lax.ppermute(block, axis_name, permutation)
            dq, dk_block, dv_block, dbias = step_fn(step, block, dq, dbias)
            # The accumulators belong to the block just used: they follow it to the next device.
            dk, dv = lax.ppermute((dk + dk_block, dv + dv_block), axis_name, permutation)
            return dq, next_block, dk, dv, dbias

        carry = (dq, block, jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32), dbias)
        dq, block, dk, dv, dbias = lax.fori_loop(0, steps - 1, body, carry)
        dq, dk_block, dv_block, dbias = step_fn(steps - 1, block, dq, dbias)
        # After the last step each device holds the next device's block: one more hop brings dK/dV home.
        dk, dv = lax.ppermute((dk + dk_block, dv + dv_block), axis_name, permutation)
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    if not want_dbias:
        return grads
    return (*grads, _keys_in_layout(DenseOperands(dbias, dense.mask, dense.dropout_seeds), spec, inverse=True).bias)
