"""The TF32-class backward of float32 calls on float16 operands (``JAX_FLASH_SM90_TF32_BACKWARD_FP16``, on by default
in calls lowered for CUDA where every GPU is a Hopper), and the scaling that the exact mode's backward on float16
parts shares (``JAX_FLASH_SM90_HIGHEST_BACKWARD_FP16``, the same default; ``FLOAT16_PARTS``, whose probability and dO
scales are larger: see ``Scheme``). What follows describes the TF32 mode's (``FLOAT16_OPERANDS``).

Why float16: it keeps TF32's 11 significant bits, its tensor-core products run at twice TF32's rate, and the 16-bit
Hopper backward reads its operands as they lie (TF32 WGMMAs take shared operands only K-major, which costs the TF32
backward transposed register loads and a trip of P^T and dS^T through shared memory). What float16 lacks is
TF32's exponent range; powers of two restore it, one per (batch row, KV head) slice of each tensor (the kernel
computes each slice on its own, so a slice's factors need only agree within it), exact in float32 both ways:

- q and k: ``q * 2^s`` and ``k * 2^-s``, which leaves every score, and so the call's static softmax scale, as it
  was; s balances their largest elements (whose product must stay below 2^28, or they may overflow float16: each
  is then below 2^15).
- The probabilities: the kernel sees ``lse - 7 ln 2``, so its P' = 2^7 P keeps full float16 precision down to
  P = 2^-21 (as is, P below 2^-14 would be a float16 subnormal).
- v (and o, its convex combinations) and dO: the kernel rounds dS' = P' (dP' - D') to float16. With
  |dP'_ij| <= |dO'_i| |V'_j| and |D'_i| <= |dO'_i| |O'_i| + |dlse'_i| (row norms, Cauchy-Schwarz), v's rows are
  put below norm 2^4 and dO's so that the bound on |dS'| stays below 2^14.

The kernel returns float32 gradients of the scaled operands (AttentionBackwardParams::float32_gradients), which
this module scales back. What is lost against TF32 (limits of one power of two per slice and of the static softmax
scale, documented in README):
- elements far below their slice's largest (about 2^-16 of it for dO, 2^-18 for v) are float16 subnormals, with
  fewer significant bits; the norm-wise error, which the tests bound, does not see them;
- q and k share one factor: where the largest |q| |k| of a slice is below about 2^-20, q' and k' are both small
  enough to lose bits as subnormals (dq and dk, relative to themselves, to ~1e-2 at elements of 1e-6), and above
  2^28 they may overflow float16 (inf gradients);
- an lse cotangent far larger than |dO| |V| (by more than ~1000x) pushes dO' toward the subnormals, and dV, which it
  does not enter, loses bits (2e-3 relative at 1e6x, on the CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How one kernel family takes the scaled operands.

    - ``operand_dtype``: float16 (the TF32 mode's float16 operands), or float32 for the float16 parts, which the
      kernels split into hi + lo themselves;
    - ``probability_shift``: log2 of the kernel's probability scale, P' = 2^p P (the call's lse less p ln 2);
    - ``score_grad_exponent``: the bound on |dS'| is kept below 2^this: 14 where the kernels round dS' to float16
      (float16's largest finite is 65504, just under 2^16). The float16-parts kernels scale each row of dS' by a
      power of two of its own before splitting it (csrc/cuda/sm90/row_scaled_parts.h), so dS' need only stay within
      float32 there, and 27 leaves P' and dO' large. Why large: a float16 lo part is a subnormal (absolute spacing
      2^-24) wherever its value is below ~2^-3. With the TF32 mode's P' = 2^7 P, spread attention over 16k keys puts
      every P' there (P' ~ 2^-7), and dO' (row norm ~1) mostly too: emulated, dv was 5e-6 off at 64k keys and
      growing with them. With P' = 2^14 P and dO' of row norm ~2^6 both stay normal.
    - ``qk_boost``: q' and k' both times 2^this more, the call's softmax scale times 2^(-2 this) (``softmax_scale``:
      the scores stay as they were). For the float16 parts, whose lo parts of q' and k' (which dk and dq read as they
      are) are subnormal below ~2^-3: with 5, a slice keeps them normal down to a largest |q| |k| of ~2^-16 (~2^-6
      without) and may overflow float16 from 2^18 (logits of ~2^14 at head_dim 128) rather than 2^28.
    """
    operand_dtype: np.dtype
    probability_shift: int
    score_grad_exponent: int
    qk_boost: int = 0

    def softmax_scale(self, softmax_scale: float) -> float:
        """The softmax scale the scheme's backward call takes (exactly: a power of two)."""
        return softmax_scale * 2.0 ** (-2 * self.qk_boost)


