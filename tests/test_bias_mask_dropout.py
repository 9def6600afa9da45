"""Additive bias, boolean mask and dropout: values and gradients (dbias included) against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _dropout
from attention_cases import (Case, assert_forward_within_bound, assert_gradients_within_bound, assert_within_bound,
                              grads, oracle, oracle_grads, runs_tf32)

CASE = Case(seqlen_q=37, seqlen_k=70, heads_q=4, heads_kv=2, head_dim=24)
BIAS_SHAPES = [(2, 4, 37, 70), (4, 37, 70), (1, 4, 1, 70), (2, 1, 37, 1), (70,), (37, 1)]


def _bias(shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_bias_values_and_gradients(shape, dtype):
    case = Case(**{**CASE.__dict__, "dtype": dtype})
    q, k, v = case.inputs()
    bias = _bias(shape)
    kwargs = dict(bias=bias, causal=True)
    assert_forward_within_bound(q, k, v, dtype, **kwargs)

    d_o = jax.random.normal(jax.random.key(7), q.shape).astype(dtype)
    loss = lambda impl: (lambda b: jnp.sum((jax_flash.attention(q, k, v, bias=b, causal=True, implementation=impl)
                                            * d_o).astype(jnp.float32)))
    dbias = jax.grad(loss(None))(bias)
    dbias_xla = jax.grad(loss("xla"))(bias)
    with jax.enable_x64(True):
        q64, k64, v64, d_o64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v, d_o))
        dbias_ref = jax.grad(lambda b: jnp.sum(jax_flash.attention(q64, k64, v64, bias=b, causal=True,
                                                                   implementation="xla") * d_o64))(
            jnp.asarray(bias, jnp.float64))
    assert dbias.shape == bias.shape
    assert_within_bound("dbias", dbias, dbias_xla, np.asarray(dbias_ref), dtype, scale=4.0, tf32=runs_tf32(q))
    assert_gradients_within_bound(q, k, v, d_o, dtype, **kwargs)


def test_mask_with_fully_masked_rows():
    q, k, v = CASE.inputs()
    mask = jax.random.bernoulli(jax.random.key(3), 0.6, (2, 1, 37, 70)).at[0, :, 5].set(False)
    kwargs = dict(mask=mask, window_size=(30, 10))
    o, lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    o_ref, lse_ref = oracle(q, k, v, **kwargs)
    assert np.all(np.isneginf(np.asarray(lse)[0, :, 5])) and np.all(np.asarray(o)[0, 5] == 0)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5)
    d_o = jnp.ones_like(q)
    for g, r in zip(grads(q, k, v, d_o, **kwargs), oracle_grads(q, k, v, d_o, **kwargs)):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), r, atol=5e-5)


def test_dbias_only_when_differentiated():
    """Differentiating with respect to q alone asks the backward for an empty dbias."""
    q, k, v = CASE.inputs()
    bias = _bias((4, 37, 70))
    text = jax.jit(jax.grad(lambda q_: jnp.sum(jax_flash.attention(q_, k, v, bias=bias)))).lower(q).as_text()
    assert "tensor<1x1x1x0xf32>" in text.split("jax_flash_attention_backward")[1].split("\n")[0]
    text = jax.jit(jax.grad(lambda b: jnp.sum(jax_flash.attention(q, k, v, bias=b)))).lower(bias).as_text()
    assert "tensor<1x4x37x70xf32>" in text.split("jax_flash_attention_backward")[1].split("\n")[0]


def test_vmap_with_shared_bias():
    q, k, v = CASE.inputs()
    qs = jnp.stack([q, 2 * q, -q])
    bias = _bias((4, 37, 70))
    f = lambda q_, b: jax_flash.attention(q_, k, v, bias=b)
    batched = jax.vmap(f, in_axes=(0, None))(qs, bias)
    looped = jnp.stack([f(x, bias) for x in qs])
    np.testing.assert_allclose(np.asarray(batched), np.asarray(looped), atol=1e-6)
    dbias = jax.grad(lambda b: jnp.sum(jax.vmap(f, in_axes=(0, None))(qs, b) ** 2))(bias)
    dbias_loop = jax.grad(lambda b: sum(jnp.sum(f(x, b) ** 2) for x in qs))(bias)
    np.testing.assert_allclose(np.asarray(dbias), np.asarray(dbias_loop), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(4, 37, 70), (1, 1, 37, 70), (2, 4, 37, 70)], ids=str)
def test_per_example_dbias_under_vmap_of_grad(shape):
    """vmap(grad) of a shared (unbatched) bias gives each example its own dbias, not the sum over examples."""
    q, k, v = CASE.inputs()
    qs = jnp.stack([q, 2 * q, -q])
    bias = _bias(shape)
    loss = lambda q_, b: jnp.sum(jax_flash.attention(q_, k, v, bias=b) ** 2)
    per_example = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None))(qs, bias)
    looped = jnp.stack([jax.grad(loss, argnums=1)(x, bias) for x in qs])
    assert per_example.shape == (3, *shape)
    np.testing.assert_allclose(np.asarray(per_example), np.asarray(looped), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rate", (0.1, 0.5))
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(9, 32), (37, 100)])
def test_dropout_mask_is_bit_identical_to_the_generator(rate, seqlen_q, seqlen_k):
    """With one-hot value rows, o = dropout(P) row by row: its zeros are exactly the dropped elements. 37 x 100
    has partial 16-row and 64-column blocks of the Philox mapping (a call covers rows i, i + 8 and columns j,
    j + 1, j + 32, j + 33)."""
    batch, heads = 2, 3
    q = jax.random.normal(jax.random.key(0), (batch, seqlen_q, heads, seqlen_k))
    k = jax.random.normal(jax.random.key(1), (batch, seqlen_k, heads, seqlen_k))
    v = jnp.broadcast_to(jnp.eye(seqlen_k)[None, :, None, :], (batch, seqlen_k, heads, seqlen_k))
    key = jax.random.key(42)
    o = jax_flash.attention(q, k, v, dropout_rate=rate, dropout_rng=key)
    kept = np.asarray(o != 0).transpose(0, 2, 1, 3)  # [B, H, Sq, Sk]
    seeds = _dropout.seeds_from_key(key, batch)
    expected = np.asarray(_dropout.keep_mask(seeds, rate, heads, seqlen_q, seqlen_k))
    np.testing.assert_array_equal(kept, expected)


# Philox-4x32-10 known-answer vectors of its authors' Random123 distribution (kat_vectors): (counter, key, output).
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KNOWN_ANSWERS)
def test_philox_matches_the_known_answers(counter, key, expected):
    """The generator the kernels are checked against (test_dropout_mask_is_bit_identical_to_the_generator) is
    Philox-4x32-10 itself, not merely self-consistent."""
    words = _dropout.philox4x32_10(tuple(jnp.uint32(c) for c in counter), tuple(jnp.uint32(k) for k in key))
    assert tuple(int(w) for w in words) == expected


def test_dropout_masks_differ_between_heads_and_batch_rows():
    """Each head (counter word 3) and batch row (key) draws its own mask: at rate 0.5 two masks agree on about half
    of the elements, where a counter or key that ignored the head or row would make them equal."""
    seeds = _dropout.seeds_from_key(jax.random.key(9), 2)
    keep = np.asarray(_dropout.keep_mask(seeds, 0.5, 3, 48, 96))
    for a, b in [((0, 0), (0, 1)), ((0, 0), (0, 2)), ((0, 1), (1, 1))]:
        agreement = np.mean(keep[a] == keep[b])
        assert 0.45 < agreement < 0.55, (a, b, agreement)


@pytest.mark.parametrize("rate", (0.1, 0.3, 0.7))
def test_dropout_keep_rate(rate):
    """Overall, and for each of the eight elements that share a Philox call (the row half i // 8 % 2, the column
    half j // 32 % 2 and the 16-bit half j % 2 select different random bits)."""
    seeds = _dropout.seeds_from_key(jax.random.key(5), 4)
    keep = np.asarray(_dropout.keep_mask(seeds, rate, 8, 64, 128))
    standard_error = np.sqrt(rate * (1 - rate) / keep.size)
    assert abs(keep.mean() - (1 - rate)) < 5 * standard_error
    # [b, h, i // 16, i // 8 % 2, i % 8, j // 64, j // 32 % 2, j % 32 // 2, j % 2]
    slots = keep.reshape(4, 8, 4, 2, 8, 2, 2, 16, 2)
    per_slot = slots.mean(axis=(0, 1, 2, 4, 5, 7))
    assert np.all(np.abs(per_slot - (1 - rate)) < 5 * standard_error * np.sqrt(8)), per_slot


def test_dropout_rate_is_quantised_to_1_over_65536():
    assert _dropout.dropout_threshold(0.1) == 6554
    assert _dropout.dropout_threshold(0.0) == 0
    assert _dropout.dropout_threshold(1 - 2 ** -20) == 0xFFFF  # saturated: some elements always survive


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_dropout_values_and_gradients(dtype):
    case = Case(**{**CASE.__dict__, "dtype": dtype})
    q, k, v = case.inputs()
    kwargs = dict(dropout_rate=0.25, dropout_rng=jax.random.key(3), causal=True, bias=_bias((4, 1, 70)))
    assert_forward_within_bound(q, k, v, dtype, **kwargs)
    d_o = jax.random.normal(jax.random.key(8), q.shape).astype(dtype)
    assert_gradients_within_bound(q, k, v, d_o, dtype, **kwargs)


def test_different_keys_drop_differently():
    q, k, v = CASE.inputs()
    a = jax_flash.attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(1))
    b = jax_flash.attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(2))
    assert not np.allclose(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("overrides, error, message", [
    (dict(bias=jnp.zeros((3, 37, 70))), ValueError, "bias must be broadcastable"),
    (dict(bias=jnp.zeros((1, 1, 1, 1, 70))), ValueError, "bias"),
    (dict(bias=jnp.zeros((70,), jnp.int32)), TypeError, "bias must have a floating dtype"),
    (dict(mask=jnp.ones((37, 70), jnp.float32)), TypeError, "mask must be boolean"),
    (dict(mask=jnp.ones((37, 71), bool)), ValueError, "mask must be broadcastable"),
], ids=("bias_heads", "bias_rank", "bias_dtype", "mask_dtype", "mask_shape"))
def test_bad_dense_arguments(overrides, error, message):
    q, k, v = CASE.inputs()
    with pytest.raises(error, match=message):
        jax.eval_shape(lambda: jax_flash.attention(q, k, v, **overrides))


def test_block_sparse_mask_skips_hidden_tiles_correctly():
    """A mask hiding whole key tiles (which the kernels skip) for some rows and not others."""
    case = Case(batch=1, seqlen_q=300, seqlen_k=700, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = case.inputs()
    j = jnp.arange(700)[None, :]
    i = jnp.arange(300)[:, None]
    mask = ((j < 128) | (j >= 384) | (i >= 200))[None, None]
    o, lse = jax_flash.attention(q, k, v, mask=mask, return_lse=True)
    o_ref, lse_ref = oracle(q, k, v, mask=mask)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=2e-5)
    d_o = jnp.ones_like(q)
    for g, r in zip(grads(q, k, v, d_o, mask=mask), oracle_grads(q, k, v, d_o, mask=mask)):
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-4)
