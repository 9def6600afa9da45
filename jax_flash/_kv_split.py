"""Split-KV forward for few query rows against many keys (decoding): the keys are cut into ``n`` equal chunks,
each chunk becomes a batch row of one forward call, and the chunks' partial outputs are merged by their lse.

Why: a forward tile covers up to 128 query rows of one (batch, KV head) and streams every key it sees. A decoding
call (``seqlen_q`` 1, even with GQA packing) has only ``batch * heads`` tiles, often fewer than the GPU has SMs
(132 on the H200), and each tile reads a long K/V alone. Split, ``n`` tiles share that work.

How: ``k [B, Sk, H, D]`` reshapes (no copy) to ``[B * n, Sk / n, H, D]``; ``q`` and the per-row operands repeat
``n`` times (a few rows), ``kv_segment_ids`` reshape with the keys. The call carries ``n`` as ``kv_chunks``
(``ScoreConfig``; ``make_slice_mask`` in csrc/common/score_pipeline.h): batch row ``b * n + i`` holds keys from
``i * Sk / n`` on, and its ``kv_seqlens`` are the sequence's length less that first key, not cut to the chunk, so
that the causal diagonal stays aligned to the sequence's end and causal masks, windows and ALiBi read
whole-sequence key positions (the kernels cut the length to the chunk for the bounds). Chunk ``i``
returns ``o_i`` and ``lse_i``; the call's result is ``lse = log(sum_i exp(lse_i))`` and
``o = sum_i exp(lse_i - lse) o_i`` (float32 sums; a row no chunk lets see a key keeps ``o = 0``, ``lse = -inf``).

Where: calls without bias, boolean mask or dropout, with at most one row tile of queries per (batch, head)
(``seqlen_q <= 128`` after packing: the decoding shapes it was measured on), where the unsplit call has fewer tiles
than ``_TARGET_TILES`` and ``seqlen_k`` has a divisor that leaves chunks of at least ``_MIN_CHUNK`` keys. The backward
is not split: it gets the merged ``o`` and ``lse``.

``JAX_FLASH_SPLIT_KV`` (read when the forward is traced): unset or empty chooses as above, ``0`` never splits, an
integer ``n > 1`` splits into exactly ``n`` chunks wherever the call qualifies and ``n`` divides ``seqlen_k``
(whatever the tile count and chunk length: for tests and measurements).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_flash._config import TILE_ROWS, DenseOperands, MaskOperands, ScoreConfig
from jax_flash._gqa_packing import has_dense_operands

SPLIT_KV_ENV = "JAX_FLASH_SPLIT_KV"

# Tiles the split call aims for: two per SM of the H200 (132 SMs), so that no SM idles at the end of the call.
_TARGET_TILES = 264
# Fewest keys per chunk: below this a tile's fixed costs (loading Q, the epilogue) outweigh its key loop.
_MIN_CHUNK = 256

ForwardCall = Callable[[jax.Array, jax.Array, jax.Array, MaskOperands, ScoreConfig, DenseOperands],
                       tuple[jax.Array, jax.Array]]


def _forced_splits() -> int | None:
    """``JAX_FLASH_SPLIT_KV``: None for automatic, 0 for never, else the number of chunks."""
    value = os.environ.get(SPLIT_KV_ENV, "")
    if value == "":
        return None
    if not value.isdigit() or int(value) == 1:
        raise ValueError(f"{SPLIT_KV_ENV} must be empty, 0 or an integer > 1, not {value!r}")
    return int(value)


def _unsharded(x: jax.Array) -> bool:
    """False where ``x`` carries explicit sharding on any axis (the split reshapes the batch and sequence axes)."""
    return all(axis is None for axis in jax.typeof(x).sharding.spec)


def _qualifies(q: jax.Array, k: jax.Array, masks: MaskOperands, config: ScoreConfig, dense: DenseOperands) -> bool:
    if has_dense_operands(q, k, masks, config, dense):
        return False
    return q.shape[1] > 0 and k.shape[1] > 0 and _unsharded(q) and _unsharded(k)


def splits_for(q: jax.Array, k: jax.Array, masks: MaskOperands, config: ScoreConfig,
               dense: DenseOperands) -> int:
    """The number of key chunks the forward call runs as, or 1 where it runs whole."""
    forced = _forced_splits()
    if forced == 0 or not _qualifies(q, k, masks, config, dense):
        return 1
    seqlen_k = k.shape[1]
    if forced is not None:
        return forced if seqlen_k % forced == 0 else 1
    batch, seqlen_q, heads = q.shape[:3]
    if seqlen_q > TILE_ROWS:
        return 1  # measured for decoding shapes only (one row tile per slice); prefill keeps its own tiles
    tiles = batch * heads
    if tiles == 0:
        return 1
    wanted = min(-(-_TARGET_TILES // tiles), seqlen_k // _MIN_CHUNK)
    # The largest divisor of seqlen_k up to `wanted` (chunks reshape without a copy only when they are equal).
    return next(n for n in range(max(wanted, 1), 0, -1) if seqlen_k % n == 0)


def _chunked(x: jax.Array, splits: int) -> jax.Array:
    """``[B, Sk, ...]`` -> ``[B * n, Sk / n, ...]``: chunk ``i`` of batch row ``b`` is row ``b * n + i``."""
    return x.reshape(x.shape[0] * splits, x.shape[1] // splits, *x.shape[2:])


def _repeated(x: jax.Array, splits: int) -> jax.Array:
    return jnp.repeat(x, splits, axis=0)


def _chunked_key_mask(mask: jax.Array, batch: int, seqlen_k: int, splits: int) -> jax.Array:
    """A key-only mask ``[B|1, 1, 1, Sk|1]`` -> ``[B * n, 1, 1, Sk / n]``, chunked like K."""
    mask = jnp.broadcast_to(mask, (batch, 1, 1, seqlen_k))
    return _chunked(mask.reshape(batch, seqlen_k), splits)[:, None, None, :]


def split_forward(call: ForwardCall, q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands,
                  config: ScoreConfig, dense: DenseOperands, splits: int) -> tuple[jax.Array, jax.Array]:
    """Runs ``call`` (the unsplit forward: ``o [B, Sq, Hq, D]``, ``lse [B, Hq, Sq]``) over ``splits`` key chunks
    and merges them. Only for calls ``splits_for`` chose (of the dense operands only a key-only mask, which is
    chunked with the keys)."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    lengths = (jnp.clip(masks.kv_seqlens, 0, seqlen_k) if masks.kv_seqlens.shape[-1]
               else jnp.full((batch, 1), seqlen_k, jnp.int32))
    starts = jnp.arange(splits, dtype=jnp.int32) * (seqlen_k // splits)
    kv_seqlens = (lengths - starts[None, :]).reshape(batch * splits, 1)
    kv_segment_ids = masks.kv_segment_ids
    kv_segment_ids = _chunked(kv_segment_ids, splits) if kv_segment_ids.shape[-1] else _repeated(kv_segment_ids,
                                                                                                 splits)
    chunk_masks = MaskOperands(alibi_slopes=_repeated(masks.alibi_slopes, splits),
                               q_seqlens=_repeated(masks.q_seqlens, splits),
                               kv_seqlens=kv_seqlens,
                               q_segment_ids=_repeated(masks.q_segment_ids, splits),
                               kv_segment_ids=kv_segment_ids)
    config = dataclasses.replace(config, kv_chunks=splits)
    chunk_dense = DenseOperands.absent(batch * splits)
    if dense.has_mask:
        chunk_dense = chunk_dense._replace(mask=_chunked_key_mask(dense.mask, batch, seqlen_k, splits))
    o, lse = call(_repeated(q, splits), _chunked(k, splits), _chunked(v, splits), chunk_masks, config, chunk_dense)
    o = o.reshape(batch, splits, seqlen_q, heads, head_dim)
    lse = lse.reshape(batch, splits, heads, seqlen_q)
    top = jnp.max(lse, axis=1, keepdims=True)
    top = jnp.where(jnp.isneginf(top), 0.0, top)  # rows no chunk sees: every weight stays exp(-inf) = 0
    weights = jnp.exp(lse - top)
    total = jnp.sum(weights, axis=1)
    merged_lse = jnp.where(total > 0, top[:, 0] + jnp.log(total), -jnp.inf)
    weights = weights / jnp.where(total > 0, total, 1.0)[:, None]
    weights = weights.transpose(0, 1, 3, 2)[..., None]  # [B, n, Sq, H, 1], like o
    merged_o = jnp.sum(weights * o.astype(jnp.float32), axis=1).astype(q.dtype)
    return merged_o, merged_lse