FLOAT16_OPERANDS = Scheme(np.dtype(np.float16), probability_shift=7, score_grad_exponent=14)
FLOAT16_PARTS = Scheme(np.dtype(np.float32), probability_shift=14, score_grad_exponent=27, qk_boost=5)
# v's largest row norm is put in [2^3, 2^4).
_V_ROW_NORM_EXPONENT = 4

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
    """``[..., Hkv]``: the largest row norm (over D) of each (batch row, KV head) slice of ``x`` ``[..., S, H, D]``,
    summed over the slice divided by a power of two near its largest element, so that the squares neither overflow
    nor underflow float32 (a dO of 1e25 would)."""
    e = _exponent(_slice_max(x, heads_kv))
    unit = _grouped(_scaled(x, -e), heads_kv)  # elements within [-1, 1]
    norms = jnp.max(jnp.sqrt(jnp.sum(jnp.square(unit), axis=-1)), axis=(-3, -1))
    return _times_power_of_two(norms, e)


def operand_exponents(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, d_o: jax.Array, d_lse: jax.Array,
                      scheme: Scheme = FLOAT16_OPERANDS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(s, e_v, e_do)``, int32 ``[..., Hkv]``, one per (batch row, KV head): that slice's q (its group of query
    heads) is scaled by 2^s and its k by 2^-s, its v and o by 2^e_v, its dO by 2^e_do. Per slice, since the kernel
    computes each slice on its own: a batch row or head far smaller than the rest keeps its own precision."""
    heads_kv = k.shape[-2]
    e_q = _exponent(_slice_max(q, heads_kv))
    e_k = _exponent(_slice_max(k, heads_kv))
    s = (e_k - e_q) // 2  # the largest |q'| and |k'| then lie within a factor of 4 of each other
    # o's rows are mixes of v's rows, except where the call sees one block of the keys while o and lse are the whole
    # sequence's (ring attention's blocks, _ring.py): so the larger row norm of the two.
    e_v = _V_ROW_NORM_EXPONENT - _exponent(jnp.maximum(_slice_max_row_norm(v, heads_kv),
                                                        _slice_max_row_norm(o, heads_kv)))
    # 2^p (|dP'| + |D'|) <= 2^(p + e_do) c with c = 2 max|dO_i| max(|V'_j|, |O'_i|) + 2^e_v max|dlse_i| (both norms
    # < 2^4, and a factor 2 of margin for the operands' roundings). In exponents, c's two terms are below
    # 2^(e(max|dO_i|) + 1 + 4) and 2^(e(max|dlse_i|) + e_v), so c < 2^(larger + 1): integer arithmetic, which no
    # magnitude overflows.
    *lead, heads_q, _ = d_lse.shape
    # Rows first: merging the heads with a sharded sequence axis is a reshape that explicit mesh axes refuse.
    row_max = jnp.max(jnp.abs(d_lse), axis=-1)
    d_lse_max = jnp.max(row_max.reshape(*lead, heads_kv, heads_q // heads_kv), axis=-1)
    e_c = jnp.maximum(_exponent(_slice_max_row_norm(d_o, heads_kv)) + 1 + _V_ROW_NORM_EXPONENT,
                      jnp.where(d_lse_max > 0, _exponent(d_lse_max) + e_v, jnp.iinfo(jnp.int32).min // 2)) + 1
    e_do = scheme.score_grad_exponent - scheme.probability_shift - 1 - e_c
    return s, e_v, e_do


def _power_of_two_factors(exponent: jax.Array) -> list[jax.Array]:
    """float32 powers of two whose product is 2^exponent (each a normal float32, so exact), for |exponent| up to
    4 * 126 (the gradients' exponents reach about 450 for operands near float32's subnormals): the elements are then scaled by float32 multiplications, which XLA fuses into the conversion at memory
    speed (``jnp.ldexp`` per element costs a frexp and integer arithmetic each). Applied in turn they move the
    value one way only, so no intermediate product leaves the range of a representable result."""
    factors = []
    remaining = exponent
    for _ in range(4):
        step = jnp.clip(remaining, -126, 126)
        factors.append(jnp.ldexp(jnp.float32(1.0), step))
        remaining = remaining - step
    return factors


def _times_power_of_two(x: jax.Array, exponent: jax.Array) -> jax.Array:
    for factor in _power_of_two_factors(exponent):
        x = x * factor
    return x


def _scaled(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x`` ``[..., S, H, D]`` times 2^exponent of its slice (``exponent`` ``[..., Hkv]``), in float32."""
    grouped = _grouped(x, exponent.shape[-1]).astype(jnp.float32)
    return _times_power_of_two(grouped, exponent[..., None, :, None, None]).reshape(x.shape)


