"""Key-only boolean masks as kv lengths and segment ids, for short query sequences (decoding).

A boolean mask that is the same for every head and query row (static shape ``[B|1, 1, 1, Sk]``: a padding mask,
or the cache mask of Flax's ``decode=True`` layers) only says which keys exist. The per-batch operands say the same
thing exactly:

- ``kv_seqlens`` = one past the mask's last visible key (0 if none): the keys after it are hidden anyway;
- ``q_segment_ids`` = 1 and ``kv_segment_ids`` = the mask as 0/1: hides the hidden keys before that length.

Unlike the dense mask, these do not read a key's position in a way that stops GQA packing (``_gqa_packing``) or the
split-KV forward (``_kv_split``), and the kernels skip the key tiles past the length without loading them, where the
dense mask's kernels run one tile per (batch, head) over the whole cache. Decoding with such a mask then takes the
same path as decoding with ``kv_seqlens``.

Where: GQA calls (packing then reads each KV head once for its whole group) and calls with fewer query tiles than
the GPU has SMs (the split-KV forward then spreads them), of at most 128 query rows (``TILE_ROWS``: decoding shapes,
where the gain is), whose mask is key-only and the only dense operand (no bias, no dropout), without segment ids of
their own (two segment masks do not merge into one) and without the masks whose alignment moves with ``kv_seqlens``
(window, ALiBi, causal unless moot: see ``_gqa_packing.masks_read_positions``). The caller's own ``kv_seqlens`` combine by minimum.

``JAX_FLASH_KEY_MASKS`` (read when the call is traced): unset or ``1`` converts where it applies, ``0`` keeps the
dense mask. ``JAX_FLASH_KEY_MASK_FORM=dense`` (``_config.key_masks_stay_dense``) converts to ``kv_seqlens`` only and
keeps the mask for what lies before the length, packed and split with the call instead of segment ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._config import (TILE_ROWS, DenseOperands, MaskOperands, ScoreConfig, key_masks_stay_dense,
                               switch_on)
from jax_flash._gqa_packing import masks_read_positions

KEY_MASKS_ENV = "JAX_FLASH_KEY_MASKS"

# The dense-mask path already fills the GPU (one tile per SM of the H200's 132) from this many query tiles on. Then
# converting gains nothing where GQA packing does not apply either, and costs: segment ids are compared element by
# element on every key tile, where the dense form reads mask elements only in the tiles its block summary marks
# partial. Measured on the H200 (bench_decode.py, bf16, batch 8, 32 query heads, d=128, every key visible; NOTES,
# eleventh session): 32 KV heads (256 tiles) converted 2012 us against dense 1248 at 16k keys; 8 KV heads converted
# 565 against 1247, 1 KV head 112 against 1252 (packing).
_ONE_WAVE_TILES = 132


def converts(q: jax.Array, k: jax.Array, masks: MaskOperands, config: ScoreConfig, dense: DenseOperands) -> bool:
    """Whether the call's mask is converted (the module docstring says where)."""
    if not dense.has_key_only_mask or dense.mask.shape[3] != k.shape[1]:
        return False  # no mask, one that differs between heads or query rows, or one broadcast along the keys
    if dense.has_bias or dense.dropout_seeds.shape[-1] != 0 or q.shape[1] > TILE_ROWS:
        return False
    if masks.q_segment_ids.shape[-1] != 0 or masks_read_positions(q, masks, config):
        return False
    if not switch_on(KEY_MASKS_ENV):
        return False
    batch, seqlen_q, heads_q, _ = q.shape
    dense_tiles = batch * heads_q * -(-seqlen_q // TILE_ROWS)
    return heads_q > k.shape[2] or dense_tiles < _ONE_WAVE_TILES


def as_lengths_and_segments(q: jax.Array, k: jax.Array, masks: MaskOperands, config: ScoreConfig,
                            dense: DenseOperands) -> tuple[MaskOperands, DenseOperands]:
    """The call's operands with a key-only mask moved into ``kv_seqlens`` and segment ids, where that applies
    (module docstring); otherwise unchanged."""
    if not converts(q, k, masks, config, dense):
        return masks, dense
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    visible = jnp.broadcast_to(dense.mask[:, 0, 0, :], (batch, seqlen_k))
    last_visible = seqlen_k - 1 - jnp.argmax(visible[:, ::-1], axis=1)
    lengths = jnp.where(jnp.any(visible, axis=1), last_visible + 1, 0).astype(jnp.int32)[:, None]
    if masks.kv_seqlens.shape[-1]:
        lengths = jnp.minimum(lengths, masks.kv_seqlens)
    if key_masks_stay_dense():  # the mask itself hides what lies before the length
        return masks._replace(kv_seqlens=lengths), dense
    masks = masks._replace(kv_seqlens=lengths, q_segment_ids=jnp.ones((batch, seqlen_q), jnp.int32),
                           kv_segment_ids=visible.astype(jnp.int32))
    return masks, dense._replace(mask=DenseOperands.absent(batch).mask)
