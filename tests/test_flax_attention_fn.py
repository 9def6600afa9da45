"""jax_flash.flax_layers.dot_product_attention against Flax's own attention_fn."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from jax_flash.flax_layers import dot_product_attention

# f32 kernels and XLA differ only in summation order; bf16 is judged against an
# f32 reference, allowing twice Flax's own bf16 error (FlashAttention's bound).
F32_TOL = 2e-5
BF16_FLOOR = 1e-2


def _qkv(
    batch_shape: tuple[int, ...],
    q_len: int,
    kv_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    dtype: jnp.dtype = jnp.float32,
    seed: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Random query ``[batch..., q_len, H, D]`` and key/value ``[batch..., kv_len, Hkv, D]``."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (*batch_shape, q_len, num_heads, head_dim), dtype)
    k = jax.random.normal(kk, (*batch_shape, kv_len, num_kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (*batch_shape, kv_len, num_kv_heads, head_dim), dtype)
    return q, k, v


def _repeat_kv(q: jax.Array, x: jax.Array) -> jax.Array:
    """Repeats key/value heads up to the query's, for Flax paths without GQA."""
    return jnp.repeat(x, q.shape[-2] // x.shape[-2], axis=-2)


def _linen_reference(q, k, v, *, is_causal: bool) -> jax.Array:
    mask = None
    if is_causal:
        mask = jnp.tril(jnp.ones((q.shape[-3], k.shape[-3]), jnp.bool_))
    return linen.dot_product_attention(q, _repeat_kv(q, k), _repeat_kv(q, v), mask=mask)


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize(
    "batch_shape, q_len, kv_len, num_heads, num_kv_heads, is_causal",
    [
        ((2,), 8, 8, 2, 2, False),  # self-attention
        ((2,), 8, 8, 4, 2, True),  # causal GQA
        ((2,), 5, 12, 2, 2, False),  # cross-attention
        ((2,), 12, 7, 4, 1, True),  # top-left causal, Sq > Sk, MQA
        ((), 6, 6, 2, 2, True),  # no batch axis
        ((2, 3), 6, 9, 4, 2, False),  # two batch axes
    ],
)
def test_matches_flax_forward_and_grad(
    batch_shape, q_len, kv_len, num_heads, num_kv_heads, is_causal, use_jit
):
    q, k, v = _qkv(batch_shape, q_len, kv_len, num_heads, num_kv_heads)
    cotangent = jax.random.normal(jax.random.key(1), q.shape)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * cotangent)

    ours = functools.partial(dot_product_attention, is_causal=is_causal)
    theirs = functools.partial(_linen_reference, is_causal=is_causal)
    value_and_grad = jax.value_and_grad(loss, argnums=(1, 2, 3))
    # The oracle always runs jitted: eager, Flax's path dispatches op by op.
    reference_value_and_grad = jax.jit(value_and_grad, static_argnums=0)
    if use_jit:
        ours, value_and_grad = jax.jit(ours), reference_value_and_grad

    np.testing.assert_allclose(ours(q, k, v), jax.jit(theirs)(q, k, v), rtol=F32_TOL, atol=F32_TOL)
    _, our_grads = value_and_grad(ours, q, k, v)
    _, their_grads = reference_value_and_grad(theirs, q, k, v)
    for ours_g, theirs_g in zip(our_grads, their_grads):
        np.testing.assert_allclose(ours_g, theirs_g, rtol=F32_TOL, atol=F32_TOL)


@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_nnx_attention_fn_with_gqa(is_causal):
    q, k, v = _qkv((2,), 8, 8, 4, 2)
    np.testing.assert_allclose(
        dot_product_attention(q, k, v, is_causal=is_causal),
        nnx.dot_product_attention(q, k, v, is_causal=is_causal),
        rtol=F32_TOL,
        atol=F32_TOL,
    )


def test_bf16_within_twice_flax_error():
    q, k, v = _qkv((2,), 16, 16, 4, 2, dtype=jnp.bfloat16)
    reference = _linen_reference(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
    ours = dot_product_attention(q, k, v, is_causal=True)
    theirs = _linen_reference(q, k, v, is_causal=True)
    assert ours.dtype == jnp.bfloat16
    our_error = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - reference)))
    their_error = float(jnp.max(jnp.abs(theirs.astype(jnp.float32) - reference)))
    assert our_error <= 2 * their_error + BF16_FLOOR