def _scaled_rows(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x`` ``[..., Hq, Sq]`` (lse-shaped) times 2^exponent of its slice (``exponent`` ``[..., Hkv]``)."""
    *lead, heads_q, seqlen_q = x.shape
    heads_kv = exponent.shape[-1]
    grouped = x.reshape(*lead, heads_kv, heads_q // heads_kv, seqlen_q)
    return _times_power_of_two(grouped, exponent[..., None, None]).reshape(x.shape)


def backward(call: GradCall, q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array,
             d_o: jax.Array, d_lse: jax.Array,
             scheme: Scheme = FLOAT16_OPERANDS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` float32 of a float32 call through ``call(q, k, v, o, lse, d_o, d_lse)``, the backward
    custom call on the scaled operands with float32 gradients (its masks and attributes bound, its softmax scale
    ``scheme.softmax_scale`` of the call's). The operands are
    float16 (``FLOAT16_OPERANDS``, the TF32 mode), or the scaled float32 operands themselves (``FLOAT16_PARTS``,
    ``float32_precision="highest"``), which the float16-parts kernels split into float16 hi + lo parts
    (csrc/cuda/sm90/float16_parts_backward_launch.h): the bounds above keep hi in range (and lo, about 2^-11 of it).
    Scaling by powers of two is exact, so a kernel that computes in float32 (the CPU's) returns the unscaled call's
    gradients to float32 rounding."""
    d_lse = d_lse.astype(jnp.float32)
    s, e_v, e_do = operand_exponents(q, k, v, o, d_o, d_lse, scheme)
    a = scheme.qk_boost
    p = scheme.probability_shift
    lse_shifted = lse - jnp.float32(p * np.log(2.0))

    def operand(x: jax.Array, exponent: jax.Array) -> jax.Array:
        return _scaled(x, exponent).astype(scheme.operand_dtype)

    dq, dk, dv = call(operand(q, s + a), operand(k, a - s), operand(v, e_v), operand(o, e_v), lse_shifted,
                      operand(d_o, e_do), _scaled_rows(d_lse, e_do + e_v))
    # dS' = 2^(p + e_do + e_v) dS; with the call's scale 2^-2a scale, dQ' = scale' dS' K' = 2^(p + e_do + e_v - a - s)
    # scale dS K, dK' = scale' dS'^T Q' = 2^(p + e_do + e_v - a + s) scale dS^T Q, and dV' = P'^T dO'.
    score_grad_exponent = p + e_do + e_v - a
    return (_scaled(dq, -(score_grad_exponent - s)), _scaled(dk, -(score_grad_exponent + s)),
            _scaled(dv, -(p + e_do)))
