"""The boolean mask's block summary (jax_flash/_mask_blocks.py, csrc/common/mask_blocks.h): its values against a
brute-force count, its shapes on broadcast axes, and that it reaches the custom calls with the shape the handlers
check wherever a mask goes (vmap folding, a vmapped custom call, gradients). The GPU kernels' use of it is tested
in test_cuda.py; the CPU kernels ignore it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi_calls, _mask_blocks
from jax_flash._config import DenseOperands, MaskOperands, ScoreConfig
from attention_cases import Case, block_structured_mask, grads, oracle, oracle_grads

BLOCK = _mask_blocks.MASK_BLOCK


def _brute_force(mask: np.ndarray) -> np.ndarray:
    *lead, seqlen_q, seqlen_k = mask.shape
    blocks_q, blocks_k = _mask_blocks.blocks_along(seqlen_q), _mask_blocks.blocks_along(seqlen_k)
    summary = np.zeros((*lead, blocks_q, blocks_k), np.uint8)
    for qb in range(blocks_q):
        for kb in range(blocks_k):
            block = mask[..., qb * BLOCK:(qb + 1) * BLOCK, kb * BLOCK:(kb + 1) * BLOCK]
            summary[..., qb, kb] = np.where(block.all(axis=(-2, -1)), _mask_blocks.VISIBLE,
                                            np.where(block.any(axis=(-2, -1)), _mask_blocks.PARTIAL,
                                                     _mask_blocks.HIDDEN))
    return summary


SHAPES = [(2, 3, 17, 1000), (1, 1, 1, 1000), (2, 1, 1000, 17), (1, 4, 130, 1), (2, 1, 64, 128), (3, 2, 1, 1),
          (2, 1, 0, 70), (1, 1, 129, 65), (4, 2, 3, 5, 200)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_summary_matches_brute_force(shape):
    mask = np.asarray(block_structured_mask(shape, seed=sum(shape), blind_parts=False))
    summary = _mask_blocks.block_summary(jnp.asarray(mask))
    expected = _brute_force(mask)
    assert summary.dtype == jnp.uint8
    assert summary.shape == expected.shape == (*shape[:-2], *(_mask_blocks.blocks_along(n) for n in shape[-2:]))
    np.testing.assert_array_equal(np.asarray(summary), expected)
    if expected.size >= 20 and shape[-1] >= 128:  # enough blocks for every value to occur
        assert set(np.unique(expected)) == {_mask_blocks.HIDDEN, _mask_blocks.PARTIAL, _mask_blocks.VISIBLE}


def test_summary_keeps_broadcast_axes_and_counts_only_in_range_elements():
    """Size-1 axes stay size 1 (read with stride 0); a partial last block is visible when its in-range part is."""
    mask = jnp.ones((2, 1, 1, 130), bool).at[1, :, :, 128:].set(False)
    summary = np.asarray(_mask_blocks.block_summary(mask))
    assert summary.shape == (2, 1, 1, 3)
    np.testing.assert_array_equal(summary[:, 0, 0], [[2, 2, 2], [2, 2, 0]])
    assert _mask_blocks.block_summary(jnp.zeros((1, 1, 1, 0), bool)).shape == (1, 1, 1, 0)


def test_summary_under_jit_and_vmap():
    mask = np.asarray(block_structured_mask((3, 2, 1, 150, 90), seed=3, blind_parts=False))
    summary = jax.jit(jax.vmap(_mask_blocks.block_summary))(jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(summary), _brute_force(mask))


CASE = Case(batch=2, seqlen_q=150, seqlen_k=200, heads_q=4, heads_kv=2, head_dim=16)


@pytest.mark.parametrize("shape", [(2, 4, 150, 200), (2, 1, 1, 200), (1, 4, 150, 1), (150, 200)], ids=str)
def test_masked_attention_with_summary_matches_reference(shape):
    """Values and gradients through the custom calls, which check the summary's shape against the mask's."""
    q, k, v = CASE.inputs()
    mask = block_structured_mask(shape, seed=len(shape))
    o, lse = jax.jit(lambda *a: jax_flash.attention(*a, mask=mask, return_lse=True))(q, k, v)
    o_ref, lse_ref = oracle(q, k, v, mask=mask)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), lse_ref, atol=2e-5)
    d_o = jax.random.normal(jax.random.key(1), q.shape)
    for g, r in zip(grads(q, k, v, d_o, mask=mask), oracle_grads(q, k, v, d_o, mask=mask)):
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-4)


@pytest.mark.parametrize("mask_axis", (0, None), ids=("batched_mask", "shared_mask"))
def test_vmap_with_mask(mask_axis):
    """vmap folds the mask into the batch axis (or keeps a shared one broadcast); the summary follows it."""
    q, k, v = CASE.inputs()
    n = 3
    qs = jnp.stack([q * (i + 1) for i in range(n)])
    masks = jnp.stack([block_structured_mask((2, 1, 150, 200), seed=i) for i in range(n)])
    mask = masks if mask_axis == 0 else masks[0]
    f = lambda q_, m: jax_flash.attention(q_, k, v, mask=m)
    batched = jax.vmap(f, in_axes=(0, mask_axis))(qs, mask)
    for i in range(n):
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(f(qs[i], masks[i if mask_axis == 0 else 0])),
                                   atol=1e-6)
    loss = lambda q_: jnp.sum(jax.vmap(f, in_axes=(0, mask_axis))(q_, mask) ** 2)
    assert np.all(np.isfinite(np.asarray(jax.grad(loss)(qs))))


def test_vmapped_custom_call_broadcasts_the_summary():
    """vmap straight over the custom call (vmap_method="broadcast_all", no folding): the summary gets the mask's
    vmap axes and the handler's shape check passes."""
    q, k, v = CASE.inputs()
    config = ScoreConfig(softmax_scale=0.25)
    masks = MaskOperands(jnp.zeros((2, 0), jnp.float32), *([jnp.zeros((2, 0), jnp.int32)] * 4))
    mask = jnp.stack([block_structured_mask((2, 1, 150, 200), seed=i) for i in range(2)])
    dense = lambda m: DenseOperands.absent(2)._replace(mask=m)
    o = jax.vmap(lambda m: _ffi_calls.forward(q, k, v, masks, config, dense(m))[0])(mask)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(o[i]), np.asarray(_ffi_calls.forward(q, k, v, masks, config,
                                                                                   dense(mask[i]))[0]), atol=1e-6)
