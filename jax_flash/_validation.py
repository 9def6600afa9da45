"""Argument checks for the public functions. Everything runs at trace time on shapes, dtypes and Python
values, and every failure names the offending argument."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _dropout
from jax_flash._config import DenseOperands, MaskOperands

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


FLOAT32_PRECISIONS = ("tf32", "highest")


def allow_tf32(value: object) -> bool:
    """``float32_precision`` as the kernels take it: True for ``"tf32"``, False for ``"highest"``.

    Also accepts ``jax.lax.Precision`` (and its string names) with their meaning for XLA's float32 matmuls on the
    GPU: ``DEFAULT`` and ``HIGH`` (``"tensorfloat32"``, ``"bfloat16_3x"``) run on TF32 tensor cores, ``HIGHEST``
    (``"float32"``) in exact float32.
    """
    if isinstance(value, jax.lax.Precision):
        return value != jax.lax.Precision.HIGHEST
    if isinstance(value, str):
        name = value.lower()
        if name in ("tf32", "tensorfloat32", "default", "bfloat16", "fastest", "high", "bfloat16_3x"):
            return True
        if name in ("highest", "float32"):
            return False
    raise ValueError(f"float32_precision must be 'tf32' or 'highest' (or a jax.lax.Precision), got {value!r}")


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, *, allow_float64: bool = False) -> None:
    """Checks ranks, dtypes and the BSHD shape contract of q, k, v (float64 only for the reference path)."""
    allowed = SUPPORTED_DTYPES + ((jnp.dtype(jnp.float64),) if allow_float64 else ())
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 ([batch, seqlen, heads, head_dim]), got shape {x.shape}")
        if jnp.dtype(x.dtype) not in allowed:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got q {q.shape} and k {k.shape}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got q {q.shape} and k {k.shape}")
    if q.shape[3] == 0:
        raise ValueError(f"head_dim must be positive, got q {q.shape}")
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"the number of query heads ({heads_q}, q.shape[2]) must be a positive multiple of the "
                         f"number of key/value heads ({heads_kv}, k.shape[2])")


def static_float(name: str, value: object, *, minimum: float | None = None, positive: bool = False) -> float:
    """A finite Python float from a static argument."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python number, not a traced value")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result}")
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    if positive and result <= 0:
        raise ValueError(f"{name} must be > 0, got {result}")
    return result


def static_bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool, got {type(value).__name__}")
    return bool(value)


# Sequences are shorter than 2^31, so a window of 2^32 or more reaches every key: it is unbounded (-1), which also
# keeps the kernels' int64 index arithmetic far from overflow.
_UNBOUNDED_WINDOW = 2 ** 32


def window(name: str, value: object) -> tuple[int, int]:
    """(left, right) with -1 for unbounded."""
    if value is None:
        return (-1, -1)
    if not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"{name} must be a pair (left, right), got {value!r}")
    result = []
    for side in value:
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"{name} entries must be integers, got {value!r}")
        if side < -1:
            raise ValueError(f"{name} entries must be >= 0, or -1 for unbounded, got {value!r}")
        result.append(-1 if side >= _UNBOUNDED_WINDOW else int(side))
    return (result[0], result[1])


def _integer_array(name: str, value: object, shape: tuple[int, ...]) -> jax.Array:
    array = jnp.asarray(value)
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {array.dtype}")
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {array.shape}")
    return array


def _segment_ids(name: str, value: object, shape: tuple[int, ...]) -> jax.Array:
    array = _integer_array(name, value, shape)
    # Ids are only compared for equality: any 32-bit type maps to int32 one to one, a 64-bit one would not.
    if jnp.dtype(array.dtype).itemsize > 4:
        raise TypeError(f"{name} must be a 32-bit (or narrower) integer array, got {array.dtype}; use "
                        f"{name}.astype(jnp.int32)")
    return array.astype(jnp.int32)


def dropout_rate(value: object) -> float:
    """The rate as the kernels see it (float32), checked to be in [0, 1)."""
    rate = float(np.float32(static_float("dropout_rate", value, minimum=0.0)))
    if rate >= 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1) in float32, got {value}")
    return rate


