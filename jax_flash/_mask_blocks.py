"""Block summary of the boolean mask, passed to the kernels next to it (``csrc/common/mask_blocks.h``).

One byte per ``MASK_BLOCK x MASK_BLOCK`` block of each (batch, head) slice: ``HIDDEN`` when the mask hides every
element of the block, ``VISIBLE`` when it hides none, ``PARTIAL`` otherwise. The GPU kernels skip key tiles whose
blocks are all hidden (o = 0 and lse = -inf for rows that see nothing, as if computed) and read no mask element
in tiles whose blocks are all visible; the CPU kernels ignore the summary.

It is computed right before each custom call from the mask that call receives (``_ffi_calls``), so it always
describes exactly that operand: after vmap folding, for each device's shard, for each ring step's columns, and
again in the backward (a reduction over the mask, small next to the attention that reads it anyway).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MASK_BLOCK = 64  # kMaskBlock in csrc/common/mask_blocks.h
HIDDEN, PARTIAL, VISIBLE = 0, 1, 2


def blocks_along(size: int) -> int:
    """Blocks along a mask axis of ``size`` elements; a broadcast axis (size 1) stays one block."""
    return 1 if size == 1 else math.ceil(size / MASK_BLOCK)


def absent(mask: jax.Array) -> jax.Array:
    """The placeholder passed when there is no mask: uint8 of the absent mask's shape ``[..., 1, 1, 1, 0]``."""
    return jnp.zeros(mask.shape, jnp.uint8)


def block_summary(mask: jax.Array) -> jax.Array:
    """The summary of ``mask`` (bool ``[..., Sq|1, Sk|1]``, any leading axes), uint8
    ``[..., blocks(Sq)|1, blocks(Sk)|1]``; the absent placeholder when the mask is absent (last axis 0)."""
    if mask.shape[-1] == 0:
        return absent(mask)
    *lead, seqlen_q, seqlen_k = mask.shape
    rows, cols = (1 if n == 1 else MASK_BLOCK for n in (seqlen_q, seqlen_k))
    blocks_q, blocks_k = blocks_along(seqlen_q), blocks_along(seqlen_k)
    padding = [(0, 0)] * len(lead) + [(0, blocks_q * rows - seqlen_q), (0, blocks_k * cols - seqlen_k)]

    def blockwise(reduce, padding_value):  # padding elements neither show nor hide anything
        padded = jnp.pad(mask, padding, constant_values=padding_value)
        return reduce(padded.reshape(*lead, blocks_q, rows, blocks_k, cols), axis=(-3, -1))

    # HIDDEN + (any visible) + (all visible): 0, 1 or 2.
    return (blockwise(jnp.any, False).astype(jnp.uint8) + blockwise(jnp.all, True).astype(jnp.uint8))
