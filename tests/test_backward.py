"""Gradients of the kernels of the default platform against jax.grad of the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
from jax_flash import _ffi_calls, _registration
from attention_cases import (Case, assert_gradients_within_bound, assert_within_bound, bit_identical_runs, feature_kwargs,
                             grads, oracle_grads)

GRAD_FEATURES = ("none", "causal", "window", "softcap", "alibi_batched_causal", "seqlens", "seqlens_causal",
                 "segments", "everything")


def check_gradients(case: Case, **kwargs) -> None:
    q, k, v = case.inputs()
    d_o = jax.random.normal(jax.random.key(case.seed + 99), q.shape, jnp.float32).astype(case.dtype)
    assert_gradients_within_bound(q, k, v, d_o, case.dtype, **kwargs)


@pytest.mark.parametrize("feature", GRAD_FEATURES)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("seqlens", ((33, 33), (20, 150), (150, 20)), ids=lambda s: f"{s[0]}x{s[1]}")
def test_feature_gradients(feature, dtype, seqlens):
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=4, heads_kv=2, head_dim=20, dtype=dtype,
                seed=3 + len(feature))
    check_gradients(case, **feature_kwargs(feature, case))


@pytest.mark.parametrize("head_dim", (1, 7, 64, 100, 256))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16, jnp.float16), ids=lambda d: jnp.dtype(d).name)
def test_head_dim_gradients(head_dim, dtype):
    case = Case(seqlen_q=70, seqlen_k=140, heads_q=3, heads_kv=1, head_dim=head_dim, dtype=dtype, seed=head_dim)
    check_gradients(case, causal=True)


@pytest.mark.parametrize("seqlens", ((1, 1), (1, 300), (300, 1), (1000, 1000)), ids=lambda s: f"{s[0]}x{s[1]}")
def test_long_and_degenerate_gradients(seqlens):
    case = Case(batch=1, seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=2, heads_kv=1, head_dim=32,
                dtype=jnp.bfloat16)
    check_gradients(case, causal=seqlens[0] > 1)


def test_lse_is_differentiable():
    """Cotangents of lse reach dq/dk (ring attention merges partial results through lse)."""
    case = Case(seqlen_q=40, seqlen_k=50)
    q, k, v = case.inputs()
    weights = jax.random.normal(jax.random.key(5), (case.batch, case.heads_q, case.seqlen_q))

    def loss(implementation):
        def f(q_, k_, v_):
            o, lse = jax_flash.attention(q_, k_, v_, causal=True, return_lse=True, implementation=implementation)
            return jnp.sum(o ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * weights)
        return f

    ours = jax.grad(loss(None), argnums=(0, 1, 2))(q, k, v)
    reference = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(ours, reference):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True, softcap=2.0),
                                    dict(window_size=(3, 2), alibi_slopes=jnp.array([0.3, 0.1]))],
                         ids=("plain", "causal_softcap", "window_alibi"))
def test_check_grads_float32(kwargs):
    """Finite differences against our own backward, on small float32 cases."""
    case = Case(batch=1, seqlen_q=6, seqlen_k=9, heads_q=2, heads_kv=1, head_dim=5)
    q, k, v = case.inputs()
    check_grads(lambda q_, k_, v_: jax_flash.attention(q_, k_, v_, **kwargs), (q, k, v), order=1,
                modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_fully_masked_rows_have_finite_zero_gradients():
    case = Case(seqlen_q=12, seqlen_k=8)
    q, k, v = case.inputs()
    kwargs = dict(q_seqlens=jnp.array([12, 4], jnp.int32), kv_seqlens=jnp.array([0, 8], jnp.int32))
    dq, dk, dv = jax.grad(lambda *a: jnp.sum(jax_flash.attention(*a, **kwargs) ** 2), argnums=(0, 1, 2))(q, k, v)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(dq)[0] == 0) and np.all(np.asarray(dq)[1, 4:] == 0)
    assert np.all(np.asarray(dk)[0] == 0) and np.all(np.asarray(dv)[0] == 0)


def test_gradients_are_deterministic():
    case = Case(batch=1, seqlen_q=200, seqlen_k=700, heads_q=2, heads_kv=1, dtype=jnp.bfloat16)
    q, k, v = case.inputs()
    d_o = jnp.ones_like(q)
    bit_identical_runs(lambda: grads(q, k, v, d_o, causal=True, deterministic=True))


def test_fused_dq_workspace_is_declared_where_the_kernels_use_it(monkeypatch):
    """By default (JAX_FLASH_FUSED_DQ unset or 1) a half-precision backward with _FUSED_DQ_MIN_HEAD_DIM (64) <=
    head_dim <= 128 gets a float32 dq_accum result, [batch, heads_q, whole 64-row query tiles x
    head_dim], which the CPU handler accepts and ignores: same gradients as without it. Softcap and ALiBi calls get
    it too (the Hopper backward's transforms form fuses dQ), and so do boolean-mask calls (its masked form).
    Deterministic calls, calls with a bias or dropout, head_dim below _FUSED_DQ_MIN_HEAD_DIM or > 128 and
    JAX_FLASH_FUSED_DQ=0 get none; a bad value is a clear error. The dkdv_tail workspace comes with dq_accum only
    where the sm80 pass can split its last wave: no causal, window, sequence lengths, softcap, ALiBi or mask."""
    case = Case(batch=1, seqlen_q=50, seqlen_k=70, heads_q=4, heads_kv=2, head_dim=72, dtype=jnp.bfloat16)
    q, k, v = case.inputs()
    d_o = jnp.ones_like(q)
    workspace = "tensor<1x4x4608xf32>"  # seqlen_q 50 rounded up to one 64-row tile, x 72

    def lowered(q=q, k=k, v=v, **kwargs):
        """The backward custom call's line of the lowered training step."""
        text = jax.jit(lambda *a: grads(*a, **kwargs)).lower(q, k, v, jnp.ones_like(q)).as_text()
        (line,) = [line for line in text.splitlines() if f"@{_registration.BACKWARD_TARGET}" in line]
        return line

    monkeypatch.delenv("JAX_FLASH_FUSED_DQ", raising=False)
    assert workspace in lowered()
    tail = "tensor<65536xf32>"  # dkdv_tail: 2 slots (one 128-key block per KV head) of 2 x 128 x 128 floats
    assert tail in lowered() and tail not in lowered(deterministic=True)
    for split_cannot_run in ({"causal": True}, {"window_size": (20, 0)}, {"softcap": 5.0},
                             {"q_seqlens": jnp.array([40], jnp.int32)}):
        assert workspace in lowered(**split_cannot_run) and tail not in lowered(**split_cannot_run)
    assert workspace not in lowered(deterministic=True)
    assert workspace in lowered(softcap=5.0)
    assert workspace in lowered(alibi_slopes=jnp.full((4,), 0.1, jnp.float32))
    absent = "tensor<0xf32>"  # the placeholder result where no workspace is declared
    key_padding = jnp.arange(70)[None, None, None, :] < 60  # [batch, 1, 1, seqlen_k]
    assert workspace in lowered(mask=key_padding)
    assert absent in lowered(mask=key_padding, bias=jnp.zeros((1, 4, 50, 70), jnp.float32))
    assert absent in lowered(bias=jnp.zeros((1, 4, 50, 70), jnp.float32))
    assert absent in lowered(deterministic=True) and absent not in lowered()
    narrow = lowered(q[..., :64], k[..., :64], v[..., :64])
    fused_64 = _ffi_calls._FUSED_DQ_MIN_HEAD_DIM <= 64
    assert ("tensor<1x4x4096xf32>" in narrow) == fused_64 and (absent in narrow) != fused_64
    assert absent in lowered(q[..., :32], k[..., :32], v[..., :32])
    wide = [jnp.concatenate([x, x], axis=-1) for x in (q, k, v)]  # head_dim 144
    assert absent in lowered(*wide)
    with_workspace = [np.asarray(g.astype(jnp.float32)) for g in grads(q, k, v, d_o)]
    monkeypatch.setenv("JAX_FLASH_FUSED_DQ", "1")
    assert workspace in lowered()
    monkeypatch.setenv("JAX_FLASH_FUSED_DQ", "0")
    assert workspace not in lowered()
    for a, b in zip(with_workspace, grads(q, k, v, d_o)):
        np.testing.assert_array_equal(a, np.asarray(b.astype(jnp.float32)))
    monkeypatch.setenv("JAX_FLASH_FUSED_DQ", "yes")
    with pytest.raises(ValueError, match="JAX_FLASH_FUSED_DQ"):
        grads(q, k, v, d_o)


def test_a_dq_accum_workspace_of_the_wrong_size_is_an_error_naming_it():
    """The handler checks the workspace against [*batch, heads_q, whole 64-row query tiles x head_dim] (the size both
    GPU kernel families fit in), under vmap too; a raw call with q's shape instead names the buffer. The dkdv_tail
    workspace beside it may have any size (the kernels use the slots that fit) but must be float32 and come with
    dq_accum."""
    from jax_flash._config import ScoreConfig

    case = Case(batch=2, seqlen_q=70, seqlen_k=30, heads_q=4, heads_kv=2, head_dim=72, dtype=jnp.bfloat16)
    q, k, v = case.inputs()
    masks = [jnp.zeros((2, 0), jnp.float32)] + [jnp.zeros((2, 0), jnp.int32)] * 4
    dense = [jnp.zeros((1, 1, 1, 0), jnp.float32), jnp.zeros((1, 1, 1, 0), bool), jnp.zeros((1, 1, 1, 0), jnp.uint8),
             jnp.zeros((2, 0), jnp.uint32)]
    config = ScoreConfig(softmax_scale=0.1)
    attributes = _ffi_calls._score_attributes(config)
    stats = jax.ShapeDtypeStruct((2, 4, 70), jnp.float32)
    o, lse, _ = jax.ffi.ffi_call(_registration.FORWARD_TARGET, (jax.ShapeDtypeStruct(q.shape, q.dtype), stats,
                                                                jax.ShapeDtypeStruct((0,), jnp.float32)))(
        q, k, v, *masks, *dense, **_ffi_calls._forward_attributes(config))

    def backward(workspace_shape, tail_shape=(0,), tail_dtype=jnp.float32):
        call = jax.ffi.ffi_call(_registration.BACKWARD_TARGET, (
            jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype), stats, jax.ShapeDtypeStruct(workspace_shape, jnp.float32),
            jax.ShapeDtypeStruct(tail_shape, tail_dtype), jax.ShapeDtypeStruct((1, 1, 1, 0), jnp.float32)))
        return jax.block_until_ready(call(q, k, v, o, lse, jnp.ones_like(q), jnp.zeros_like(lse), *masks, *dense,
                                          **attributes, deterministic=False))

    assert _ffi_calls.dq_workspace_shape(q) == (2, 4, 2 * 64 * 72)
    dq, dk, dv = backward(_ffi_calls.dq_workspace_shape(q))[:3]
    for got, want in zip((dq, dk, dv), backward((0,))[:3]):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    with pytest.raises(Exception, match="dq_accum"):
        backward(q.shape)
    assert _ffi_calls.dkdv_tail_shape(k) == (2 * 2 * 1 * 2 * 128 * 128,)  # one 128-key block per (batch, KV head)
    # With the tail workspace (any size) the results are those without it, up to the order of float adds: an sm80
    # backward on a GPU splits this call's blocks into pieces, summing dK/dV in another order.
    for tail_shape in (_ffi_calls.dkdv_tail_shape(k), (3, 5)):
        got = backward(_ffi_calls.dq_workspace_shape(q), tail_shape)[:3]
        for g, want in zip(got, (dq, dk, dv)):
            np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)),
                                       rtol=2e-2, atol=1e-3)
    with pytest.raises(Exception, match="dkdv_tail must be float32"):
        backward(_ffi_calls.dq_workspace_shape(q), (8,), jnp.int32)
    with pytest.raises(Exception, match="dkdv_tail is only for calls with a dq_accum"):
        backward((0,), (8,))

    # Under vmap the mapped axis is prepended to the workspace like to every result.
    # Two different examples and a random cotangent, so that mixed-up examples would show.
    stacked = [jnp.stack([x, (2 * x).astype(x.dtype)]) for x in (q, k, v)]
    d_o = jnp.stack([jax.random.normal(jax.random.key(i + 7), q.shape, q.dtype) for i in range(2)])
    vmapped = jax.vmap(grads)(*stacked, d_o)
    for example in range(2):
        wanted = grads(*(x[example] for x in stacked), d_o[example])
        for got, want in zip(vmapped, wanted):
            np.testing.assert_array_equal(np.asarray(got[example].astype(jnp.float32)),
                                          np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("feature", ("none", "causal", "seqlens_causal", "segments", "alibi"))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_lse_cotangent_within_bound(feature, dtype):
    """Gradients of sum(o * dO) + sum(lse * dlse) (the form of the GPU gradient checks) against the float64 reference:
    the lse cotangent enters every backward as softmax_d = rowsum(dO * O) - dlse; rows that see no key (seqlens)
    have lse = -inf and take no cotangent."""
    case = Case(seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=40, dtype=dtype, seed=11)
    q, k, v = case.inputs()
    kwargs = feature_kwargs(feature, case)
    d_o = jax.random.normal(jax.random.key(3), q.shape, jnp.float32).astype(dtype)
    d_lse = jax.random.normal(jax.random.key(4), (q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    ours = grads(q, k, v, d_o, d_lse=d_lse, **kwargs)
    xla = grads(q, k, v, d_o, implementation="xla", d_lse=d_lse, **kwargs)
    without_lse = grads(q, k, v, d_o, **kwargs)
    reference = oracle_grads(q, k, v, d_o, d_lse=d_lse, **kwargs)
    for name, g, g_xla, g_ref, g_plain in zip(("dq", "dk", "dv"), ours, xla, reference, without_lse):
        assert_within_bound(name, g, g_xla, g_ref, dtype, scale=4.0)
        if name != "dv":  # dlse moves dq and dk (dv = P^T dO does not see it)
            assert np.abs(np.asarray(g, np.float32) - np.asarray(g_plain, np.float32)).max() > 1e-3