def mask_operands(q: jax.Array, k: jax.Array, *, alibi_slopes: object, q_seqlens: object, kv_seqlens: object,
                  q_segment_ids: object, kv_segment_ids: object) -> MaskOperands:
    """Checks the optional per-batch operands and brings them to the kernels' normalised form."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    absent_int = jnp.zeros((batch, 0), jnp.int32)

    if alibi_slopes is None:
        alibi = jnp.zeros((batch, 0), jnp.float32)
    else:
        alibi = jnp.asarray(alibi_slopes)
        if not jnp.issubdtype(alibi.dtype, jnp.floating):
            raise TypeError(f"alibi_slopes must have a floating dtype, got {alibi.dtype}")
        if alibi.shape == (heads_q,):
            alibi = jnp.broadcast_to(alibi, (batch, heads_q))
        elif alibi.shape != (batch, heads_q):
            raise ValueError(f"alibi_slopes must have shape [heads_q] = ({heads_q},) or [batch, heads_q] = "
                             f"({batch}, {heads_q}), got {alibi.shape}")
        alibi = alibi.astype(jnp.float32)

    def seqlens(name: str, value: object) -> jax.Array:
        if value is None:
            return absent_int
        # Saturated before the int32 cast, so that an int64 length cannot wrap around (the kernels clamp lengths to
        # the sequence; ring attention passes global lengths with local shards, so no tighter bound here).
        lengths = _integer_array(name, value, (batch,))
        return jnp.clip(lengths, 0, np.iinfo(np.int32).max).astype(jnp.int32)[:, None]

    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if q_segment_ids is None:
        q_segments, kv_segments = absent_int, absent_int
    else:
        q_segments = _segment_ids("q_segment_ids", q_segment_ids, (batch, seqlen_q))
        kv_segments = _segment_ids("kv_segment_ids", kv_segment_ids, (batch, seqlen_k))

    return MaskOperands(alibi, seqlens("q_seqlens", q_seqlens), seqlens("kv_seqlens", kv_seqlens), q_segments,
                        kv_segments)


def _broadcastable(name: str, value: object, full: tuple[int, int, int, int]) -> jax.Array:
    """``value`` as rank 4 with each axis 1 or the full size of ``[batch, heads_q, seqlen_q, seqlen_k]``."""
    array = jnp.asarray(value)
    if array.ndim > 4 or any(size not in (1, f) for size, f in zip((1,) * (4 - array.ndim) + array.shape, full)):
        raise ValueError(f"{name} must be broadcastable to [batch, heads_q, seqlen_q, seqlen_k] = {full} with "
                         f"each axis 1 or full, got shape {array.shape}")
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


def dense_operands(q: jax.Array, k: jax.Array, *, bias: object, mask: object, dropout_rate: float,
                   dropout_rng: jax.Array | None) -> DenseOperands:
    """Checks bias, mask and dropout arguments and brings them to the kernels' normalised form."""
    batch, seqlen_q, heads_q, _ = q.shape
    full = (batch, heads_q, seqlen_q, k.shape[1])
    absent = DenseOperands.absent(batch)
    if bias is not None:
        bias_array = _broadcastable("bias", bias, full)
        if not jnp.issubdtype(bias_array.dtype, jnp.floating):
            raise TypeError(f"bias must have a floating dtype, got {bias_array.dtype}")
        absent = absent._replace(bias=bias_array.astype(jnp.float32))
    if mask is not None:
        mask_array = _broadcastable("mask", mask, full)
        if mask_array.dtype != jnp.bool_:
            raise TypeError(f"mask must be boolean (True = attend), got {mask_array.dtype}")
        absent = absent._replace(mask=mask_array)
    if dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError("dropout_rng (a JAX PRNG key) is required when dropout_rate > 0")
        absent = absent._replace(dropout_seeds=_dropout.seeds_from_key(dropout_rng, batch))
    return absent
