"""vmap for the custom calls, which have no batching rule: a vmapped axis ``n`` is folded into the batch axis
(``[n, B, ...] -> [n * B, ...]``) before the call and unfolded after it."""

from __future__ import annotations

import functools
from typing import cast

import jax
import jax.numpy as jnp

from jax_flash._config import DenseOperands


def fold(x: jax.Array, batched: bool, axis_size: int) -> jax.Array:
    """``[n, B, ...]`` (or unbatched ``[B, ...]``, broadcast) -> ``[n * B, ...]``."""
    if not batched:
        x = jnp.broadcast_to(x, (axis_size, *x.shape))
    return x.reshape(axis_size * x.shape[1], *x.shape[2:])


def unfold(x: jax.Array, axis_size: int) -> jax.Array:
    """Inverse of :func:`fold`."""
    return x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])


def fold_all(axis_size: int, in_batched, args):
    return jax.tree.map(functools.partial(fold, axis_size=axis_size), tuple(args), tuple(in_batched))


def _fold_broadcastable(x: jax.Array, batched: bool, axis_size: int, batch: int) -> jax.Array:
    """A bias/mask ``[n, B|1, ...]`` (or unbatched ``[B|1, ...]``) -> ``[n * B, ...]``; an unbatched one with a
    broadcast (or absent) batch axis stays as it is, broadcast over the folded batch too."""
    if not batched and (x.shape[0] == 1 or not x.shape[-1]):
        return x
    if not x.shape[-1]:
        return DenseOperands.absent(batch).bias.astype(x.dtype)
    x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
    return fold(jnp.broadcast_to(x, (axis_size, batch, *x.shape[2:])), True, axis_size)


def fold_dense(axis_size: int, batch: int, in_batched: DenseOperands, dense: DenseOperands) -> DenseOperands:
    """Bias and mask by ``_fold_broadcastable`` (``batch``: the batch axis of ``q`` itself), seeds like the rest."""
    broadcastable = functools.partial(_fold_broadcastable, axis_size=axis_size, batch=batch)
    # in_batched holds vmap's batched flags (bools) in DenseOperands' shape.
    bias_batched, mask_batched, seeds_batched = (cast(bool, flag) for flag in in_batched)
    return DenseOperands(broadcastable(dense.bias, bias_batched), broadcastable(dense.mask, mask_batched),
                         fold(dense.dropout_seeds, seeds_batched, axis_size))


def unfold_dbias(dbias: jax.Array, bias: jax.Array, batched: bool, axis_size: int) -> tuple[jax.Array, bool]:
    """The per-example gradient of a bias folded by ``fold_dense`` (the backward folds a shared bias as a batched
    one, so that the kernels never sum it over the examples) and whether it is batched."""
    dbias = unfold(dbias, axis_size)
    if batched and bias.shape[1] == 1:
        return jnp.sum(dbias, axis=1, keepdims=True), True
    return dbias, True
