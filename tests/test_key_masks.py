"""Key-only masks as kv lengths and segment ids (jax_flash/_key_masks.py): which calls convert, and that converted
calls give what the dense-mask path and the float64 reference give (values, lse, gradients, keyless rows).
Runs on the default platform's kernels (the CPU handler in CI, the CUDA kernels on a GPU machine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _key_masks, _validation
from jax_flash._config import KEY_MASK_FORM_ENV, ScoreConfig
from attention_cases import (Case, assert_forward_within_bound, assert_gradients_within_bound,
                              forward_call_operand_shapes, same_attention_tolerance)


@pytest.fixture(autouse=True)
def automatic_choice(monkeypatch):
    monkeypatch.delenv(_key_masks.KEY_MASKS_ENV, raising=False)
    monkeypatch.delenv(KEY_MASK_FORM_ENV, raising=False)


def key_mask(batch: int, seqlen_k: int, seed: int, shape=None) -> jax.Array:
    """Random visible keys with holes; batch row 1 (if any) sees no key, row 2 (if any) only a prefix."""
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, 1, 1, seqlen_k)) < 0.7
    if batch > 1:
        mask[1] = False
    if batch > 2:
        mask[2, ..., seqlen_k // 3:] = False
    mask = jnp.asarray(mask)
    return mask if shape is None else jnp.broadcast_to(mask[:shape[0]], shape)


def converts(case: Case, mask, monkeypatch=None, causal=False, window=(-1, -1), **kwargs) -> bool:
    q, k, _ = case.inputs()
    config = ScoreConfig(softmax_scale=1.0, softcap=0.0, causal=causal, align_to_sequence_end=True,
                         window_left=window[0], window_right=window[1])
    masks = _validation.mask_operands(q, k, alibi_slopes=kwargs.get("alibi_slopes"),
                                      q_seqlens=kwargs.get("q_seqlens"), kv_seqlens=kwargs.get("kv_seqlens"),
                                      q_segment_ids=kwargs.get("q_segment_ids"),
                                      kv_segment_ids=kwargs.get("kv_segment_ids"))
    dense = _validation.dense_operands(q, k, bias=kwargs.get("bias"), mask=mask, dropout_rate=0.0,
                                       dropout_rng=None)
    new_masks, new_dense = _key_masks.as_lengths_and_segments(q, k, masks, config, dense)
    converted = new_dense.mask.shape[-1] == 0
    assert converted == (new_masks.kv_segment_ids.shape[-1] != 0 and masks.kv_segment_ids.shape[-1] == 0)
    return converted


def test_which_calls_convert(monkeypatch):
    one_row = Case(batch=3, seqlen_q=1, seqlen_k=40, heads_q=8, heads_kv=2)
    rows = Case(batch=3, seqlen_q=5, seqlen_k=40, heads_q=8, heads_kv=2)
    mask = key_mask(3, 40, 0)
    assert converts(one_row, mask)
    assert converts(rows, mask)
    assert converts(one_row, mask[:1])  # broadcast over the batch
    assert converts(one_row, mask, causal=True)  # one query row: causal is moot
    assert not converts(rows, mask, causal=True)  # the diagonal would move with the length
    assert not converts(one_row, mask, window=(5, 0))
    assert not converts(one_row, jnp.broadcast_to(mask, (3, 8, 1, 40)))  # differs between heads
    assert not converts(rows, jnp.broadcast_to(mask, (3, 1, 5, 40)) & (jnp.arange(5) < 3)[:, None])
    assert not converts(Case(batch=3, seqlen_q=129, seqlen_k=40, heads_q=2, heads_kv=2), mask)
    assert converts(Case(batch=3, seqlen_q=1, seqlen_k=40, heads_q=43, heads_kv=43), mask)  # 129 tiles
    assert not converts(Case(batch=3, seqlen_q=1, seqlen_k=40, heads_q=44, heads_kv=44), mask)  # a wave already
    assert converts(Case(batch=3, seqlen_q=1, seqlen_k=40, heads_q=88, heads_kv=44), mask)  # but packs
    assert not converts(one_row, mask, bias=jnp.zeros((1, 8, 1, 40), jnp.float32))
    assert not converts(one_row, mask, alibi_slopes=jnp.ones((8,), jnp.float32))
    segments = jnp.zeros((3, 1), jnp.int32), jnp.zeros((3, 40), jnp.int32)
    assert not converts(one_row, mask, q_segment_ids=segments[0], kv_segment_ids=segments[1])
    assert converts(one_row, mask, kv_seqlens=jnp.asarray([40, 3, 20], jnp.int32))
    monkeypatch.setenv(_key_masks.KEY_MASKS_ENV, "0")
    assert not converts(one_row, mask)
    monkeypatch.setenv(_key_masks.KEY_MASKS_ENV, "yes")
    with pytest.raises(ValueError, match=_key_masks.KEY_MASKS_ENV):
        converts(one_row, mask)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("seqlen_q,heads_q,heads_kv,causal,with_lengths",
                         ((1, 8, 2, False, False), (1, 4, 4, True, False), (7, 4, 1, False, True)))
@pytest.mark.parametrize("form", ("segments", "dense"))
def test_converted_values_and_gradients(seqlen_q, heads_q, heads_kv, causal, with_lengths, dtype, form, monkeypatch):
    monkeypatch.setenv(KEY_MASK_FORM_ENV, form)
    case = Case(batch=3, seqlen_q=seqlen_q, seqlen_k=90, heads_q=heads_q, heads_kv=heads_kv, head_dim=24,
                dtype=dtype, seed=seqlen_q + heads_q)
    kwargs = {"mask": key_mask(3, 90, case.seed), "causal": causal}
    if with_lengths:
        kwargs["kv_seqlens"] = jnp.asarray([50, 90, 70], jnp.int32)
    q, k, v = case.inputs()
    assert_forward_within_bound(q, k, v, dtype, **kwargs)
    d_o = jax.random.normal(jax.random.key(3), q.shape, jnp.float32).astype(dtype)
    assert_gradients_within_bound(q, k, v, d_o, dtype, **kwargs)
    o, lse = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    assert np.all(np.isneginf(np.asarray(lse[1]))) and np.all(np.asarray(o[1], np.float32) == 0.0)
    monkeypatch.setenv(_key_masks.KEY_MASKS_ENV, "0")
    monkeypatch.delenv(KEY_MASK_FORM_ENV)
    o_dense, lse_dense = jax_flash.attention(q, k, v, return_lse=True, **kwargs)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_dense, np.float32),
                               **same_attention_tolerance(q))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_dense), **same_attention_tolerance(q, lse=True))


def test_dense_form_packs_and_splits_with_the_mask(monkeypatch):
    """JAX_FLASH_KEY_MASK_FORM=dense: the converted call keeps its key-only mask, and GQA packing and the split-KV
    forward still apply (the mask is chunked with the keys); the result is the dense path's."""
    case = Case(batch=2, seqlen_q=1, seqlen_k=2048, heads_q=8, heads_kv=2, head_dim=16, seed=4)
    q, k, v = case.inputs()
    mask = key_mask(2, 2048, 4)
    monkeypatch.setenv(KEY_MASK_FORM_ENV, "dense")
    shapes = forward_call_operand_shapes(q, k, v, mask=mask)
    assert len(shapes) == 1
    (q_shape, k_shape), = shapes
    splits = k_shape[0] // 2
    assert splits > 1 and k_shape[1] * splits == 2048 and q_shape[1:3] == (4, 2), shapes  # packed rows, split keys
    o = jax_flash.attention(q, k, v, mask=mask)
    assert_forward_within_bound(q, k, v, case.dtype, mask=mask)
    monkeypatch.setenv(_key_masks.KEY_MASKS_ENV, "0")
    monkeypatch.delenv(KEY_MASK_FORM_ENV)
    assert forward_call_operand_shapes(q, k, v, mask=mask) == [((2, 1, 8, 16), (2, 2048, 2, 16))]  # as given
    np.testing.assert_allclose(np.asarray(o), np.asarray(jax_flash.attention(q, k, v, mask=mask)),
                               **same_attention_tolerance(q))
    monkeypatch.setenv(KEY_MASK_FORM_ENV, "dense")  # still dense with JAX_FLASH_KEY_MASKS=0: not packed or split
    assert forward_call_operand_shapes(q, k, v, mask=mask) == [((2, 1, 8, 16), (2, 2048, 2, 16))]
    monkeypatch.delenv(_key_masks.KEY_MASKS_ENV)
    for broadcast in (jnp.ones((2, 1, 1, 1), bool), True):  # masks broadcast along the keys are not key-only
        o = jax_flash.attention(q, k, v, mask=broadcast)
        np.testing.assert_allclose(np.asarray(o), np.asarray(jax_flash.attention(q, k, v)),
                                   **same_attention_tolerance(q))
    monkeypatch.setenv(KEY_MASK_FORM_ENV, "sparse")
    with pytest.raises(ValueError, match=KEY_MASK_FORM_ENV):
        jax_flash.attention(q, k, v, mask=mask)
