"""How a sequence axis is split over the devices of a mesh axis, and helpers to reorder a global array into the
load-balanced zigzag layout and back.

A sequence of length ``S`` sharded over ``n`` devices is cut into equal chunks; every device holds some chunks,
in increasing position order, concatenated along its local sequence axis:

- ``"contiguous"``: ``n`` chunks of ``S / n``; device ``r`` holds chunk ``r`` (what ``NamedSharding`` gives).
- ``"zigzag"``: ``2n`` chunks of ``S / (2n)``; device ``r`` holds chunks ``r`` and ``2n - 1 - r``. Under a causal
  mask every device then has the same amount of visible work in every ring step (an early chunk, which sees
  little, paired with a late one, which sees much), where the contiguous layout leaves device 0 idle and makes
  device ``n - 1`` do everything.

For ``n = 4`` and ``S = 16``, the zigzag layout puts positions ``[0, 1, 14, 15]`` on device 0,
``[2, 3, 12, 13]`` on device 1, ``[4, 5, 10, 11]`` on device 2 and ``[6, 7, 8, 9]`` on device 3.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

LayoutName = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Static description of a sharded sequence axis.

    Attributes:
      name: ``"contiguous"`` or ``"zigzag"``.
      num_shards: devices along the mesh axis (1: the whole sequence on every device).
      seqlen: global sequence length; a multiple of ``num_chunks``.
    """

    name: LayoutName
    num_shards: int
    seqlen: int

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.name!r}")
        if self.seqlen % self.num_chunks:
            raise ValueError(f"a {self.name} layout over {self.num_shards} devices cuts the sequence into "
                             f"{self.num_chunks} equal chunks, but the sequence length {self.seqlen} is not a "
                             f"multiple of {self.num_chunks}")

    @property
    def chunks_per_shard(self) -> int:
        return 2 if self.name == "zigzag" else 1

    @property
    def num_chunks(self) -> int:
        return self.num_shards * self.chunks_per_shard

    @property
    def chunk_len(self) -> int:
        return self.seqlen // self.num_chunks

    def chunk_ids(self, shard: int) -> tuple[int, ...]:
        """Global chunk indices held by ``shard``, in local (and increasing position) order."""
        if self.name == "zigzag":
            return (shard, self.num_chunks - 1 - shard)
        return (shard,)

    def chunk_starts(self, shard: int) -> tuple[int, ...]:
        """Global position of the first element of each local chunk of ``shard``."""
        return tuple(c * self.chunk_len for c in self.chunk_ids(shard))

    def start_table(self) -> np.ndarray:
        """``[num_shards, chunks_per_shard]`` int32: ``chunk_starts`` of every shard, for lookups by a traced
        shard index."""
        return np.asarray([self.chunk_starts(r) for r in range(self.num_shards)], np.int32)


def _zigzag_order(num_shards: int) -> np.ndarray:
    """Chunk indices in the order the zigzag layout stores them: device 0's chunks, then device 1's, ..."""
    return np.asarray([c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)])


def _reorder_chunks(x: jax.Array, num_chunks: int, order: np.ndarray, axis: int) -> jax.Array:
    axis = axis % x.ndim
    if x.shape[axis] % num_chunks:
        raise ValueError(f"axis {axis} of length {x.shape[axis]} cannot be cut into {num_chunks} equal chunks")
    chunked = x.reshape(*x.shape[:axis], num_chunks, x.shape[axis] // num_chunks, *x.shape[axis + 1:])
    return jnp.take(chunked, order, axis=axis).reshape(x.shape)


def to_zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """Reorders a global array's sequence axis into the zigzag layout (see the module docstring).

    Sharding the result's ``axis`` evenly over ``num_shards`` devices gives each device its zigzag chunks, which
    is what ``jax_flash.ring_attention(..., layout="zigzag")`` expects. Apply it to ``q``, ``k``, ``v`` and the
    segment ids alike (not to ``q_seqlens``/``kv_seqlens``, which stay global lengths).

    Args:
      x: ``[..., seqlen, ...]`` with ``seqlen`` a multiple of ``2 * num_shards``, e.g. ``q`` ``[B, S, H, D]``
        or segment ids ``[B, S]``.
      num_shards: devices along the mesh axis that will shard ``axis``.
      axis: the sequence axis.

    Returns:
      ``x`` with its sequence chunks permuted; :func:`from_zigzag` undoes it.
    """
    return _reorder_chunks(x, 2 * num_shards, _zigzag_order(num_shards), axis)


def from_zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """Inverse of :func:`to_zigzag`: restores natural sequence order (e.g. of the attention output)."""
    return _reorder_chunks(x, 2 * num_shards, np.argsort(_zigzag_order(num_shards)), axis)
