"""The TF32-class backward on scaled float16 operands (``JAX_FLASH_SM90_TF32_BACKWARD_FP16=1``, jax_flash/_half_operands.py):
its powers of two keep every float16 operand, probability and score gradient in range, the backward call carries
float16 operands with float32 gradients only where the switch and the call's form allow, and the gradients are
those of float16-rounded operands: within the TF32 bound of the float64 reference, and visibly not the float32
ones (so the scaled path is what ran). On the CPU (CI) the reference handler runs the scaled operands; on a Hopper GPU
(tests/test_cuda.py) the 16-bit Hopper backward does."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi_calls, _half_operands
from attention_cases import (TF32_ROUNDING, Case, assert_within_bound, backward_call_operand_types,
                              block_structured_mask, feature_kwargs, gradient_inputs, max_error, oracle_grads,
                              set_path_switch)

def _grads(q, k, v, d_o, d_lse, **kwargs):
    """A fresh jitted gradient function (jit's trace cache does not know the switch, read when traced)."""
    def loss(q_, k_, v_):
        o, lse = jax_flash.attention(q_, k_, v_, return_lse=True, **kwargs)
        return jnp.sum(o * d_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _inputs(case: Case, scales=(1.0, 1.0, 1.0, 1.0)):
    return gradient_inputs(case, scales, seed_offset=99)


@pytest.mark.parametrize("scales", ((1.0, 1.0, 1.0, 1.0), (1e-4, 3e3, 1e4, 1e-5), (30.0, 0.02, 1e-3, 5e3),
                                    (1e-20, 1e20, 1e-25, 1e25)),
                         ids=("unit", "spread", "spread2", "extreme"))
def test_scaled_operands_stay_in_float16_range(scales):
    case = Case(batch=2, seqlen_q=40, seqlen_k=56, heads_q=4, heads_kv=2, head_dim=64, seed=3)
    q, k, v, d_o, d_lse = _inputs(case, scales)
    o = jax_flash.attention(q, k, v, implementation="xla")
    s, e_v, e_do = _half_operands.operand_exponents(q, k, v, o, d_o, d_lse)
    assert s.shape == e_v.shape == e_do.shape == (case.batch, case.heads_kv)
    q_half, k_half = _half_operands._scaled(q, s), _half_operands._scaled(k, -s)
    # Per slice: the scores are untouched, and both factors sit well inside float16's normal range.
    for b in range(case.batch):
        for h in range(case.heads_kv):
            q_max = np.abs(np.asarray(q_half)[b, :, 2 * h:2 * h + 2]).max()
            k_max = np.abs(np.asarray(k_half)[b, :, h]).max()
            assert 2.0 ** -4 < q_max < 2.0 ** 15 and 2.0 ** -4 < k_max < 2.0 ** 15
            v_norms = np.linalg.norm(np.asarray(_half_operands._scaled(v, e_v))[b, :, h], axis=-1)
            assert 2.0 ** 3 <= v_norms.max() < 2.0 ** 4
    def scores(q_, k_):
        k64 = np.repeat(np.asarray(k_, np.float64), case.heads_q // case.heads_kv, axis=2)
        return np.einsum("bqhd,bkhd->bhqk", np.asarray(q_, np.float64), k64)
    np.testing.assert_array_equal(scores(q_half, k_half), scores(q, k))  # powers of two: exact
    o, lse = jax_flash.attention(q, k, v, return_lse=True)
    _, score_grads = _kernel_emulation(q, k, v, d_o, d_lse, lse, o, 1.0 / np.sqrt(case.head_dim), causal=False)
    largest = np.abs(score_grads).max(axis=(2, 3))  # per (batch row, query head)
    assert np.all(largest < 2.0 ** 14)
    # ... and not near float16's subnormals either (2^-14): the Cauchy-Schwarz bound is loose (here by ~2^9), but
    # the largest score gradient stays far above 1, so its row's small ones keep their 11 bits.
    assert np.all(largest > 4.0)


def test_exponents_leave_zero_and_non_finite_tensors_unscaled():
    zeros = jnp.zeros((1, 3, 1, 64), jnp.float32)
    s, e_v, e_do = (int(e[0, 0]) for e in _half_operands.operand_exponents(zeros, zeros, zeros, zeros, zeros,
                                                                           jnp.zeros((1, 1, 3))))
    assert s == 0 and e_v == _half_operands._V_ROW_NORM_EXPONENT
    nan = zeros.at[0, 0, 0, 0].set(jnp.nan)
    s, _, _ = (int(e[0, 0])
               for e in _half_operands.operand_exponents(nan, nan, zeros, zeros, zeros, jnp.zeros((1, 1, 3))))
    assert s == 0


def _backward_gradient_dtypes(q, k, v, platforms=None, **kwargs):
    """"f16" or "f32" per backward custom call in the jitted gradient of a float32 call (lowered for ``platforms``):
    its operands' type."""
    def loss(q_, k_, v_):
        return jnp.sum(jax_flash.attention(q_, k_, v_, **kwargs))
    calls = backward_call_operand_types(loss, q, k, v, platforms=platforms)
    assert calls
    return ["f16" if "xf16>" in call else "f32" for call in calls], calls


@pytest.mark.parametrize("switch,kwargs,expected", (
    ("1", {}, "f16"),
    ("1", {"causal": True}, "f16"),
    ("0", {}, "f32"),
    ("", {}, "f32"),  # unset: off without a Hopper GPU
    ("hopper", {}, "f16"),  # unset: on where every GPU is a Hopper, in calls lowered for CUDA
    ("hopper-cpu", {}, "f32"),  # but not on its CPU: the reference stays exact
    ("1", {"float32_precision": "highest"}, "f32"),
    ("1", {"softcap": 20.0}, "f16"),  # the transforms form
    ("1", {"mask": jnp.ones((2, 1, 33, 40), bool)}, "f16"),  # the masked form
    ("1", {"bias": jnp.zeros((2, 1, 33, 40))}, "f32"),  # no bias form
    ("1", {"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}, "f32"),
    ("1", {"deterministic": True}, "f16"),  # the separate dQ pass
    ("1", {"fused_dq": "0"}, "f16"),  # likewise
))
def test_switch_and_form_choose_the_half_operand_call(switch, kwargs, expected, monkeypatch):
    platforms = set_path_switch(monkeypatch, _ffi_calls.HALF_OPERANDS_BACKWARD_ENV, switch)
    kwargs = dict(kwargs)
    if "fused_dq" in kwargs:
        monkeypatch.setenv("JAX_FLASH_FUSED_DQ", kwargs.pop("fused_dq"))
    q, k, v = Case(seqlen_q=33, seqlen_k=40, head_dim=64, seed=1).inputs()
    kinds, calls = _backward_gradient_dtypes(q, k, v, platforms, **kwargs)
    assert kinds == [expected], calls


@pytest.mark.parametrize("head_dim,kwargs,expected", (
    (8, {}, "f16"), (48, {}, "f16"), (136, {}, "f16"), (256, {}, "f16"),
    (100, {}, "f32"), (36, {}, "f32"),  # TMA rows: multiples of 8
    (264, {}, "f32"),  # no kernel above 256
    (192, {"softcap": 20.0}, "f32"), (256, {"causal": True}, "f16"),  # no transforms / masked form above 128
))
def test_head_dims_choose_the_half_operand_call(head_dim, kwargs, expected, monkeypatch):
    monkeypatch.setenv(_ffi_calls.HALF_OPERANDS_BACKWARD_ENV, "1")
    q, k, v = Case(seqlen_q=9, seqlen_k=9, head_dim=head_dim, seed=2).inputs()
    kinds, calls = _backward_gradient_dtypes(q, k, v, **kwargs)
    assert kinds == [expected], calls


@pytest.mark.parametrize("feature", ("none", "causal", "window", "seqlens", "segments", "softcap", "alibi",
                                     "alibi_batched_causal", "mask"))
@pytest.mark.parametrize("scales", ((1.0, 1.0, 1.0, 1.0), (1e-3, 1e3, 1e4, 1e-5), (1e-20, 1e20, 1e-25, 1e25)),
                         ids=("unit", "spread", "extreme"))
def test_gradients_are_those_of_float16_operands(feature, scales, monkeypatch):
    """Within the TF32 bound of the float64 reference, operands spread far past float16's range included (unscaled,
    q * 1e3 and v * 1e4 would not fit; dO * 1e-5 would be mostly subnormal), and farther from the reference than
    the float32 backward (the scaled path ran)."""
    case = Case(batch=2, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=64, seed=len(feature))
    q, k, v, d_o, d_lse = _inputs(case, scales)
    if feature == "mask":  # the masked form; fully hidden rows and blocks included
        kwargs = {"mask": block_structured_mask((case.batch, 1, case.seqlen_q, case.seqlen_k), case.seed)}
    else:
        kwargs = feature_kwargs(feature, case)
    monkeypatch.setenv(_ffi_calls.HALF_OPERANDS_BACKWARD_ENV, "1")
    ours = _grads(q, k, v, d_o, d_lse, **kwargs)
    monkeypatch.setenv(_ffi_calls.HALF_OPERANDS_BACKWARD_ENV, "0")
    exact = _grads(q, k, v, d_o, d_lse, **kwargs)
    references = oracle_grads(q, k, v, d_o, d_lse=d_lse, **kwargs)
    for name, g, g_exact, reference in zip(("dq", "dk", "dv"), ours, exact, references):
        assert g.dtype == jnp.float32
        # The float32 CPU result stands in for XLA (its error counts as at least TF32's rounding, tf32=True).
        assert_within_bound(name, g, g_exact, reference, jnp.float32, scale=4.0, tf32=True)
        magnitude = float(np.max(np.abs(reference)))
        assert max_error(g, reference) > 10 * max(max_error(g_exact, reference), 1e-7 * magnitude), name


def test_gradients_of_float16_operands_under_vmap(monkeypatch):
    """Each example of a vmapped call scales its own operands (a batch of very different magnitudes)."""
    monkeypatch.setenv(_ffi_calls.HALF_OPERANDS_BACKWARD_ENV, "1")
    case = Case(batch=1, seqlen_q=24, seqlen_k=24, heads_q=2, heads_kv=2, head_dim=64, seed=5)
    inputs = [_inputs(case, (s, 1.0 / s, s, 1.0)) for s in (1e-3, 1.0, 1e3)]
    q, k, v, d_o, d_lse = (jnp.stack(x) for x in zip(*inputs))

    def loss(q_, k_, v_, d_o_):
        return jnp.sum(jax_flash.attention(q_, k_, v_) * d_o_)
    per_example = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, d_o)
    for i in range(3):
        references = oracle_grads(q[i], k[i], v[i], d_o[i])
        for name, g, reference in zip(("dq", "dk", "dv"), per_example, references):
            magnitude = max(1e-30, float(np.max(np.abs(reference))))
            error = max_error(g[i], reference)
            # TF32-class, and not float32's (~1e-7): the float16 operands ran.
            assert 1e-6 * magnitude < error <= 8 * TF32_ROUNDING * magnitude, (name, i)


def test_raw_target_takes_float32_gradients_of_float16_operands_only_all_three():
    """The backward target's gradients take q's type, or float32 for all three of a float16 call: those of the
    float16 results before their rounding (CPU: the same float32 sums); other mixes are errors naming the buffer."""
    from jax_flash import _registration
    from jax_flash._config import ScoreConfig

    case = Case(batch=2, seqlen_q=33, seqlen_k=20, heads_q=4, heads_kv=2, head_dim=64, dtype=jnp.float16, seed=9)
    q, k, v = case.inputs()
    masks = [jnp.zeros((2, 0), jnp.float32)] + [jnp.zeros((2, 0), jnp.int32)] * 4
    dense = [jnp.zeros((1, 1, 1, 0), jnp.float32), jnp.zeros((1, 1, 1, 0), bool), jnp.zeros((1, 1, 1, 0), jnp.uint8),
             jnp.zeros((2, 0), jnp.uint32)]
    config = ScoreConfig(softmax_scale=0.125)
    stats = jax.ShapeDtypeStruct((2, 4, 33), jnp.float32)
    o, lse, _ = jax.ffi.ffi_call(_registration.FORWARD_TARGET, (jax.ShapeDtypeStruct(q.shape, q.dtype), stats,
                                                                jax.ShapeDtypeStruct((0,), jnp.float32)))(
        q, k, v, *masks, *dense, **_ffi_calls._forward_attributes(config))
    d_o = jax.random.normal(jax.random.key(1), q.shape, jnp.float32).astype(jnp.float16)

    def backward(*dtypes, operands=(q, k, v, o)):
        q_, k_, v_, o_ = operands
        call = jax.ffi.ffi_call(_registration.BACKWARD_TARGET, (
            jax.ShapeDtypeStruct(q.shape, dtypes[0]), jax.ShapeDtypeStruct(k.shape, dtypes[1]),
            jax.ShapeDtypeStruct(v.shape, dtypes[2]), stats, jax.ShapeDtypeStruct((0,), jnp.float32),
            jax.ShapeDtypeStruct((0,), jnp.float32), jax.ShapeDtypeStruct((1, 1, 1, 0), jnp.float32)))
        return jax.block_until_ready(call(q_, k_, v_, o_, lse, d_o.astype(q_.dtype), jnp.zeros_like(lse), *masks,
                                          *dense, **_ffi_calls._score_attributes(config), deterministic=False))[:3]

    float32_grads = backward(jnp.float32, jnp.float32, jnp.float32)
    for got, rounded in zip(float32_grads, backward(jnp.float16, jnp.float16, jnp.float16)):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float16)), np.asarray(rounded))
        assert np.any(np.asarray(got) != np.asarray(rounded.astype(jnp.float32)))  # unrounded
    with pytest.raises(Exception, match="dk"):
        backward(jnp.float32, jnp.float16, jnp.float32)
    with pytest.raises(Exception, match="dq"):
        backward(jnp.float32, jnp.bfloat16, jnp.bfloat16,
                 operands=tuple(x.astype(jnp.bfloat16) for x in (q, k, v, o)))


def _block_grads(q, k, v, o, lse, d_o, d_lse, switch, monkeypatch):
    """The backward custom call(s) of one key block against the whole sequence's o and lse (as ring attention's
    blocks run it, _ring.py), with the switch as given."""
    from jax_flash._config import DenseOperands, MaskOperands, ScoreConfig

    monkeypatch.setenv(_ffi_calls.HALF_OPERANDS_BACKWARD_ENV, switch)
    batch = q.shape[0]
    masks = MaskOperands(jnp.zeros((batch, 0), jnp.float32), *(jnp.zeros((batch, 0), jnp.int32) for _ in range(4)))
    config = ScoreConfig(softmax_scale=1.0 / np.sqrt(q.shape[-1]), allow_tf32=True)
    return _ffi_calls.backward(q, k, v, o, lse, d_o, d_lse, masks, config, DenseOperands.absent(batch))


def test_a_key_block_with_the_whole_sequences_output(monkeypatch):
    """Ring attention's block backward: o and lse are the whole sequence's, the keys one block's, whose v may be far
    smaller than o (o is then no mix of this v's rows): v and o share the larger norm's factor, so o' stays in
    float16's range (from v alone it overflowed: inf gradients)."""
    case = Case(batch=1, seqlen_q=40, seqlen_k=128, heads_q=2, heads_kv=2, head_dim=64, seed=21)
    q, k, v, d_o, d_lse = _inputs(case)
    v = v.at[:, 64:].multiply(1e-5)
    o, lse = jax_flash.attention(q, k, v, return_lse=True, implementation="xla")
    block = (slice(None), slice(64, None))
    exact = _block_grads(q, k[block], v[block], o, lse, d_o, d_lse, "0", monkeypatch)
    ours = _block_grads(q, k[block], v[block], o, lse, d_o, d_lse, "1", monkeypatch)
    for name, g, g_exact in zip(("dq", "dk", "dv"), ours, exact):
        g, g_exact = np.asarray(g, np.float64), np.asarray(g_exact, np.float64)
        assert np.all(np.isfinite(g)), name
        assert np.max(np.abs(g - g_exact)) <= 8 * TF32_ROUNDING * np.max(np.abs(g_exact)), name


def test_an_lse_cotangent_larger_than_the_scores_gradients(monkeypatch):
    """A dlse 100x |dO| |V| (the merge of ring blocks gives dlse of the order of |dO| |V|): dO' stays well inside
    float16's normal range, every gradient within the TF32 bound (README says where this stops: ~1000x)."""
    case = Case(batch=2, seqlen_q=50, seqlen_k=60, heads_q=4, heads_kv=2, head_dim=64, seed=23)
    q, k, v, d_o, d_lse = _inputs(case)
    d_lse = 100.0 * d_lse * float(jnp.max(jnp.linalg.norm(d_o, axis=-1)) * jnp.max(jnp.linalg.norm(v, axis=-1)))
    monkeypatch.setenv(_ffi_calls.HALF_OPERANDS_BACKWARD_ENV, "1")
    ours = _grads(q, k, v, d_o, d_lse)
    monkeypatch.setenv(_ffi_calls.HALF_OPERANDS_BACKWARD_ENV, "0")
    exact = _grads(q, k, v, d_o, d_lse)
    for name, g, g_exact, reference in zip(("dq", "dk", "dv"), ours, exact,
                                           oracle_grads(q, k, v, d_o, d_lse=d_lse)):
        assert_within_bound(name, g, g_exact, reference, jnp.float32, scale=4.0, tf32=True)


@pytest.mark.parametrize("shape", ((1, 300, 8, 1, 64), (17, 17, 4, 2, 72), (257, 130, 6, 2, 128), (1000, 40, 2, 2, 96),
                                   (33, 70, 4, 2, 192), (70, 33, 2, 1, 256), (20, 30, 2, 2, 40)),
                         ids=("1x300-mqa", "17x17-gqa", "257x130-causal", "1000x40", "d192", "d256-causal",
                              "d40-deterministic"))
def test_odd_shapes_and_head_dims(shape, monkeypatch):
    """One query, 17, 1000; GQA / MQA; head dims between the kernels' (the GPU pads them to the next one), the wide
    ones (the split-head-dim dK/dV kernel and the separate dQ pass) and a deterministic call (the dQ pass too)."""
    seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    case = Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                seed=seqlen_q + head_dim)
    q, k, v, d_o, d_lse = _inputs(case)
    kwargs = {"causal": True} if seqlen_q in (257, 70) else {"deterministic": True} if head_dim == 40 else {}
    monkeypatch.setenv(_ffi_calls.HALF_OPERANDS_BACKWARD_ENV, "1")
    assert _backward_gradient_dtypes(q, k, v, **kwargs)[0] == ["f16"]
    ours = _grads(q, k, v, d_o, d_lse, **kwargs)
    monkeypatch.setenv(_ffi_calls.HALF_OPERANDS_BACKWARD_ENV, "0")
    exact = _grads(q, k, v, d_o, d_lse, **kwargs)
    for name, g, g_exact, reference in zip(("dq", "dk", "dv"), ours, exact,
                                           oracle_grads(q, k, v, d_o, d_lse=d_lse, **kwargs)):
        assert_within_bound(name, g, g_exact, reference, jnp.float32, scale=4.0, tf32=True)