def test_dtype_argument_promotes_like_flax():
    q, k, v = _qkv((2,), 8, 8, 2, 2)
    out = dot_product_attention(q, k.astype(jnp.bfloat16), v, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    assert dot_product_attention(q, k.astype(jnp.bfloat16), v).dtype == jnp.float32


def test_deterministic_dropout_is_a_no_op():
    q, k, v = _qkv((2,), 8, 8, 2, 2)
    np.testing.assert_array_equal(
        dot_product_attention(q, k, v, dropout_rate=0.3, deterministic=True),
        dot_product_attention(q, k, v),
    )


def test_names_every_argument_flax_passes():
    """linen filters kwargs by our signature: a missing name would be dropped silently."""
    ours = set(inspect.signature(dot_product_attention).parameters)
    assert set(inspect.signature(linen.dot_product_attention).parameters) <= ours
    assert set(inspect.signature(nnx.dot_product_attention).parameters) <= ours


@pytest.mark.parametrize("implementation", (None, "xla"))
def test_masks_and_bias_match_flax(implementation):
    """A padding mask ([batch, 1, 1, kv_len]), Flax's causal mask and a bias, through the kernels."""
    q, k, v = _qkv((2,), 8, 8, 2, 2)
    lengths = jnp.array([5, 8])
    padding = (jnp.arange(8) < lengths[:, None])[:, None, None, :]
    causal = linen.make_causal_mask(jnp.ones((2, 8)))
    bias = jax.random.normal(jax.random.key(4), (2, 2, 8, 8))
    for kwargs in (dict(mask=padding), dict(mask=causal), dict(bias=bias, mask=padding & causal.astype(bool))):
        np.testing.assert_allclose(
            dot_product_attention(q, k, v, implementation=implementation, **kwargs),
            linen.dot_product_attention(q, k, v, **kwargs), rtol=F32_TOL, atol=F32_TOL)
    ours = jax.grad(lambda b: jnp.sum(dot_product_attention(q, k, v, bias=b) ** 2))(bias)
    theirs = jax.grad(lambda b: jnp.sum(linen.dot_product_attention(q, k, v, bias=b) ** 2))(bias)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_dropout_runs_in_the_kernels():
    """Dropout with a key: finite, differs from the undropped output, reproducible for the same key."""
    q, k, v = _qkv((2,), 8, 8, 2, 2)
    key = jax.random.key(0)
    dropped = dot_product_attention(q, k, v, dropout_rate=0.3, dropout_rng=key)
    again = dot_product_attention(q, k, v, dropout_rate=0.3, dropout_rng=key)
    plain = dot_product_attention(q, k, v)
    assert np.all(np.isfinite(np.asarray(dropped)))
    np.testing.assert_array_equal(np.asarray(dropped), np.asarray(again))
    assert not np.allclose(np.asarray(dropped), np.asarray(plain))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"module": object()}, "sow_weights"),
        ({"qk_attn_weights_einsum": jnp.einsum}, "einsum"),
    ],
)
def test_unsupported_flax_features_raise(kwargs, match):
    q, k, v = _qkv((2,), 8, 8, 2, 2)
    with pytest.raises(NotImplementedError, match=match):
        dot_product_attention(q, k, v, **kwargs)


def test_mismatched_batch_dims_raise():
    q, _, _ = _qkv((2,), 8, 8, 2, 2)
    _, k, v = _qkv((3,), 8, 8, 2, 2)
    with pytest.raises(ValueError, match="batch"):
        dot_product_attention(q, k, v)


@pytest.mark.parametrize("precision, allow_tf32", [
    (None, True), (jax.lax.Precision.DEFAULT, True), (jax.lax.Precision.HIGHEST, False), ("highest", False),
    ((jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST), False),
    ((jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT), True)])
def test_precision_picks_the_float32_mode(precision, allow_tf32):
    """Flax's ``precision`` becomes jax_flash's float32_precision (TF32 unless more is asked for)."""
    q, k, v = _qkv((2,), 8, 8, 2, 2)
    text = jax.jit(functools.partial(dot_product_attention, precision=precision)).lower(q, k, v).as_text()
    assert f"allow_tf32 = {str(allow_tf32).lower()}" in text
