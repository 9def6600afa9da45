"""Attention semantics against an oracle that shares no code with the library: explicit float64 NumPy loops written
from ``jax_flash.attention``'s docstring (scores, softcap, ALiBi, bias, bottom-right causal / window masks per
sequence, lengths, segments, boolean mask; rows that see no key give o = 0 and lse = -inf). The rest of the suite
measures the kernels against ``implementation="xla"`` (jax_flash/reference.py) in float64, so a semantic mistake
shared by reference.py and the kernels would pass there; here both are checked, and the kernels' gradients
(including the lse cotangent) against central differences of the oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV, HEAD_DIM = 2, 7, 11, 4, 2, 8


def numpy_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None,
                    bias=None, mask=None):
    """(o, lse) in float64 by loops over (batch, head, query row)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    o = np.zeros(q.shape)
    lse = np.full((batch, heads_q, seqlen_q), -np.inf)
    for b in range(batch):
        valid_q = seqlen_q if q_seqlens is None else min(int(q_seqlens[b]), seqlen_q)
        valid_k = seqlen_k if kv_seqlens is None else min(int(kv_seqlens[b]), seqlen_k)
        for h in range(heads_q):
            h_kv = h // (heads_q // heads_kv)
            for i in range(valid_q):
                diagonal = i + valid_k - valid_q  # bottom-right: the last query row sees the last key
                scores = np.full(seqlen_k, -np.inf)
                for j in range(valid_k):
                    if right >= 0 and j > diagonal + right:
                        continue
                    if left >= 0 and j < diagonal - left:
                        continue
                    if q_segment_ids is not None and q_segment_ids[b, i] != kv_segment_ids[b, j]:
                        continue
                    if mask is not None and not np.broadcast_to(mask, (batch, heads_q, seqlen_q, seqlen_k))[b, h, i, j]:
                        continue
                    s = scale * float(q[b, i, h] @ k[b, j, h_kv])
                    if softcap > 0:
                        s = softcap * np.tanh(s / softcap)
                    if alibi_slopes is not None:
                        slope = np.broadcast_to(alibi_slopes, (batch, heads_q))[b, h]
                        s -= slope * abs(diagonal - j)
                    if bias is not None:
                        s += np.broadcast_to(bias, (batch, heads_q, seqlen_q, seqlen_k))[b, h, i, j]
                    scores[j] = s
                if np.all(np.isinf(scores)):
                    continue  # no visible key: o = 0, lse = -inf
                m = scores.max()
                weights = np.exp(scores - m)
                lse[b, h, i] = m + np.log(weights.sum())
                o[b, i, h] = (weights / weights.sum()) @ v[b, :, h_kv]
    return o, lse


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, SEQLEN_Q, HEADS_Q, HEAD_DIM))
    k = rng.standard_normal((BATCH, SEQLEN_K, HEADS_KV, HEAD_DIM))
    v = rng.standard_normal((BATCH, SEQLEN_K, HEADS_KV, HEAD_DIM))
    return q, k, v


def _cases():
    rng = np.random.default_rng(1)
    segments_q = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2]], np.int32)
    segments_k = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]], np.int32)
    mask = rng.random((BATCH, 1, SEQLEN_Q, SEQLEN_K)) < 0.7
    mask[0, 0, 2, :] = False  # a row the mask hides entirely
    return {
        "plain": {},
        "causal": {"causal": True},
        "causal_more_queries_than_keys": {"causal": True, "_shape": (11, 7)},  # the first rows see no key
        "window": {"window_size": (3, 1)},
        "window_left_causal": {"window_size": (2, -1), "causal": True},
        "softcap_scale": {"softcap": 2.0, "softmax_scale": 0.7},
        "alibi_heads": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
        "alibi_batched_causal": {"alibi_slopes": rng.uniform(0.1, 1.0, (BATCH, HEADS_Q)), "causal": True},
        "seqlens_causal": {"q_seqlens": np.array([5, 7], np.int32), "kv_seqlens": np.array([9, 4], np.int32),
                           "causal": True},
        "seqlens_alibi": {"q_seqlens": np.array([3, 7], np.int32), "kv_seqlens": np.array([11, 6], np.int32),
                          "alibi_slopes": np.array([0.3, 0.2, 0.1, 0.05])},
        "segments": {"q_segment_ids": segments_q, "kv_segment_ids": segments_k},
        "bias_and_mask": {"bias": rng.standard_normal((1, HEADS_Q, 1, SEQLEN_K)), "mask": mask},
        "everything": {"causal": True, "window_size": (4, -1), "softcap": 3.0,
                       "alibi_slopes": np.array([0.3, 0.2, 0.1, 0.05]), "q_seqlens": np.array([6, 7], np.int32),
                       "kv_seqlens": np.array([10, 8], np.int32), "q_segment_ids": segments_q,
                       "kv_segment_ids": segments_k, "bias": rng.standard_normal((BATCH, 1, SEQLEN_Q, 1)),
                       "mask": mask},
    }


