"""Forward values of the kernels of the default platform against the float64 reference."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from attention_cases import FEATURES, Case, assert_forward_within_bound, feature_kwargs, oracle

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
SEQLEN_PAIRS = ((1, 1), (17, 17), (128, 128), (17, 130), (130, 17), (1000, 1000))
HEAD_DIMS = (1, 7, 64, 100, 256)


def check_forward(case: Case, **kwargs) -> None:
    assert_forward_within_bound(*case.inputs(), case.dtype, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlens", SEQLEN_PAIRS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_shapes(dtype, head_dim, seqlens):
    seqlen_q, seqlen_k = seqlens
    if seqlen_q * seqlen_k * head_dim > 128 * 128 * 256 and dtype != jnp.bfloat16:
        pytest.skip("largest shapes run in bfloat16 only, to keep the CPU suite fast")
    case = Case(batch=1 if seqlen_q >= 1000 else 2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
                dtype=dtype, seed=head_dim + seqlen_q)
    # Causal alternates along the head dims, so that every shape (Sq < Sk, Sq > Sk, 1 x 1, 1000 x 1000) runs both.
    check_forward(case, causal=(seqlen_q + HEAD_DIMS.index(head_dim)) % 2 == 0)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("seqlens", ((33, 33), (40, 150), (150, 40)), ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", ((4, 4), (4, 1)), ids=("mha", "mqa"))
def test_features(feature, dtype, seqlens, heads):
    case = Case(seqlen_q=seqlens[0], seqlen_k=seqlens[1], heads_q=heads[0], heads_kv=heads[1], head_dim=24,
                dtype=dtype, seed=len(feature))
    check_forward(case, **feature_kwargs(feature, case))


def test_long_sequence_many_tiles():
    """Sequences far past one tile, with a window, so several key tiles are skipped."""
    case = Case(batch=1, seqlen_q=700, seqlen_k=2500, heads_q=2, heads_kv=1, head_dim=32, dtype=jnp.bfloat16)
    check_forward(case, causal=True, window_size=(300, -1))


@pytest.mark.parametrize("feature", ("causal", "seqlens", "segments", "window"))
def test_fully_masked_rows_are_zero(feature):
    """Rows that see no key: o = 0, lse = -inf, no NaN."""
    case = Case(seqlen_q=20, seqlen_k=12)
    q, k, v = case.inputs()
    kwargs = {
        "causal": {"causal": True, "kv_seqlens": jnp.array([3, 12], jnp.int32),
                   "q_seqlens": jnp.array([20, 20], jnp.int32)},
        "seqlens": {"q_seqlens": jnp.array([5, 0], jnp.int32), "kv_seqlens": jnp.array([0, 4], jnp.int32)},
        "segments": {"q_segment_ids": jnp.full((2, 20), 1, jnp.int32).at[:, :7].set(9),
                     "kv_segment_ids": jnp.full((2, 12), 1, jnp.int32)},
        "window": {"window_size": (0, 0), "kv_seqlens": jnp.array([12, 2], jnp.int32)},
    }[feature]
    o, lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    o_ref, lse_ref = oracle(q, k, v, **kwargs)
    masked = np.isneginf(lse_ref)
    assert masked.any(), "the case must contain fully masked rows"
    assert np.all(np.isfinite(np.asarray(o)))
    assert np.array_equal(np.isneginf(np.asarray(lse)), masked)
    o_rows = np.transpose(np.asarray(o), (0, 2, 1, 3))  # [B, H, S, D], aligned with lse
    assert np.all(o_rows[masked] == 0)


def test_causal_is_bottom_right_aligned():
    """With Sq < Sk, the last query row sees every key; with Sq > Sk the first Sq - Sk rows see nothing."""
    case = Case(seqlen_q=5, seqlen_k=9)
    q, k, v = case.inputs()
    _, lse = jax_flash.attention(q, k, v, causal=True, return_lse=True)
    _, lse_full = jax_flash.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(np.asarray(lse)[..., -1], np.asarray(lse_full)[..., -1], rtol=1e-6)
    case = Case(seqlen_q=9, seqlen_k=5)
    q, k, v = case.inputs()
    _, lse = jax_flash.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(np.isneginf(np.asarray(lse)[..., :4])) and np.all(np.isfinite(np.asarray(lse)[..., 4:]))


def test_results_are_deterministic():
    case = Case(seqlen_q=300, seqlen_k=300, dtype=jnp.bfloat16)
    q, k, v = case.inputs()
    runs = [np.asarray(jax_flash.attention(q, k, v, causal=True).astype(jnp.float32)) for _ in range(2)]
    np.testing.assert_array_equal(*runs)


@pytest.mark.parametrize("dtype, head_dim", list(itertools.product((jnp.bfloat16, jnp.float16), (8, 40))))
def test_half_precision_rounding_matches_xla(dtype, head_dim):
    """Output conversion rounds to nearest even: on seqlen_k = 1 the output is v itself, bit for bit."""
    case = Case(seqlen_q=3, seqlen_k=1, head_dim=head_dim, dtype=dtype)
    q, k, v = case.inputs()
    o = jax_flash.attention(q, k, v)
    expected = jnp.repeat(v, case.heads_q // case.heads_kv, axis=2)
    np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32)),
                                  np.broadcast_to(np.asarray(expected.astype(jnp.float32)), o.shape))
