"""Split-KV forward (jax_flash/_kv_split.py): which forward calls run their keys in chunks, and that split calls
give what whole ones and the float64 reference give (values, lse, gradients, empty chunks, vmap, jit).
Runs on the default platform's kernels (the CPU handler in CI, the CUDA kernels on a GPU machine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _gqa_packing, _kv_split
from attention_cases import (Case, assert_forward_within_bound, assert_gradients_within_bound,
                             assert_vmapped_jit_matches_xla, feature_kwargs, forward_call_operand_shapes,
                             same_attention_tolerance)


@pytest.fixture(autouse=True)
def automatic_choices(monkeypatch):
    monkeypatch.delenv(_kv_split.SPLIT_KV_ENV, raising=False)
    monkeypatch.delenv(_gqa_packing.PACK_GQA_ENV, raising=False)


def chunks(case: Case, **kwargs) -> int:
    """How many key chunks jax_flash.attention's forward call runs (1: whole), checked against its operands."""
    calls = forward_call_operand_shapes(*case.inputs(), **kwargs)
    assert len(calls) == 1, calls
    (q_shape, k_shape), = calls
    splits = q_shape[0] // case.batch
    assert q_shape[0] == case.batch * splits and k_shape == (case.batch * splits, case.seqlen_k // splits,
                                                             case.heads_kv, case.head_dim), calls
    return splits


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, feature, chunks): automatic choices.
DECISIONS = (
    (1, 1, 4096, 8, 8, "none", 16),      # 8 tiles: as many chunks as 256-key chunks allow
    (1, 1, 4096, 32, 8, "none", 16),     # packed to 8 tiles
    (2, 1, 4096, 32, 8, "causal", 16),   # one query row: causal masks nothing
    (1, 1, 1000, 8, 8, "none", 2),       # 1000 / 256 = 3 chunks at most; 2 is the largest divisor
    (1, 1, 4099, 8, 8, "none", 1),       # a prime: no equal chunks
    (1, 1, 300, 8, 8, "none", 1),        # too few keys for two chunks
    (64, 1, 4096, 8, 8, "none", 1),      # 512 tiles already
    (4, 1, 4096, 16, 16, "none", 4),     # 64 tiles: 264 / 64 rounds up to 5, and 4 is the largest divisor up to 5
    (1, 5, 4096, 8, 8, "causal", 16),    # the chunks read whole-sequence key positions (kv_chunks)
    (1, 128, 4096, 1, 1, "none", 16),    # one row tile
    (1, 129, 4096, 1, 1, "none", 1),     # two row tiles: prefill, not split
    (1, 1, 4096, 8, 8, "window", 16),
    (1, 1, 4096, 8, 8, "alibi", 16),
    (1, 4, 4096, 32, 8, "causal", 16),   # speculative decoding: packed (32 rows of 4 heads) and split
    (1, 1, 4096, 8, 8, "softcap", 16),
    (1, 3, 4096, 8, 8, "seqlens", 16),
    (1, 1, 4096, 8, 8, "seqlens_causal", 16),
    (1, 3, 4096, 8, 8, "segments", 16),
)


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads_q,heads_kv,feature,expected", DECISIONS)
def test_which_calls_split(batch, seqlen_q, seqlen_k, heads_q, heads_kv, feature, expected):
    case = Case(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=8)
    assert chunks(case, **feature_kwargs(feature, case)) == expected


def test_dense_operands_and_switch(monkeypatch):
    case = Case(batch=1, seqlen_q=1, seqlen_k=1024, heads_q=4, heads_kv=4, head_dim=8)
    rng = np.random.default_rng(0)
    bias = jnp.asarray(rng.normal(size=(1, 4, 1, 1024)), jnp.float32)
    mask = jnp.asarray(rng.random((1, 4, 1, 1024)) < 0.7)  # per head: stays a dense mask
    assert chunks(case) == 4
    assert chunks(case, bias=bias) == 1
    assert chunks(case, mask=mask) == 1
    assert chunks(case, mask=mask[:, :1]) == 4  # key-only: kv lengths and segment ids (_key_masks)
    assert chunks(case, dropout_rate=0.1, dropout_rng=jax.random.key(1)) == 1
    monkeypatch.setenv(_kv_split.SPLIT_KV_ENV, "0")
    assert chunks(case) == 1
    monkeypatch.setenv(_kv_split.SPLIT_KV_ENV, "8")
    assert chunks(case) == 8
    monkeypatch.setenv(_kv_split.SPLIT_KV_ENV, "3")  # does not divide 1024
    assert chunks(case) == 1
    for bad in ("1", "yes", "-2"):
        monkeypatch.setenv(_kv_split.SPLIT_KV_ENV, bad)
        with pytest.raises(ValueError, match=_kv_split.SPLIT_KV_ENV):
            chunks(case)


def split_and_whole(q, k, v, splits, monkeypatch, **kwargs):
    monkeypatch.setenv(_kv_split.SPLIT_KV_ENV, str(splits))
    split = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    monkeypatch.setenv(_kv_split.SPLIT_KV_ENV, "0")
    whole = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    return split, whole


