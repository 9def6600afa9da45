"""The two custom calls, as JAX functions of arrays. Result shapes are declared up front (ShapeDtypeStruct),
so eval_shape, jit and jax.export work without running anything; vmap folds mapped axes into the batch
(``broadcast_all``: the handlers accept any number of leading batch axes)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jax_flash import _mask_blocks
from jax_flash._config import DenseOperands, MaskOperands, ScoreConfig
from jax_flash._registration import BACKWARD_TARGET, FORWARD_TARGET


def _score_attributes(config: ScoreConfig) -> dict[str, object]:
    return dict(
        softmax_scale=np.float32(config.softmax_scale),
        softcap=np.float32(config.softcap),
        causal=bool(config.causal),
        align_to_sequence_end=bool(config.align_to_sequence_end),
        diagonal_offset=np.int64(config.diagonal_offset),
        window_left=np.int64(config.window_left),
        window_right=np.int64(config.window_right),
        dropout_rate=np.float32(config.dropout_rate),
        allow_tf32=bool(config.allow_tf32),
    )


def _result(like: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype,
            dims: tuple[int, ...] | None = None) -> jax.core.ShapedArray:
    """A result type carrying ``like``'s sharding typing, which XLA does not infer for custom calls: the mesh
    axes it varies over inside ``shard_map`` (without them, gradients there fail the custom-VJP type check) and,
    on meshes with explicit axes, its sharding, with result dimension ``i`` sharded like ``like``'s ``dims[i]``.
    """
    aval = jax.typeof(like)
    spec = tuple(aval.sharding.spec) + (None,) * (aval.ndim - len(aval.sharding.spec))
    spec = PartitionSpec(*(spec[d] for d in (dims or range(len(shape)))))
    return aval.update(shape=shape, dtype=dtype, sharding=aval.sharding.update(spec=spec))


_LSE_DIMS = (0, 2, 1)  # lse [B, Hq, Sq] is sharded like q [B, Sq, Hq, D]'s dimensions 0, 2, 1


def _dense_arguments(dense: DenseOperands) -> tuple[jax.Array, ...]:
    """The dense operands in the targets' order, the mask followed by its block summary (``_mask_blocks``)."""
    return dense.bias, dense.mask, _mask_blocks.block_summary(dense.mask), dense.dropout_seeds


def lse_shape(q: jax.Array) -> tuple[int, ...]:
    """``[B, Hq, Sq]`` for ``q`` of shape ``[B, Sq, Hq, D]``."""
    batch, seqlen_q, heads_q, _ = q.shape
    return (batch, heads_q, seqlen_q)


def forward(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, config: ScoreConfig,
            dense: DenseOperands | None = None) -> tuple[jax.Array, jax.Array]:
    """Runs the forward kernel. Returns ``(o [B, Sq, Hq, D], lse [B, Hq, Sq] float32)``."""
    dense = DenseOperands.absent(q.shape[0]) if dense is None else dense
    results = (_result(q, q.shape, q.dtype), _result(q, lse_shape(q), jnp.float32, dims=_LSE_DIMS))
    call = jax.ffi.ffi_call(FORWARD_TARGET, results, vmap_method="broadcast_all")
    o, lse = call(q, k, v, *masks, *_dense_arguments(dense), **_score_attributes(config))
    return o, lse


def fused_dq_requested() -> bool:
    """Whether ``JAX_FLASH_SM90_FUSED_DQ=1`` (read when a backward is traced) asks the backward to sum dQ inside
    its dK/dV pass (atomic float32 adds into a workspace shaped like ``q``) instead of the default separate dQ pass:
    the Hopper backward up to d=128 (its d=256 kernel has no fused form and keeps the dQ pass), and the sm80
    backward's common variant (no softcap, ALiBi, bias, mask or dropout).
    Experimental: the Hopper form measured slower on the H200 (benchmarks/NOTES.md). Deterministic calls and
    float32 inputs never use it; the general variant and the float32 kernels ignore the workspace.
    """
    value = os.environ.get("JAX_FLASH_SM90_FUSED_DQ", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"JAX_FLASH_SM90_FUSED_DQ must be 0 or 1, not {value!r}")
    return value == "1"


def backward(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array, d_o: jax.Array,
             d_lse: jax.Array, masks: MaskOperands, config: ScoreConfig, dense: DenseOperands | None = None,
             want_dbias: bool = False) -> tuple[jax.Array, ...]:
    """Runs the backward kernels. Returns ``(dq, dk, dv)`` shaped like ``(q, k, v)``, and ``dbias`` (float32,
    shaped like the bias, summed over its broadcast axes) after them when ``want_dbias``.

    Two extra results are workspaces the kernels need; XLA allocates them, so their memory lives as long as the
    queued kernels: ``rowsum(dO * O) - dlse`` (float32, one per query row) and ``dq_accum``, in which the
    backward sums dQ over key tiles inside its dK/dV pass (see ``fused_dq_requested``); an empty placeholder
    otherwise.
    """
    dense = DenseOperands.absent(q.shape[0]) if dense is None else dense
    dbias_shape = dense.bias.shape if want_dbias else (1, 1, 1, 0)
    fused_dq = fused_dq_requested() and not config.deterministic and q.dtype != jnp.float32
    results = (
        _result(q, q.shape, q.dtype),
        _result(k, k.shape, k.dtype),
        _result(v, v.shape, v.dtype),
        _result(q, lse_shape(q), jnp.float32, dims=_LSE_DIMS),
        _result(q, q.shape, jnp.float32) if fused_dq else jax.ShapeDtypeStruct((0,), jnp.float32),
        jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
    )
    call = jax.ffi.ffi_call(BACKWARD_TARGET, results, vmap_method="broadcast_all")
    dq, dk, dv, _, _, dbias = call(q, k, v, o, lse, d_o.astype(q.dtype), d_lse.astype(jnp.float32), *masks,
                                *_dense_arguments(dense), **_score_attributes(config),
                                deterministic=bool(config.deterministic))
    return (dq, dk, dv, dbias) if want_dbias else (dq, dk, dv)