def _kernel_emulation(q, k, v, d_o, d_lse, lse, o, softmax_scale, causal):
    """``((dq, dk, dv), dS')``: the gradients the Hopper kernel computes from the module's operands, in float64 NumPy
    with the kernel's float16 roundings where it makes them: the operands, P' (the dV GEMM's register operand) and
    dS' (the dK and dQ GEMMs' operand), which is also returned, [B, Hq, Sq, Sk] before its rounding; S, dP and the
    sums exact (the tensor cores' float32 accumulation is not modelled)."""
    s, e_v, e_do = _half_operands.operand_exponents(q, k, v, o, d_o, d_lse)
    halves = [np.asarray(_half_operands._scaled(x, e).astype(jnp.float16), np.float64)
              for x, e in ((q, s), (k, -s), (v, e_v), (o, e_v), (d_o, e_do))]
    q16, k16, v16, o16, do16 = halves
    lse_shifted = np.asarray(lse, np.float64) - _half_operands.FLOAT16_OPERANDS.probability_shift * np.log(2.0)
    d_lse_scaled = np.asarray(_half_operands._scaled_rows(d_lse, e_do + e_v), np.float64)
    group = q.shape[2] // k.shape[2]
    k16, v16 = np.repeat(k16, group, axis=2), np.repeat(v16, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q16, k16) * softmax_scale
    if causal:  # bottom-right aligned, as jax_flash's default
        sq, sk = q.shape[1], k.shape[1]
        hidden = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
        scores = np.where(hidden, -np.inf, scores)
    probs = np.exp(scores - lse_shifted[..., None])
    probs16 = probs.astype(np.float16).astype(np.float64)
    dv = np.einsum("bhqk,bqhd->bkhd", probs16, do16)
    d_probs = np.einsum("bqhd,bkhd->bhqk", do16, v16)
    softmax_d = np.einsum("bqhd,bqhd->bhq", do16, o16) - d_lse_scaled
    score_grads = probs * (d_probs - softmax_d[..., None])
    assert np.max(np.abs(score_grads)) < 2.0 ** 15, "dS' would overflow float16"
    ds16 = score_grads.astype(np.float16).astype(np.float64)
    dq = softmax_scale * np.einsum("bhqk,bkhd->bqhd", ds16, k16)
    dk = softmax_scale * np.einsum("bhqk,bqhd->bkhd", ds16, q16)
    sum_groups = lambda x: x.reshape(*x.shape[:2], k.shape[2], group, x.shape[-1]).sum(axis=3)  # noqa: E731
    dk, dv = sum_groups(dk), sum_groups(dv)
    p = _half_operands.FLOAT16_OPERANDS.probability_shift
    exponent = p + e_do + e_v
    grads = (np.asarray(_half_operands._scaled(jnp.asarray(dq, jnp.float32), -(exponent - s))),
             np.asarray(_half_operands._scaled(jnp.asarray(dk, jnp.float32), -(exponent + s))),
             np.asarray(_half_operands._scaled(jnp.asarray(dv, jnp.float32), -(p + e_do))))
    return grads, score_grads


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("scales", ((1.0, 1.0, 1.0, 1.0), (1e-3, 1e3, 1e4, 1e-5), (1e-20, 1e20, 1e-25, 1e25)),
                         ids=("unit", "spread", "extreme"))
