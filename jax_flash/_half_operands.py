"""The TF32-class backward of float32 calls on float16 operands (opt-in: ``JAX_FLASH_SM90_TF32_BACKWARD_FP16=1``).

Why float16: it keeps TF32's 11 significant bits, its tensor-core products run at twice TF32's rate, and the 16-bit
Hopper backward reads its operands as they lie (TF32 WGMMAs take shared operands only K-major, which costs the TF32
backward transposed register loads and a trip of P^T and dS^T through shared memory). What float16 lacks is
TF32's exponent range; powers of two restore it, one per (batch row, KV head) slice of each tensor (the kernel
computes each slice on its own, so a slice's factors need only agree within it), exact in float32 both ways:

- q and k: ``q * 2^s`` and ``k * 2^-s``, which leaves every score, and so the call's static softmax scale, as it
  was; s balances their largest elements (whose product must stay below 2^30, or they overflow float16).
- The probabilities: the kernel sees ``lse - 7 ln 2``, so its P' = 2^7 P keeps full float16 precision down to
  P = 2^-21 (as is, P below 2^-14 would be a float16 subnormal).
- v (and o, its convex combinations) and dO: the kernel rounds dS' = P' (dP' - D') to float16. With
  |dP'_ij| <= |dO'_i| |V'_j| and |D'_i| <= |dO'_i| |O'_i| + |dlse'_i| (row norms, Cauchy-Schwarz), v's rows are
  put below norm 2^4 and dO's so that the bound on |dS'| stays below 2^14.

The kernel returns float32 gradients of the scaled operands (AttentionBackwardParams::float32_gradients), which
this module scales back. What is lost against TF32: elements far below their slice's largest (about 2^-16 of it
for dO, 2^-18 for v) are float16 subnormals, with fewer significant bits; the norm-wise error, which the tests
bound, does not see them.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# log2 of the kernel's probability scale: P' = 2^7 P.
PROBABILITY_SHIFT = 7
# v's largest row norm is put in [2^3, 2^4).
_V_ROW_NORM_EXPONENT = 4
# The bound on |dS'| is kept below 2^14 (float16's largest finite is 65504, just under 2^16).
_SCORE_GRAD_EXPONENT = 14

GradCall = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array],
                    tuple[jax.Array, jax.Array, jax.Array]]


def _exponent(x: jax.Array) -> jax.Array:
    """e with x in [2^(e-1), 2^e) for x > 0 (int32); 0 where x is 0 or not finite (the scale then leaves the tensor
    as it is, and a NaN or infinity propagates to the gradients as it would without scaling)."""
    _, e = jnp.frexp(x)
    return jnp.where((x > 0) & jnp.isfinite(x), e, 0).astype(jnp.int32)


def _grouped(x: jax.Array, heads_kv: int) -> jax.Array:
    """``[..., S, H, D]`` as ``[..., S, Hkv, H / Hkv, D]``: each KV head's group of heads on an axis of its own."""
    *lead, seqlen, heads, dim = x.shape
    return x.reshape(*lead, seqlen, heads_kv, heads // heads_kv, dim)


def _slice_max(x: jax.Array, heads_kv: int) -> jax.Array:
    """``[..., Hkv]``: the largest |element| of each (batch row, KV head) slice of ``x`` ``[..., S, H, D]``."""
    return jnp.max(jnp.abs(_grouped(x, heads_kv)), axis=(-4, -2, -1))


def _slice_max_row_norm(x: jax.Array, heads_kv: int) -> jax.Array:
    """``[..., Hkv]``: the largest row norm (over D) of each (batch row, KV head) slice of ``x`` ``[..., S, H, D]``."""
    norms = jnp.sqrt(jnp.sum(jnp.square(_grouped(x, heads_kv)), axis=-1))
    return jnp.max(norms, axis=(-3, -1))


def operand_exponents(q: jax.Array, k: jax.Array, v: jax.Array, d_o: jax.Array,
                      d_lse: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(s, e_v, e_do)``, int32 ``[..., Hkv]``, one per (batch row, KV head): that slice's q (its group of query
    heads) is scaled by 2^s and its k by 2^-s, its v and o by 2^e_v, its dO by 2^e_do. Per slice, since the kernel
    computes each slice on its own: a batch row or head far smaller than the rest keeps its own precision."""
    heads_kv = k.shape[-2]
    e_q = _exponent(_slice_max(q, heads_kv))
    e_k = _exponent(_slice_max(k, heads_kv))
    s = (e_k - e_q) // 2  # the largest |q'| and |k'| then lie within a factor of 4 of each other
    e_v = _V_ROW_NORM_EXPONENT - _exponent(_slice_max_row_norm(v, heads_kv))
    # 2^p (|dP'| + |D'|) <= 2^(p + e_do) c with c = 2 max|dO_i| max|V'_j| + 2^e_v max|dlse_i| (|O'_i| <= max|V'_j|
    # < 2^4, and a factor 2 of margin for o's and the operands' roundings).
    v_norm_bound = 2.0 ** _V_ROW_NORM_EXPONENT
    *lead, heads_q, seqlen_q = d_lse.shape
    d_lse_max = jnp.max(jnp.abs(d_lse.reshape(*lead, heads_kv, heads_q // heads_kv * seqlen_q)), axis=-1)
    c = 2.0 * _slice_max_row_norm(d_o, heads_kv) * v_norm_bound + jnp.ldexp(d_lse_max, e_v)
    e_do = _SCORE_GRAD_EXPONENT - PROBABILITY_SHIFT - 1 - _exponent(c)
    return s, e_v, e_do


def _scaled(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x`` ``[..., S, H, D]`` times 2^exponent of its slice (``exponent`` ``[..., Hkv]``), in float32."""
    grouped = _grouped(x, exponent.shape[-1])
    return jnp.ldexp(grouped, exponent[..., None, :, None, None]).reshape(x.shape)


def _half(x: jax.Array, exponent: jax.Array) -> jax.Array:
    return _scaled(x, exponent).astype(jnp.float16)


def _scaled_rows(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x`` ``[..., Hq, Sq]`` (lse-shaped) times 2^exponent of its slice (``exponent`` ``[..., Hkv]``)."""
    *lead, heads_q, seqlen_q = x.shape
    heads_kv = exponent.shape[-1]
    grouped = x.reshape(*lead, heads_kv, heads_q // heads_kv, seqlen_q)
    return jnp.ldexp(grouped, exponent[..., None, None]).reshape(x.shape)


def backward(call: GradCall, q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array,
             d_o: jax.Array, d_lse: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` float32 of a float32 call through ``call(q, k, v, o, lse, d_o, d_lse)``, the backward
    custom call on float16 operands with float32 gradients (its masks and attributes bound)."""
    d_lse = d_lse.astype(jnp.float32)
    s, e_v, e_do = operand_exponents(q, k, v, d_o, d_lse)
    p = PROBABILITY_SHIFT
    lse_shifted = lse - jnp.float32(p * np.log(2.0))
    dq, dk, dv = call(_half(q, s), _half(k, -s), _half(v, e_v), _half(o, e_v), lse_shifted, _half(d_o, e_do),
                      _scaled_rows(d_lse, e_do + e_v))
    # dS' = 2^(p + e_do + e_v) dS; dQ' = scale dS' K' and dK' = scale dS'^T Q', dV' = P'^T dO'.
    score_grad_exponent = p + e_do + e_v
    return (_scaled(dq, -(score_grad_exponent - s)), _scaled(dk, -(score_grad_exponent + s)),
            _scaled(dv, -(p + e_do)))
