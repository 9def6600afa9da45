"""jax_flash.dot_product_attention against jax.nn.dot_product_attention (XLA path)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from attention_cases import Case


def _compare(case, rows=None, **kwargs):
    q, k, v = case.inputs()
    ours = jax_flash.dot_product_attention(q, k, v, **kwargs)
    theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    if rows is not None:  # padding rows differ by design (0 here)
        ours, theirs = ours[:, :rows], theirs[:, :rows]
    tolerance = 1e-5 if case.dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), atol=tolerance,
                               rtol=tolerance)


def test_signature_matches_jax_nn():
    ours = inspect.signature(jax_flash.dot_product_attention).parameters
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    assert list(ours) == list(theirs)
    assert all(ours[name].kind == theirs[name].kind for name in theirs)


@pytest.mark.parametrize("seqlens", ((17, 17), (9, 30), (30, 9)), ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("is_causal", (False, True))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_causal_is_top_left(seqlens, is_causal, dtype):
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=4, heads_kv=2, dtype=dtype)
    _compare(case, is_causal=is_causal, scale=0.3)


@pytest.mark.parametrize("window", (3, (2, 0), (0, 4)))
def test_local_window(window):
    _compare(Case(seqlen_q=20, seqlen_k=20), local_window_size=window, is_causal=window == (2, 0))


def test_sequence_lengths_on_valid_rows():
    case = Case(seqlen_q=16, seqlen_k=16, batch=2)
    lengths = jnp.array([16, 16], jnp.int32)
    _compare(case, query_seq_lengths=lengths, key_value_seq_lengths=jnp.array([5, 16], jnp.int32),
             is_causal=True)


def test_unbatched_inputs_and_residual():
    q, k, v = (x[0] for x in Case(seqlen_q=12, seqlen_k=12).inputs())
    out, residual = jax_flash.dot_product_attention(q, k, v, return_residual=True)
    ref_out, ref_residual = jax.nn.dot_product_attention(q, k, v, implementation="xla", return_residual=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5)
    assert residual.shape == ref_residual.shape
    np.testing.assert_allclose(np.asarray(residual), np.asarray(ref_residual), atol=1e-5)


def test_gradients_match_jax_nn():
    q, k, v = Case(seqlen_q=15, seqlen_k=21).inputs()
    ours = jax.grad(lambda *a: jnp.sum(jax_flash.dot_product_attention(*a, is_causal=True) ** 2),
                    argnums=(0, 1, 2))(q, k, v)
    theirs = jax.grad(lambda *a: jnp.sum(jax.nn.dot_product_attention(*a, is_causal=True,
                                                                      implementation="xla") ** 2),
                      argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-4)


def test_bias_and_mask_match_jax_nn():
    case = Case(seqlen_q=14, seqlen_k=19)
    bias = jax.random.normal(jax.random.key(1), (1, 4, 14, 19))
    mask = jax.random.bernoulli(jax.random.key(2), 0.7, (2, 1, 14, 19)).at[..., 0].set(True)
    _compare(case, bias=bias, mask=mask)
    q, k, v = case.inputs()
    ours = jax.grad(lambda b: jnp.sum(jax_flash.dot_product_attention(q, k, v, bias=b, mask=mask) ** 2))(bias)
    theirs = jax.grad(lambda b: jnp.sum(jax.nn.dot_product_attention(q, k, v, bias=b, mask=mask,
                                                                     implementation="xla") ** 2))(bias)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-5, rtol=1e-4)
