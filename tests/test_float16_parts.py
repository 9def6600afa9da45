"""float32_precision="highest" with JAX_FLASH_SM90_HIGHEST_BACKWARD_FP16=1: the backward runs on float16 hi and lo parts
of operands scaled by powers of two (jax_flash/_half_operands.py, csrc/cuda/sm90/float16_parts_backward_launch.h).
Here, on the CPU: which calls the switch routes (float32 operands with a float16 parts workspace in the call's
dq_accum slot), that the routed call's gradients are the exact mode's (the reference handler computes the scaled
float32 operands in float32, and scaling by powers of two is exact), and, emulated in float64 NumPy, that the
kernel's float16 parts of the operands, of P' and of dS' keep the gradients within the exact mode's 1e-5 of the
float64 reference for inputs of any magnitude. The GPU runs are tests/test_cuda.py's
(test_float32_highest_backward_on_float16_parts)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi_calls, _half_operands, _registration
from attention_cases import Case, feature_kwargs, gradient_inputs, max_error, oracle_grads, set_path_switch

EXACT_FLOAT32_RTOL = 1e-5
# The tiles over which the kernels scale score-gradient rows (csrc/cuda/sm90/backward_traits.h float16_parts_dq_tile's
# keys, float16_parts_dkdv_tile's queries).
DQ_KEY_TILE = 32
DKDV_QUERY_TILE = 32


@pytest.fixture(autouse=True)
def automatic_choices(monkeypatch):
    monkeypatch.delenv("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", raising=False)
    for name in (_ffi_calls.SPLIT_TF32_BACKWARD_ENV, _ffi_calls.HALF_OPERANDS_BACKWARD_ENV):
        monkeypatch.setenv(name, "0")  # whatever their defaults


def _grads_call(float32_precision="highest", **kwargs):
    """A new jitted gradient function (jit's trace cache does not know the switch, read when traced); the loss
    carries an lse cotangent."""
    def loss(q, k, v, d_o, d_lse):
        out, lse = jax_flash.attention(q, k, v, float32_precision=float32_precision, return_lse=True, **kwargs)
        return jnp.sum(out * d_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _inputs(case: Case, scales=(1.0, 1.0, 1.0, 1.0)):
    return gradient_inputs(case, scales, seed_offset=5)


def _backward_lines(call, *args, platforms=None) -> list[str]:
    text = call.trace(*args).lower(lowering_platforms=platforms).as_text()
    return [line for line in text.splitlines() if f"@{_registration.BACKWARD_TARGET}" in line]


def _parts_workspace(q, k) -> str:
    return "tensor<{}x{}x{}xf16>".format(*_ffi_calls.backward_parts_workspace_shape(q, k))


def _relative_errors(grads, references) -> dict[str, float]:
    """max |g - reference| / max |reference| per gradient (attention_cases.max_error: finite where the reference
    is), with no floor: the extreme-magnitude cases' gradients are far from 1."""
    return {name: max_error(g, reference) / max(float(np.max(np.abs(reference))), 1e-300)
            for name, g, reference in zip(("dq", "dk", "dv"), grads, references)}


@pytest.mark.parametrize("switch,head_dim,kwargs,expected", (
    ("1", 128, {}, True),
    ("1", 128, {"causal": True}, True),
    ("1", 72, {}, True),
    ("1", 96, {"window_size": (5, 3)}, True),
    ("0", 128, {}, False),
    ("", 128, {}, False),  # unset: off without a Hopper GPU
    ("hopper", 128, {}, True),  # unset: on where every GPU is a Hopper, in calls lowered for CUDA
    ("hopper-cpu", 128, {}, False),  # but not on its CPU
    ("1", 64, {}, False),  # up to 64: split TF32 or the exact kernels
    ("1", 100, {}, False),  # float16 TMA rows: multiples of 8
    ("1", 136, {}, False),  # no kernel above 128
    ("1", 128, {"float32_precision": "tf32"}, False),
    ("1", 128, {"softcap": 20.0}, False),  # the common form only
    ("1", 128, {"bias": jnp.zeros((2, 1, 33, 40))}, False),
    ("1", 128, {"mask": jnp.ones((2, 1, 33, 40), bool)}, False),
    ("1", 128, {"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}, False),
))
def test_switch_head_dim_and_form_choose_the_float16_parts(switch, head_dim, kwargs, expected, monkeypatch):
    platforms = set_path_switch(monkeypatch, _ffi_calls.FLOAT16_PARTS_BACKWARD_ENV, switch)
    case = Case(seqlen_q=33, seqlen_k=40, head_dim=head_dim, dtype=jnp.float32, seed=3)
    q, k, v, d_o, d_lse = _inputs(case)
    lines = _backward_lines(_grads_call(**kwargs), q, k, v, d_o, d_lse, platforms=platforms)
    assert len(lines) == 1
    operands = lines[0].split(" : (")[1].split(") -> ")[0]
    assert "xf16>" not in operands, "the float16 parts are the kernels' own: the call's operands stay float32"
    assert (_parts_workspace(q, k) in lines[0]) == expected, lines[0]


def test_float16_parts_take_over_from_split_tf32_from_head_dim_72(monkeypatch):
    monkeypatch.setenv(_ffi_calls.FLOAT16_PARTS_BACKWARD_ENV, "1")
    monkeypatch.setenv(_ffi_calls.SPLIT_TF32_BACKWARD_ENV, "1")
    for head_dim, workspace_type in ((64, "xf32>"), (128, "xf16>")):
        case = Case(seqlen_q=20, seqlen_k=24, head_dim=head_dim, dtype=jnp.float32, seed=4)
        q, k, v, d_o, d_lse = _inputs(case)
        (line,) = _backward_lines(_grads_call(), q, k, v, d_o, d_lse)
        shape = "x".join(map(str, _ffi_calls.backward_parts_workspace_shape(q, k)))
        assert f"tensor<{shape}{workspace_type}" in line, (head_dim, line)


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, feature)
SHAPES = (
    (2, 129, 200, 4, 2, 128, "causal"),
    (1, 1, 300, 8, 2, 128, "none"),       # one query row
    (2, 17, 17, 4, 4, 72, "none"),
    (2, 70, 90, 4, 4, 128, "window"),
    (2, 50, 77, 4, 2, 96, "seqlens"),
    (2, 60, 60, 2, 2, 128, "segments"),
    (1, 300, 257, 8, 1, 128, "causal"),   # MQA
    (1, 1000, 1000, 2, 1, 104, "causal"),
)


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads_q,heads_kv,head_dim,feature", SHAPES)
@pytest.mark.parametrize("scales", ((1.0, 1.0, 1.0, 1.0), (1e-20, 1e20, 1e-25, 1e25)), ids=("unit", "extreme"))
def test_routed_gradients_are_the_exact_modes(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, feature,
                                              scales, monkeypatch):
    case = Case(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv,
                head_dim=head_dim, dtype=jnp.float32, seed=seqlen_k + head_dim)
    q, k, v, d_o, d_lse = _inputs(case, scales)
    kwargs = feature_kwargs(feature, case)
    monkeypatch.setenv(_ffi_calls.FLOAT16_PARTS_BACKWARD_ENV, "1")
    call = _grads_call(**kwargs)
    assert _parts_workspace(q, k) in _backward_lines(call, q, k, v, d_o, d_lse)[0], "the switch did not route"
    routed = call(q, k, v, d_o, d_lse)
    errors = _relative_errors(routed, oracle_grads(q, k, v, d_o, d_lse=d_lse, **kwargs))
    assert max(errors.values()) <= EXACT_FLOAT32_RTOL, errors


def test_routed_gradients_under_vmap(monkeypatch):
    monkeypatch.setenv(_ffi_calls.FLOAT16_PARTS_BACKWARD_ENV, "1")
    case = Case(batch=3, seqlen_q=40, seqlen_k=48, heads_q=4, heads_kv=2, head_dim=128, dtype=jnp.float32, seed=9)
    q, k, v, d_o, _ = _inputs(case)
    # A scale per example (q * c and k / c leave the scores as they were, so the gradients stay well posed).
    scale = jnp.asarray([1e-6, 1.0, 1e6], jnp.float32)[:, None, None, None]
    q, k, v = q * scale, k / scale, v / scale

    def loss(q_, k_, v_, d_o_):
        out = jax_flash.attention(q_[None], k_[None], v_[None], float32_precision="highest", causal=True)[0]
        return jnp.sum(out * d_o_)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, d_o)
    for i in range(case.batch):
        references = oracle_grads(q[i:i + 1], k[i:i + 1], v[i:i + 1], d_o[i:i + 1], causal=True)
        errors = _relative_errors([g[i:i + 1] for g in grads], references)
        assert max(errors.values()) <= EXACT_FLOAT32_RTOL, (i, errors)


def _parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float32 array's float16 parts as the kernels form them (split_tf32_mma.h split_to_float16), in float64."""
    x = np.asarray(x, np.float32)
    hi = x.astype(np.float16)
    lo = (x - hi.astype(np.float32)).astype(np.float16)
    assert np.all(np.isfinite(hi)) and np.all(np.isfinite(lo)), "a part overflowed float16"
    return hi.astype(np.float64), lo.astype(np.float64)


def _row_scaled_parts(x: np.ndarray, row_axis: int, col_axis: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The float16 parts of score gradients as the kernels form them (csrc/cuda/sm90/row_scaled_parts.h), in float64
    and scaled back: each row's elements within one tile of ``block`` columns multiplied by 2^(12 - e), e = floor(log2)
    of their largest magnitude, split, and divided by the same power of two (exact)."""
    x = np.moveaxis(np.asarray(x, np.float32), (row_axis, col_axis), (-2, -1))
    cols = x.shape[-1]
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -cols % block)])
    tiles = padded.reshape(*padded.shape[:-1], -1, block)
    largest = np.max(np.abs(tiles), axis=-1, keepdims=True)
    exponent = np.clip(np.floor(np.log2(np.where(largest > 0, largest, 1.0))), -100, 100)
    scale = np.exp2(12 - exponent).astype(np.float32)
    hi, lo = _parts(tiles * scale)
    parts = []
    for part in (hi, lo):
        part = (part / scale).reshape(padded.shape)[..., :cols]
        parts.append(np.moveaxis(part, (-2, -1), (row_axis, col_axis)))
    return parts[0], parts[1]


def _parts_product(spec: str, a: np.ndarray, b: np.ndarray, a_parts=None) -> np.ndarray:
    """einsum(spec, a, b) as the kernels compute it: lo*hi + hi*lo + hi*hi of float16 parts (``a_parts`` a's, if
    formed otherwise), the sums exact."""
    (a_hi, a_lo), (b_hi, b_lo) = a_parts or _parts(a), _parts(b)
    return np.einsum(spec, a_lo, b_hi) + np.einsum(spec, a_hi, b_lo) + np.einsum(spec, a_hi, b_hi)


def _kernel_emulation(q, k, v, o, d_o, d_lse, lse, softmax_scale, causal):
    """The gradients the float16-parts kernels compute from the scaled operands (_half_operands.backward with
    FLOAT16_PARTS), in float64 NumPy: every GEMM on float16 parts of its float32 operands (the pre-pass's parts of q',
    k', v', dO'; the consumers' parts of P' and of dS', its rows scaled by powers of two, both formed in float32); S,
    dP, the softmax and D
    in float64 (float32 in the kernels: the floor every float32 scheme shares), the sums exact (the accumulation,
    which the kernels sum item by item, is benchmarks/emulate_split_products.py's subject)."""
    scheme = _half_operands.FLOAT16_PARTS
    s, e_v, e_do = _half_operands.operand_exponents(q, k, v, o, d_o, d_lse, scheme)
    a = scheme.qk_boost
    scaled = [np.asarray(_half_operands._scaled(x, e), np.float32)
              for x, e in ((q, s + a), (k, a - s), (v, e_v), (o, e_v), (d_o, e_do))]
    softmax_scale = scheme.softmax_scale(softmax_scale)  # the call's
    q32, k32, v32, o32, do32 = scaled
    p = scheme.probability_shift
    lse_shifted = np.asarray(lse, np.float64) - p * np.log(2.0)
    d_lse_scaled = np.asarray(_half_operands._scaled_rows(d_lse, e_do + e_v), np.float64)
    group = q.shape[2] // k.shape[2]
    k32, v32 = np.repeat(k32, group, axis=2), np.repeat(v32, group, axis=2)
    scores = _parts_product("bqhd,bkhd->bhqk", q32, k32) * softmax_scale
    if causal:  # bottom-right aligned, as jax_flash's default
        sq, sk = q.shape[1], k.shape[1]
        hidden = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
        scores = np.where(hidden, -np.inf, scores)
    probs = np.exp(scores - lse_shifted[..., None]).astype(np.float32)
    dv = _parts_product("bhqk,bqhd->bkhd", probs, do32)
    d_probs = _parts_product("bqhd,bkhd->bhqk", do32, v32)
    softmax_d = np.einsum("bqhd,bqhd->bhq", np.float64(do32), np.float64(o32)) - d_lse_scaled
    score_grads = (probs * (d_probs - softmax_d[..., None])).astype(np.float32)  # [b, h, q, k]
    # Rows scaled per tile: the dQ pass's dS by query over 32-key tiles, the dK/dV pass's dS^T by key over
    # 32-query items (backward_traits.h float16_parts_dq_tile / float16_parts_dkdv_tile).
    dq = softmax_scale * _parts_product("bhqk,bkhd->bqhd", score_grads, k32,
                                        _row_scaled_parts(score_grads, 2, 3, DQ_KEY_TILE))
    dk = softmax_scale * _parts_product("bhqk,bqhd->bkhd", score_grads, q32,
                                        _row_scaled_parts(score_grads, 3, 2, DKDV_QUERY_TILE))
    sum_groups = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, x.shape[-1]).sum(axis=3)  # noqa: E731
    dk, dv = sum_groups(dk), sum_groups(dv)
    exponent = p + e_do + e_v - a
    return (np.asarray(_half_operands._scaled(jnp.asarray(dq, jnp.float32), -(exponent - s))),
            np.asarray(_half_operands._scaled(jnp.asarray(dk, jnp.float32), -(exponent + s))),
            np.asarray(_half_operands._scaled(jnp.asarray(dv, jnp.float32), -(p + e_do))))


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("scales", ((1.0, 1.0, 1.0, 1.0), (1e-3, 1e3, 1e4, 1e-5), (1e-20, 1e20, 1e-25, 1e25),
                                    (1e-3, 1e-3, 1.0, 1.0)),
                         ids=("unit", "spread", "extreme", "small_qk"))  # small_qk: 1.8e-5 without qk_boost
def test_the_kernels_float16_parts_stay_within_the_exact_bound(scales, causal):
    """What CI's reference handler cannot show (it computes in float32): with the kernel's float16 parts of every
    GEMM operand, emulated, the gradients stay within the exact mode's 1e-5 of the float64 reference (and no part
    overflows float16: asserted inside)."""
    case = Case(batch=1, seqlen_q=300, seqlen_k=700, heads_q=4, heads_kv=2, head_dim=128, dtype=jnp.float32,
                seed=41)
    q, k, v, d_o, d_lse = _inputs(case, scales)
    o, lse = jax_flash.attention(q, k, v, causal=causal, return_lse=True, float32_precision="highest")
    emulated = _kernel_emulation(q, k, v, o, d_o, d_lse, lse, 1.0 / np.sqrt(case.head_dim), causal)
    errors = _relative_errors(emulated, oracle_grads(q, k, v, d_o, d_lse=d_lse, causal=causal))
    assert max(errors.values()) <= EXACT_FLOAT32_RTOL, errors


def test_long_sequences_keep_whole_lo_parts():
    """65536 keys of spread attention (P ~ 2^-16): with the TF32 mode's scales (P' = 2^7 P, dO' of row norm ~1) the
    lo parts of P' and dO' would be float16 subnormals (dv ~5e-6 off here), and with one static scale for dS' its
    (dq, dk 1.5e-5); with FLOAT16_PARTS' (P' = 2^14 P, dO' ~2^6) and dS's rows scaled in the kernels, the error
    stays at the short sequences' level."""
    case = Case(batch=1, seqlen_q=4, seqlen_k=65536, heads_q=2, heads_kv=1, head_dim=128, dtype=jnp.float32, seed=8)
    q, k, v, d_o, d_lse = _inputs(case, (1e-2, 1.0, 1.0, 1.0))
    o, lse = jax_flash.attention(q, k, v, return_lse=True, float32_precision="highest")
    emulated = _kernel_emulation(q, k, v, o, d_o, d_lse, lse, 1.0 / np.sqrt(case.head_dim), False)
    errors = _relative_errors(emulated, oracle_grads(q, k, v, d_o, d_lse=d_lse))
    assert max(errors.values()) <= 1e-6, errors
