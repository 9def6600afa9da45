"""Moving a sequence sharded contiguously (what ``NamedSharding`` gives) into the zigzag layout and back, per
device inside a collective context, with two ``ppermute``s each way.

With ``n`` devices, cut the sequence into ``2n`` half-chunks: device ``d`` holds half-chunks ``2d`` and
``2d + 1`` contiguously, while the zigzag layout puts half-chunks ``r`` and ``2n - 1 - r`` on device ``r``
(``sequence_layout``). Every device sends its first half-chunk along one permutation and its second along
another; both are permutations because each device receives exactly one even and one odd half-chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash._ring import AxisName


def _zigzag_device(half_chunk: int, num_shards: int) -> int:
    return half_chunk if half_chunk < num_shards else 2 * num_shards - 1 - half_chunk


def _halves(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    half = x.shape[axis] // 2
    return lax.slice_in_dim(x, 0, half, axis=axis), lax.slice_in_dim(x, half, 2 * half, axis=axis)


def to_zigzag(x: jax.Array, axis_name: AxisName, num_shards: int, axis: int = 1) -> jax.Array:
    """This device's contiguous shard of a sequence (along ``axis``) -> its zigzag shard."""
    even, odd = _halves(x, axis)  # half-chunks 2d and 2d + 1
    even = lax.ppermute(even, axis_name, [(d, _zigzag_device(2 * d, num_shards)) for d in range(num_shards)])
    odd = lax.ppermute(odd, axis_name, [(d, _zigzag_device(2 * d + 1, num_shards)) for d in range(num_shards)])
    # Device r's first zigzag half-chunk is r itself: the even one when r is even.
    r_is_even = lax.axis_index(axis_name) % 2 == 0
    return jnp.where(r_is_even, jnp.concatenate([even, odd], axis), jnp.concatenate([odd, even], axis))


def from_zigzag(x: jax.Array, axis_name: AxisName, num_shards: int, axis: int = 1) -> jax.Array:
    """Inverse of :func:`to_zigzag`."""
    first, second = _halves(x, axis)  # half-chunks r and 2n - 1 - r
    r_is_even = lax.axis_index(axis_name) % 2 == 0
    even, odd = jnp.where(r_is_even, first, second), jnp.where(r_is_even, second, first)
    even_chunk = lambda r: r if r % 2 == 0 else 2 * num_shards - 1 - r
    even = lax.ppermute(even, axis_name, [(r, even_chunk(r) // 2) for r in range(num_shards)])
    odd = lax.ppermute(odd, axis_name, [(r, (2 * num_shards - 1 - even_chunk(r)) // 2) for r in range(num_shards)])
    return jnp.concatenate([even, odd], axis)
