"""The dropout keep mask in pure JAX, bit-identical to the kernels' (csrc/common/philox.h documents the mapping).

One Philox-4x32-10 call serves eight elements of a ``(b, h)`` slice: rows ``{i, i + 8}`` of a 16-row block times
columns ``{j, j + 1, j + 32, j + 33}`` of a 64-column block. Element ``(b, h, i, j)`` uses the call keyed by
``seeds[b]`` at counter ``(J, I, 0, h)`` with ``I = 8 * (i // 16) + i % 8`` and ``J = 16 * (j // 64) + (j % 32) // 2``;
its 16-bit draw is half ``j % 2`` (0: low bits) of word ``2 * ((i // 8) % 2) + (j // 32) % 2``, and it is kept
when the draw is at least ``round(rate * 65536)`` (saturated at 65535).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_MUL = (np.uint32(0xD2511F53), np.uint32(0xCD9E8D57))
_WEYL = (np.uint32(0x9E3779B9), np.uint32(0xBB67AE85))


def _mul_hi_lo(a: jax.Array, b: np.uint32) -> tuple[jax.Array, jax.Array]:
    """High and low 32-bit halves of a * b, in 16-bit pieces so that no 64-bit type is needed."""
    mask16 = np.uint32(0xFFFF)
    a_lo, a_hi = a & mask16, a >> 16
    b_lo, b_hi = np.uint32(int(b) & 0xFFFF), np.uint32(int(b) >> 16)
    lo_lo, lo_hi, hi_lo, hi_hi = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    middle = (lo_lo >> 16) + (lo_hi & mask16) + (hi_lo & mask16)
    high = hi_hi + (lo_hi >> 16) + (hi_lo >> 16) + (middle >> 16)
    return high, a * b


def philox4x32_10(counter: tuple[jax.Array, ...], key: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mul_hi_lo(c0, _MUL[0])
        hi1, lo1 = _mul_hi_lo(c2, _MUL[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = k0 + _WEYL[0], k1 + _WEYL[1]
    return c0, c1, c2, c3


def dropout_threshold(rate: float) -> int:
    """16-bit draws at or above this survive: round(rate * 2^16), saturated at 2^16 - 1 (matches the C++)."""
    scaled = float(np.float32(rate)) * 65536.0
    return 0xFFFF if scaled >= 65535.0 else int(scaled + 0.5)


def keep_mask(seeds: jax.Array, rate: float, heads: int, seqlen_q: int, seqlen_k: int) -> jax.Array:
    """Boolean ``[batch, heads, seqlen_q, seqlen_k]``: True where dropout keeps the probability.

    Args:
      seeds: ``[batch, 2]`` uint32 Philox keys, one per batch row.
      rate: the dropout rate.
    """
    if max(heads, seqlen_q, seqlen_k) >= 2 ** 32:
        raise ValueError("the dropout mapping supports fewer than 2^32 heads, queries and keys")
    i = np.arange(seqlen_q)
    j = np.arange(seqlen_k)
    call_row = 8 * (i // 16) + i % 8                  # I of each query row
    call_column = 16 * (j // 64) + (j % 32) // 2      # J of each key
    # One Philox call per (head, I, J) that some element uses, then each element picks its word and half.
    rows = np.arange(8 * -(-seqlen_q // 16), dtype=np.uint32)
    columns = np.arange(16 * -(-seqlen_k // 64), dtype=np.uint32)
    shape = (1, heads, rows.size, columns.size)
    counter = (jnp.broadcast_to(jnp.asarray(columns)[None, None, None, :], shape),
               jnp.broadcast_to(jnp.asarray(rows)[None, None, :, None], shape),
               jnp.zeros(shape, jnp.uint32),
               jnp.broadcast_to(jnp.arange(heads, dtype=jnp.uint32)[None, :, None, None], shape))
    seeds = seeds.astype(jnp.uint32)
    key = (seeds[:, 0, None, None, None], seeds[:, 1, None, None, None])
    words = jnp.stack(philox4x32_10(counter, key))                 # [4, batch, heads, calls_q, calls_k]
    words = words[:, :, :, call_row[:, None], call_column[None, :]]  # [4, batch, heads, seqlen_q, seqlen_k]
    word_index = 2 * ((i[:, None] // 8) % 2) + (j[None, :] // 32) % 2
    word = jnp.take_along_axis(words, jnp.asarray(word_index)[None, None, None], axis=0)[0]
    draw = jnp.where(jnp.asarray(j % 2 == 1), word >> 16, word & np.uint32(0xFFFF))
    return draw >= np.uint32(dropout_threshold(rate))


def seeds_from_key(dropout_rng: jax.Array, batch: int) -> jax.Array:
    """``[batch, 2]`` uint32 Philox keys drawn from a JAX PRNG key (typed or raw)."""
    return jax.random.bits(dropout_rng, (batch, 2), jnp.uint32)