# The position features put chunk boundaries inside the visible keys: 60 keys in 4 chunks of 15, a window of
# (5, 3), the causal diagonal of 7 queries crossing the last boundary, per-sequence lengths that move it.
SHAPES_AND_FEATURES = [(shape, feature) for shape in ((1, 8, 2), (1, 3, 3), (7, 4, 1))
                       for feature in ("none", "causal", "seqlens", "segments", "softcap", "window",
                                       "window_left_causal", "seqlens_causal", "alibi", "alibi_batched_causal")]


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,feature", SHAPES_AND_FEATURES)
def test_split_values_and_gradients(shape, feature, dtype, monkeypatch):
    seqlen_q, heads_q, heads_kv = shape
    case = Case(seqlen_q=seqlen_q, seqlen_k=60, heads_q=heads_q, heads_kv=heads_kv, head_dim=24, dtype=dtype,
                seed=seqlen_q + heads_q)
    kwargs = feature_kwargs(feature, case)
    q, k, v = case.inputs()
    monkeypatch.setenv(_kv_split.SPLIT_KV_ENV, "4")
    assert chunks(case, **kwargs) == 4
    assert_forward_within_bound(q, k, v, dtype, **kwargs)
    d_o = jax.random.normal(jax.random.key(3), q.shape, jnp.float32).astype(dtype)
    assert_gradients_within_bound(q, k, v, d_o, dtype, **kwargs)
    (o_split, lse_split), (o_whole, lse_whole) = split_and_whole(q, k, v, 4, monkeypatch, **kwargs)
    # bfloat16: each chunk's output is rounded before the merge, so the two differ by a rounding or two.
    np.testing.assert_allclose(np.asarray(o_split, np.float32), np.asarray(o_whole, np.float32),
                               **same_attention_tolerance(q))
    np.testing.assert_allclose(np.asarray(lse_split), np.asarray(lse_whole), **same_attention_tolerance(q, lse=True))


def test_empty_chunks_and_rows_without_keys(monkeypatch):
    """kv_seqlens that end inside the first chunk (the others see nothing) or are 0 (no chunk sees anything)."""
    case = Case(batch=3, seqlen_q=2, seqlen_k=64, heads_q=4, heads_kv=2, head_dim=16, seed=5)
    q, k, v = case.inputs()
    kv_seqlens = jnp.asarray([5, 0, 64], jnp.int32)
    (o, lse), (o_whole, lse_whole) = split_and_whole(q, k, v, 8, monkeypatch, kv_seqlens=kv_seqlens)
    assert not np.isnan(np.asarray(o)).any() and not np.isnan(np.asarray(lse)).any()
    np.testing.assert_array_equal(np.asarray(o[1]), 0.0)
    assert np.all(np.isneginf(np.asarray(lse[1])))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_whole), **same_attention_tolerance(q))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_whole), **same_attention_tolerance(q, lse=True))
    reference = jax_flash.attention(q, k, v, kv_seqlens=kv_seqlens, implementation="xla")
    np.testing.assert_allclose(np.asarray(o)[[0, 2]], np.asarray(reference)[[0, 2]], **same_attention_tolerance(q))
    grads = jax.grad(lambda q_, k_, v_: jnp.sum(jax_flash.attention(q_, k_, v_, kv_seqlens=kv_seqlens) ** 2),
                     argnums=(0, 1, 2))(q, k, v)
    assert all(not np.isnan(np.asarray(g)).any() for g in grads)


def test_empty_batch_runs_whole():
    """A decoding-shaped call with batch 0 (no tiles at all) runs unsplit, not into a division by zero."""
    q, k = jnp.zeros((0, 1, 4, 32)), jnp.zeros((0, 4096, 1, 32))
    assert jax_flash.attention(q, k, k).shape == (0, 1, 4, 32)


def test_split_under_vmap_and_jit(monkeypatch):
    monkeypatch.setenv(_kv_split.SPLIT_KV_ENV, "4")
    assert_vmapped_jit_matches_xla(Case(batch=2, seqlen_q=1, seqlen_k=40, heads_q=8, heads_kv=2, seed=11))


@pytest.mark.parametrize("seqlen_q", (1, 4, 9))
def test_speculative_decoding_shapes(seqlen_q, monkeypatch):
    """A few causal queries at the end of a long cache (bottom-right), GQA: packed and split in one forward call,
    equal to the whole unpacked call and within the bound of the float64 reference; per-sequence cache lengths."""
    case = Case(batch=2, seqlen_q=seqlen_q, seqlen_k=1024, heads_q=8, heads_kv=2, head_dim=32, seed=seqlen_q)
    q, k, v = case.inputs()
    kwargs = {"causal": True, "kv_seqlens": jnp.asarray([1024, 301], jnp.int32)}
    calls = forward_call_operand_shapes(q, k, v, **kwargs)
    assert calls == [((2 * 4, seqlen_q * 4, 2, 32), (2 * 4, 256, 2, 32))], calls  # 4 chunks of 256 keys
    assert_forward_within_bound(q, k, v, case.dtype, **kwargs)
    split = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    monkeypatch.setenv(_kv_split.SPLIT_KV_ENV, "0")
    monkeypatch.setenv(_gqa_packing.PACK_GQA_ENV, "0")
    whole = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    np.testing.assert_allclose(np.asarray(split[0]), np.asarray(whole[0]), **same_attention_tolerance(q))
    np.testing.assert_allclose(np.asarray(split[1]), np.asarray(whole[1]), **same_attention_tolerance(q, lse=True))
