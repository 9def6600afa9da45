"""Pure-JAX attention with exactly the kernels' semantics: ``implementation="xla"`` and the test oracle.

It materialises the full ``[B, Hq, Sq, Sk]`` score matrix, so it is meant for checking and for platforms
without kernels, not for long sequences. Scores are computed in float32 (float64 for float64 inputs, which the
tests use as ground truth); the probabilities are cast to the input dtype for the second product, as
``jax.nn.dot_product_attention``'s XLA path does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash import _dropout
from jax_flash._config import DenseOperands, MaskOperands, ScoreConfig


def _visible(masks: MaskOperands, config: ScoreConfig, batch: int, seqlen_q: int,
             seqlen_k: int) -> tuple[jax.Array, jax.Array]:
    """Boolean ``[B, 1, 1, Sq, Sk]`` (broadcasts over the KV-head and group axes) and the diagonal shift."""
    i = jnp.arange(seqlen_q)[:, None]
    j = jnp.arange(seqlen_k)[None, :]
    valid_q = masks.q_seqlens[:, 0] if masks.q_seqlens.shape[-1] else jnp.full((batch,), seqlen_q, jnp.int32)
    valid_k = masks.kv_seqlens[:, 0] if masks.kv_seqlens.shape[-1] else jnp.full((batch,), seqlen_k, jnp.int32)
    valid_q = jnp.clip(valid_q, 0, seqlen_q)[:, None, None]
    valid_k = jnp.clip(valid_k, 0, seqlen_k)[:, None, None]
    shift = config.diagonal_offset + ((valid_k - valid_q) if config.align_to_sequence_end else 0)
    diagonal = i + shift
    visible = (i < valid_q) & (j < valid_k)
    right = 0 if config.causal else config.window_right
    if right >= 0:
        visible &= j <= diagonal + right
    if config.window_left >= 0:
        visible &= j >= diagonal - config.window_left
    if masks.q_segment_ids.shape[-1]:
        visible &= masks.q_segment_ids[:, :, None] == masks.kv_segment_ids[:, None, :]
    return visible[:, None, None], jnp.broadcast_to(diagonal, (batch, seqlen_q, 1)) - j


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, masks: MaskOperands, config: ScoreConfig,
                        dense: DenseOperands | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns ``(o [B, Sq, Hq, D], lse [B, Hq, Sq])`` for BSHD inputs; see ``jax_flash.attention``.

    Dropout uses the kernels' own Philox stream (``jax_flash._dropout``), so both drop the same elements.
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    score_dtype = jnp.promote_types(q.dtype, jnp.float32)

    q_grouped = q.reshape(batch, seqlen_q, heads_kv, group, head_dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q_grouped, k, preferred_element_type=score_dtype)
    scores = scores.astype(score_dtype) * config.softmax_scale
    if config.softcap > 0:
        scores = config.softcap * jnp.tanh(scores / config.softcap)
    visible, distance = _visible(masks, config, batch, seqlen_q, seqlen_k)
    if masks.alibi_slopes.shape[-1]:
        slopes = masks.alibi_slopes.astype(score_dtype).reshape(batch, heads_kv, group, 1, 1)
        scores = scores - slopes * jnp.abs(distance).astype(score_dtype)[:, None, None]

    grouped = lambda x: x.reshape(x.shape[0], heads_kv if x.shape[1] != 1 else 1, group if x.shape[1] != 1 else 1,
                                  *x.shape[2:])
    if dense is not None and dense.bias.shape[-1]:
        scores = scores + grouped(dense.bias.astype(score_dtype))
    if dense is not None and dense.mask.shape[-1]:
        visible = visible & grouped(dense.mask)
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # fully masked rows: keep exp() finite
    weights = jnp.exp(scores - row_max)
    row_sum = jnp.sum(weights, axis=-1, keepdims=True)
    empty = row_sum == 0
    safe_sum = jnp.where(empty, 1.0, row_sum)
    probs = weights / safe_sum
    if config.dropout_rate > 0:
        assert dense is not None, "dropout needs the dense operands' seeds"
        keep = _dropout.keep_mask(dense.dropout_seeds, config.dropout_rate, heads_q, seqlen_q, seqlen_k)
        probs = jnp.where(grouped(keep), probs / (1.0 - config.dropout_rate), 0.0)

    o = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=score_dtype)
    o = o.reshape(batch, seqlen_q, heads_q, head_dim).astype(q.dtype)
    lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(safe_sum))[..., 0]
    return o, lse.reshape(batch, heads_q, seqlen_q).astype(jnp.promote_types(score_dtype, jnp.float32))