CASES = _cases()


def _case(name):
    # ALiBi slopes and bias reach the kernels (and reference.py) as float32: the oracle gets the same values.
    kwargs = {key: value.astype(np.float32).astype(np.float64)
              if isinstance(value, np.ndarray) and value.dtype.kind == "f" else value
              for key, value in CASES[name].items()}
    shape = kwargs.pop("_shape", None)
    q, k, v = _inputs()
    if shape is not None:
        rng = np.random.default_rng(2)
        q = rng.standard_normal((BATCH, shape[0], HEADS_Q, HEAD_DIM))
        k = rng.standard_normal((BATCH, shape[1], HEADS_KV, HEAD_DIM))
        v = rng.standard_normal((BATCH, shape[1], HEADS_KV, HEAD_DIM))
    return q, k, v, kwargs


def _as_jax(kwargs, float_dtype):
    converted = {}
    for key, value in kwargs.items():
        if isinstance(value, np.ndarray):
            dtype = float_dtype if value.dtype.kind == "f" else value.dtype
            value = jnp.asarray(value, dtype)
        converted[key] = value
    return converted


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_the_loops(name):
    q, k, v, kwargs = _case(name)
    o_want, lse_want = numpy_attention(q, k, v, **kwargs)
    assert np.any(np.isfinite(lse_want))
    with jax.enable_x64(True):
        o, lse = jax_flash.attention(*(jnp.asarray(x) for x in (q, k, v)), implementation="xla", return_lse=True,
                                     **_as_jax(kwargs, jnp.float64))
        o, lse = np.asarray(o), np.asarray(lse)
    np.testing.assert_allclose(o, o_want, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_want))
    # lse is float32 whatever the inputs (the API's contract): one rounding.
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_want[np.isfinite(lse_want)], rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_the_loops(name):
    q, k, v, kwargs = _case(name)
    o_want, lse_want = numpy_attention(*(np.float32(x).astype(np.float64) for x in (q, k, v)), **kwargs)
    o, lse = jax_flash.attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), return_lse=True,
                                 **_as_jax(kwargs, jnp.float32))
    np.testing.assert_allclose(np.asarray(o), o_want, rtol=0, atol=2e-6 * max(1.0, np.abs(o_want).max()))
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_want))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_want[np.isfinite(lse_want)], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["plain", "causal_more_queries_than_keys", "softcap_scale", "alibi_batched_causal",
                                  "seqlens_causal", "everything"])
def test_kernel_gradients_match_central_differences_of_the_loops(name):
    # loss = sum(o * w_o) + sum(lse * w_lse over finite lse): the lse cotangent too. Directional derivatives along
    # random directions of q, k, v, against central differences of the float64 loops.
    q, k, v, kwargs = _case(name)
    q, k, v = (np.float32(x).astype(np.float64) for x in (q, k, v))
    rng = np.random.default_rng(3)
    w_o = rng.standard_normal(q.shape)
    w_lse = rng.standard_normal((q.shape[0], q.shape[2], q.shape[1]))

    def numpy_loss(q_, k_, v_):
        o, lse = numpy_attention(q_, k_, v_, **kwargs)
        return float(np.sum(o * w_o) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * w_lse))

    jax_kwargs = _as_jax(kwargs, jnp.float32)

    def kernel_loss(q_, k_, v_):
        o, lse = jax_flash.attention(q_, k_, v_, return_lse=True, **jax_kwargs)
        return jnp.sum(o * w_o.astype(np.float32)) + jnp.sum(
            jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse.astype(np.float32))

    grads = jax.grad(kernel_loss, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    eps = 1e-5
    for which, grad in enumerate(grads):
        direction = rng.standard_normal(grad.shape)
        plus = [q, k, v]
        minus = [q, k, v]
        plus[which] = plus[which] + eps * direction
        minus[which] = minus[which] - eps * direction
        numeric = (numpy_loss(*plus) - numpy_loss(*minus)) / (2 * eps)
        analytic = float(np.sum(np.asarray(grad, np.float64) * direction))
        assert abs(analytic - numeric) <= 1e-4 * max(1.0, abs(numeric)), ("dq", "dk", "dv")[which]
