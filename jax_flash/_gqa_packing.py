"""GQA packing for short query sequences: the ``G = heads_q / heads_kv`` query heads that share a KV head become
rows of one query sequence, so that the forward kernel sees ``[B, Sq * G, Hkv, D]`` queries against the same keys
(multi-query attention) and a query tile holds the rows of several heads.

Why: a kernel tile covers 128 query rows of one head (the Hopper forward; 64 on sm80). With ``Sq = 1`` (decoding)
and ``G = 8``, each tile has one row in use and the eight heads of a group each read the whole of K and V; packed,
one tile holds all eight rows and K/V are read once per group.

Row ``s * G + g`` of the packed call is position ``s`` of query head ``kv_head * G + g``. The per-row masks carry
over exactly: ``q_seqlens`` scale by ``G`` (row ``s * G + g`` is valid iff ``s < q_seqlens``), ``q_segment_ids``
repeat ``G`` times. The position masks (causal, window) read row ``r`` as position ``r // G``: the call carries
``G`` as ``packed_heads`` (``ScoreConfig``; ``SliceMask::position`` in csrc/common/score_pipeline.h, a shift, so
``G`` must be a power of two there), so causal and windowed calls pack too (speculative decoding, chunked prefill).
A causal call with ``Sq = 1`` (bottom-right aligned, no offset, no ``q_seqlens``), where the one query sees every
key, runs without its causal flag and so packs for any ``G``. Not packed: ALiBi (its slope is the row's head, its
distance the row's position), a bias, a boolean mask or dropout (per-head operands, and dropout's per-row random
stream). The backward is not packed: it gets ``o`` and ``lse`` in the usual layout.

``JAX_FLASH_PACK_GQA`` (read when the forward is traced): unset or ``1`` packs where it applies, ``0`` never.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_flash._config import TILE_ROWS, DenseOperands, MaskOperands, ScoreConfig, key_masks_stay_dense, switch_on

PACK_GQA_ENV = "JAX_FLASH_PACK_GQA"


def packing_requested() -> bool:
    return switch_on(PACK_GQA_ENV)


def _tiles(rows: int) -> int:
    """Query tiles of ``rows`` rows: packing pays where it fills fewer of them than the unpacked call."""
    return -(-rows // TILE_ROWS)


def _query_axes_replicated(q: jax.Array) -> bool:
    """False where ``q`` carries explicit sharding on its sequence or head axis (the packing reshapes both)."""
    spec = tuple(jax.typeof(q).sharding.spec)
    return all(axis is None for axis in spec[1:3])


def _causal_is_moot(q: jax.Array, masks: MaskOperands, config: ScoreConfig) -> bool:
    """A causal call whose single query row sees every key: ``diag(0) = kv_len - 1``."""
    return (q.shape[1] == 1 and config.align_to_sequence_end and config.diagonal_offset == 0
            and masks.q_seqlens.shape[-1] == 0)


def masks_read_positions(q: jax.Array, masks: MaskOperands, config: ScoreConfig) -> bool:
    """Whether a mask of the call reads a row's or a key's position (or, aligned to the sequence end, its length):
    a window, ALiBi, or causal where it is not moot. The key-mask conversion changes the kv lengths, which the
    position masks align to, so it does not apply then (packing and the split-KV forward carry the positions in
    ``ScoreConfig.packed_heads`` and ``kv_chunks``)."""
    return masks.alibi_slopes.shape[-1] != 0 or _reads_query_positions(q, masks, config)


def has_dense_operands(q: jax.Array, k: jax.Array, masks: MaskOperands, config: ScoreConfig,
                       dense: DenseOperands) -> bool:
    """A bias, a boolean mask or dropout: per-element operands that neither packing nor the split-KV forward
    rearranges; except, with ``JAX_FLASH_KEY_MASK_FORM=dense`` (``_config.key_masks_stay_dense``), a key-only mask
    that ``_key_masks`` converts (to kv lengths, keeping the mask): it reads no query position, so packed rows share
    it, and it splits along the keys like K."""
    if dense.has_bias or config.dropout_rate > 0:
        return True
    if not dense.has_mask:
        return False
    if not key_masks_stay_dense():
        return True
    from jax_flash import _key_masks  # here: _key_masks imports this module
    return not _key_masks.converts(q, k, masks, config, dense)


def group_to_pack(q: jax.Array, k: jax.Array, masks: MaskOperands, config: ScoreConfig,
                  dense: DenseOperands) -> int:
    """The group size ``G`` the forward call packs, or 1 where it runs unpacked."""
    seqlen_q, heads_q = q.shape[1], q.shape[2]
    group = heads_q // k.shape[2]
    if group == 1 or seqlen_q == 0 or not packing_requested():
        return 1
    if _tiles(seqlen_q * group) >= group * _tiles(seqlen_q):
        return 1  # no tile saved (seqlen_q a multiple of the tile height)
    if has_dense_operands(q, k, masks, config, dense) or masks.alibi_slopes.shape[-1] != 0:
        return 1
    if _reads_query_positions(q, masks, config) and group & (group - 1):
        return 1  # the kernels map a packed row to its position by a shift
    if not _query_axes_replicated(q):
        return 1
    return group


def _reads_query_positions(q: jax.Array, masks: MaskOperands, config: ScoreConfig) -> bool:
    """Whether a mask of the packed call reads a row's position: a window, or causal where it is not moot."""
    return config.window_left >= 0 or config.window_right >= 0 or (
        config.causal and not _causal_is_moot(q, masks, config))


def pack(q: jax.Array, masks: MaskOperands, config: ScoreConfig,
         group: int) -> tuple[jax.Array, MaskOperands, ScoreConfig]:
    """``q [B, Sq, Hkv * G, D]`` -> ``[B, Sq * G, Hkv, D]`` (row ``s * G + g``), with the query masks to match."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = heads_q // group
    packed = q.reshape(batch, seqlen_q, heads_kv, group, head_dim).transpose(0, 1, 3, 2, 4)
    packed = packed.reshape(batch, seqlen_q * group, heads_kv, head_dim)
    # Clamped to the sequence first: lengths arrive saturated at int32's maximum, and times G would wrap.
    q_seqlens = (jnp.minimum(masks.q_seqlens, seqlen_q) * group if masks.q_seqlens.shape[-1]
                 else masks.q_seqlens)
    q_segment_ids = (jnp.repeat(masks.q_segment_ids, group, axis=1) if masks.q_segment_ids.shape[-1]
                     else masks.q_segment_ids)
    masks = masks._replace(q_seqlens=q_seqlens, q_segment_ids=q_segment_ids)
    if _reads_query_positions(q, masks, config):
        config = dataclasses.replace(config, packed_heads=group)
    else:  # nothing reads a position (a moot causal mask included): the kernels see plain rows
        config = dataclasses.replace(config, causal=False, packed_heads=1)
    return packed, masks, config


def unpack(o: jax.Array, lse: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """The packed call's ``o [B, Sq * G, Hkv, D]`` and ``lse [B, Hkv, Sq * G]`` in the usual layouts."""
    batch, rows, heads_kv, head_dim = o.shape
    seqlen_q = rows // group
    o = o.reshape(batch, seqlen_q, group, heads_kv, head_dim).transpose(0, 1, 3, 2, 4)
    o = o.reshape(batch, seqlen_q, heads_kv * group, head_dim)
    lse = lse.reshape(batch, heads_kv, seqlen_q, group).transpose(0, 1, 3, 2)
    return o, lse.reshape(batch, heads_kv * group, seqlen_q)
