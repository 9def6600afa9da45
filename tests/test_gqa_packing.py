"""GQA packing (jax_flash/_gqa_packing.py): which forward calls pack the query heads of a KV head into the query
rows, and that packed calls give what unpacked ones and the float64 reference give (values, lse, gradients, vmap).
Runs on the default platform's kernels (the CPU handler in CI, the CUDA kernels on a GPU machine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _gqa_packing
from attention_cases import (Case, assert_forward_within_bound, assert_gradients_within_bound,
                             assert_vmapped_jit_matches_xla, feature_kwargs, forward_call_operand_shapes,
                             same_attention_tolerance)


def packed(case: Case, **kwargs) -> bool:
    shapes = [q_shape for q_shape, _ in forward_call_operand_shapes(*case.inputs(), **kwargs)]
    assert len(shapes) == 1, shapes
    group = case.heads_q // case.heads_kv
    if shapes[0] == (case.batch, case.seqlen_q, case.heads_q, case.head_dim):
        return False
    assert shapes[0] == (case.batch, case.seqlen_q * group, case.heads_kv, case.head_dim), shapes
    return True


# (seqlen_q, heads_q, heads_kv, feature, packs)
DECISIONS = (
    (1, 8, 2, "none", True),
    (1, 8, 2, "causal", True),           # one query row: causal masks nothing
    (5, 8, 1, "none", True),
    (5, 8, 2, "causal", True),           # the kernels read row r as position r // G (packed_heads)
    (5, 8, 2, "window", True),
    (1, 8, 2, "window", True),
    (5, 8, 2, "window_left_causal", True),
    (5, 8, 2, "alibi", False),           # the slope is the row's head
    (5, 8, 2, "alibi_batched_causal", False),
    (5, 8, 2, "seqlens", True),
    (1, 8, 2, "seqlens_causal", True),
    (5, 6, 2, "causal", False),          # G = 3: the kernels map rows to positions by a shift
    (5, 6, 2, "window", False),
    (1, 6, 2, "causal", True),           # one query row: causal masks nothing, and the call runs without it
    (5, 6, 2, "softcap", True),          # no position read: any G
    (5, 8, 2, "segments", True),
    (5, 8, 2, "softcap", True),
    (5, 4, 4, "none", False),            # no group to pack
    (128, 8, 2, "none", False),          # whole tiles already
    (60, 2, 1, "none", True),            # 120 rows: one tile instead of two
    (100, 2, 1, "none", False),          # 200 rows: two tiles either way
)


@pytest.mark.parametrize("seqlen_q,heads_q,heads_kv,feature,packs", DECISIONS)
def test_which_calls_pack(seqlen_q, heads_q, heads_kv, feature, packs, monkeypatch):
    monkeypatch.delenv(_gqa_packing.PACK_GQA_ENV, raising=False)
    case = Case(seqlen_q=seqlen_q, seqlen_k=40, heads_q=heads_q, heads_kv=heads_kv, seed=seqlen_q)
    assert packed(case, **feature_kwargs(feature, case)) == packs


def test_dense_operands_and_switch_keep_calls_unpacked(monkeypatch):
    monkeypatch.delenv(_gqa_packing.PACK_GQA_ENV, raising=False)
    case = Case(seqlen_q=3, seqlen_k=40, heads_q=8, heads_kv=2)
    rng = np.random.default_rng(0)
    bias = jnp.asarray(rng.normal(size=(1, 8, 3, 40)), jnp.float32)
    mask = jnp.asarray(rng.random((1, 1, 3, 40)) < 0.7)
    assert packed(case)
    assert not packed(case, bias=bias)
    assert not packed(case, mask=mask)
    assert not packed(case, dropout_rate=0.1, dropout_rng=jax.random.key(1))
    monkeypatch.setenv(_gqa_packing.PACK_GQA_ENV, "0")
    assert not packed(case)
    monkeypatch.setenv(_gqa_packing.PACK_GQA_ENV, "yes")
    with pytest.raises(ValueError, match=_gqa_packing.PACK_GQA_ENV):
        packed(case)


def test_packed_call_carries_the_group_for_position_masks(monkeypatch):
    """A causal call packs with packed_heads = G on the custom call (the kernels' row -> position map); ALiBi calls
    stay unpacked."""
    monkeypatch.delenv(_gqa_packing.PACK_GQA_ENV, raising=False)

    def forward_params(case, **kwargs):
        q, k, v = case.inputs()
        text = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, **kwargs)).lower(q, k, v).as_text()
        forward = [line for line in text.splitlines() if "jax_flash_attention_forward" in line]
        assert forward, text
        return forward[0]

    causal = forward_params(Case(seqlen_q=5, seqlen_k=40, heads_q=8, heads_kv=2), causal=True)
    assert "packed_heads = 4" in causal and "causal = true" in causal
    plain = forward_params(Case(seqlen_q=5, seqlen_k=40, heads_q=8, heads_kv=2), alibi_slopes=jnp.ones(8) * 0.1)
    assert "packed_heads = 1" in plain


# Masks that read a packed row's position (causal, window, per-sequence diagonal), also on packed rows that cross a
# tile boundary (33 * 4 = 132 rows: two 128-row tiles).
POSITION_FEATURES = ("causal", "window", "window_left_causal", "seqlens_causal")


PACKED_CASES = ([(shape, feature) for shape in ((1, 8, 2), (7, 4, 1), (33, 8, 2))
                 for feature in ("none", "seqlens", "segments", "softcap") + POSITION_FEATURES]
                + [((33, 6, 2), feature) for feature in ("none", "seqlens", "segments")])  # G = 3, no position read


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,feature", PACKED_CASES)
def test_packed_values_and_gradients(shape, feature, dtype, monkeypatch):
    seqlen_q, heads_q, heads_kv = shape
    monkeypatch.delenv(_gqa_packing.PACK_GQA_ENV, raising=False)
    case = Case(seqlen_q=seqlen_q, seqlen_k=50, heads_q=heads_q, heads_kv=heads_kv, head_dim=24, dtype=dtype,
                seed=seqlen_q + heads_q)
    kwargs = feature_kwargs(feature, case)
    q, k, v = case.inputs()
    assert packed(case, **kwargs)
    assert_forward_within_bound(q, k, v, dtype, **kwargs)
    d_o = jax.random.normal(jax.random.key(3), q.shape, jnp.float32).astype(dtype)
    assert_gradients_within_bound(q, k, v, d_o, dtype, **kwargs)
    # The same call unpacked: equal up to the order of float operations inside a row (none on the CPU handler).
    o_packed, lse_packed = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    monkeypatch.setenv(_gqa_packing.PACK_GQA_ENV, "0")
    o_plain, lse_plain = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    np.testing.assert_allclose(np.asarray(o_packed, np.float32), np.asarray(o_plain, np.float32),
                               **same_attention_tolerance(q))
    np.testing.assert_allclose(np.asarray(lse_packed), np.asarray(lse_plain), **same_attention_tolerance(q, lse=True))


def test_packed_under_vmap_and_jit(monkeypatch):
    monkeypatch.delenv(_gqa_packing.PACK_GQA_ENV, raising=False)
    assert_vmapped_jit_matches_xla(Case(batch=2, seqlen_q=3, seqlen_k=30, heads_q=8, heads_kv=2, seed=11))


@pytest.mark.parametrize("seqlen_q,seqlen_k,top_left", ((9, 4, False), (9, 300, False), (20, 20, False),
                                                      (9, 4, True), (20, 300, True)))
def test_packed_causal_diagonals(seqlen_q, seqlen_k, top_left, monkeypatch):
    """Bottom-right causal with fewer keys than queries (the first rows see nothing: o = 0, lse = -inf) and with
    many more (the split-KV forward stays off), and jax.nn's top-left causal mask (no alignment to the sequence end)."""
    monkeypatch.delenv(_gqa_packing.PACK_GQA_ENV, raising=False)
    case = Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=8, heads_kv=2, head_dim=32, seed=seqlen_k)
    q, k, v = case.inputs()
    if top_left:
        def call():
            return jax_flash.dot_product_attention(q, k, v, is_causal=True), None
    else:
        assert packed(case, causal=True)
        assert_forward_within_bound(q, k, v, case.dtype, causal=True)

        def call():
            return jax_flash.attention(q, k, v, causal=True, return_lse=True)
    o, lse = call()
    monkeypatch.setenv(_gqa_packing.PACK_GQA_ENV, "0")
    o_plain, lse_plain = call()
    reference = jax.nn.dot_product_attention(q, k, v, is_causal=True) if top_left else o_plain
    np.testing.assert_allclose(np.asarray(o), np.asarray(reference), **same_attention_tolerance(q))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_plain), **same_attention_tolerance(q))
    if lse is not None:
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(lse_plain)))
        finite = np.isfinite(np.asarray(lse_plain))
        np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_plain)[finite],
                                   **same_attention_tolerance(q, lse=True))
    assert np.all(np.isfinite(np.asarray(o)))