def test_the_kernels_float16_roundings_stay_within_the_tf32_bound(scales, causal):
    """What CI's reference handler cannot show (it keeps P' and dS' in float32): with the kernel's float16 roundings
    of P' and dS' too, emulated, the gradients meet the TF32 bound (and dS' fits float16: asserted inside)."""
    case = Case(batch=1, seqlen_q=300, seqlen_k=1000, heads_q=4, heads_kv=2, head_dim=64, seed=31)
    q, k, v, d_o, d_lse = _inputs(case, scales)
    softmax_scale = 1.0 / np.sqrt(case.head_dim)
    o, lse = jax_flash.attention(q, k, v, causal=causal, return_lse=True)
    emulated, _ = _kernel_emulation(q, k, v, d_o, d_lse, lse, o, softmax_scale, causal)
    references = oracle_grads(q, k, v, d_o, d_lse=d_lse, causal=causal)
    exact = _grads(q, k, v, d_o, d_lse, causal=causal)
    for name, g, g_exact, reference in zip(("dq", "dk", "dv"), emulated, exact, references):
        assert_within_bound(name, g, g_exact, reference, jnp.float32, scale=4.0, tf32=True)


def test_the_probability_shift_keeps_long_sequences_within_the_bound():
    """262144 keys of near-uniform attention: each P is ~2^-18, a float16 subnormal with 6 significant bits unless
    shifted. With P' = 2^7 P the emulated kernel's dv is within the TF32 bound (6.5e-4 of its largest); unshifted it
    was 8.0e-3, twice the bound (this test fails with FLOAT16_OPERANDS's probability_shift = 0)."""
    case = Case(batch=1, seqlen_q=4, seqlen_k=262144, heads_q=2, heads_kv=1, head_dim=64, seed=5)
    q, k, v, d_o, d_lse = _inputs(case, (1e-2, 1.0, 1.0, 1.0))
    o, lse = jax_flash.attention(q, k, v, return_lse=True)
    emulated, _ = _kernel_emulation(q, k, v, d_o, d_lse, lse, o, 1.0 / np.sqrt(case.head_dim), False)
    references = oracle_grads(q, k, v, d_o, d_lse=d_lse)
    for name, g, reference in zip(("dq", "dk", "dv"), emulated, references):
        magnitude = float(np.max(np.abs(reference)))
        # The TF32 bound (assert_within_bound's with tf32=True, XLA's error counted as TF32's rounding), no atol.
        assert max_error(g, reference) <= 2 * 4 * TF32_ROUNDING * magnitude, name
