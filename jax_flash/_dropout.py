"""The dropout keep mask in pure JAX, bit-identical to the kernels' (csrc/common/philox.h documents the mapping).

Element ``(b, h, i, j)`` has linear index ``n = (h * seqlen_q + i) * seqlen_k + j``; Philox-4x32-10 keyed by
``seeds[b]`` at counter ``(n // 4, 0, 0, 0)`` gives four words, of which the element takes word ``n % 4``; it is
kept when that word is at least ``round(rate * 2**32)``.
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
    """Words at or above this survive: round(rate * 2^32), saturated (matches the C++)."""
    scaled = float(np.float32(rate)) * 4294967296.0
    return 0xFFFFFFFF if scaled >= 4294967295.0 else int(scaled + 0.5)


def keep_mask(seeds: jax.Array, rate: float, heads: int, seqlen_q: int, seqlen_k: int) -> jax.Array:
    """Boolean ``[batch, heads, seqlen_q, seqlen_k]``: True where dropout keeps the probability.

    Args:
      seeds: ``[batch, 2]`` uint32 Philox keys, one per batch row.
      rate: the dropout rate.
    """
    if heads * seqlen_q * seqlen_k >= 2 ** 32:
        raise ValueError("the reference dropout mask supports fewer than 2^32 elements per batch row")
    n = jnp.arange(heads * seqlen_q * seqlen_k, dtype=jnp.uint32).reshape(1, heads, seqlen_q, seqlen_k)
    block = n >> 2
    zeros = jnp.zeros_like(block)
    seeds = seeds.astype(jnp.uint32)
    key = (seeds[:, 0, None, None, None], seeds[:, 1, None, None, None])
    words = philox4x32_10((block, zeros, zeros, zeros), key)
    lane = n & np.uint32(3)
    word = jnp.select([lane == 0, lane == 1, lane == 2], list(words[:3]), words[3])
    return word >= np.uint32(dropout_threshold(rate))


def seeds_from_key(dropout_rng: jax.Array, batch: int) -> jax.Array:
    """``[batch, 2]`` uint32 Philox keys drawn from a JAX PRNG key (typed or raw)."""
    return jax.random.bits(dropout_rng, (batch, 2), jnp.uint32)
