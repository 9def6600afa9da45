// The per-element score pipeline shared by every kernel family, so that the CPU specification and the CUDA
// kernels cannot drift apart: scale -> softcap -> ALiBi -> bias -> position/length/segment/boolean masks.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_params.h"

#if defined(__CUDACC__)
#define JF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JF_HOST_DEVICE inline
#endif

namespace jax_flash {

// Everything needed to mask one (batch, head) slice, resolved once per slice.
struct SliceMask {
  int64_t valid_q = 0;        // rows at or past this are padding (fully masked)
  int64_t valid_k = 0;        // columns at or past this are padding
  int64_t diagonal_shift = 0; // diag(i) = position(i) + diagonal_shift
  int64_t window_left = -1;   // -1: unbounded
  int64_t window_right = -1;  // -1: unbounded (causal forces 0)
  float alibi_slope = 0.0f;
  const int32_t* q_segment_ids = nullptr;  // this batch row's ids, or nullptr
  const int32_t* kv_segment_ids = nullptr;
  const float* bias = nullptr;             // element (i, j) of this slice at bias[i * query + j * key]
  BroadcastStrides bias_strides;
  const bool* mask = nullptr;              // likewise
  BroadcastStrides mask_strides;
  int32_t position_shift = 0;  // row i is query position i >> position_shift (AttentionParams::position_shift)

  JF_HOST_DEVICE float bias_at(int64_t i, int64_t j) const {
    return bias ? bias[i * bias_strides.query + j * bias_strides.key] : 0.0f;
  }
  JF_HOST_DEVICE bool mask_allows(int64_t i, int64_t j) const {
    return mask == nullptr || mask[i * mask_strides.query + j * mask_strides.key];
  }

  // The query position of row i >= 0: i itself, or under GQA packing i / 2^position_shift. Nondecreasing in i, so
  // a tile's first and last rows still bound its key range.
  JF_HOST_DEVICE int64_t position(int64_t i) const { return i >> position_shift; }
  // First and one-past-last key column that row i can see by position alone (segments aside).
  JF_HOST_DEVICE int64_t key_begin(int64_t i) const {
    if (window_left < 0) return 0;
    const int64_t b = position(i) + diagonal_shift - window_left;
    return b > 0 ? b : 0;
  }
  JF_HOST_DEVICE int64_t key_end(int64_t i) const {
    if (i >= valid_q) return 0;
    if (window_right < 0) return valid_k;
    const int64_t e = position(i) + diagonal_shift + window_right + 1;
    return e < valid_k ? (e > 0 ? e : 0) : valid_k;
  }
  JF_HOST_DEVICE bool visible(int64_t i, int64_t j) const {
    if (j < key_begin(i) || j >= key_end(i)) return false;
    if (q_segment_ids != nullptr && q_segment_ids[i] != kv_segment_ids[j]) return false;
    return mask_allows(i, j);
  }
};

// Element offset of slice (flat batch row b, query head h) of a broadcast operand with strides s: b is
// (b / inner_batch, b % inner_batch), see BroadcastStrides.
JF_HOST_DEVICE int64_t broadcast_slice_offset(const BroadcastStrides& s, int64_t inner_batch, int64_t b, int64_t h) {
  return (b / inner_batch) * s.outer + (b % inner_batch) * s.batch + h * s.head;
}

// kRowLayouts: whether the call may be packed or chunked (AttentionParams::position_shift, kv_chunks); backward calls
// never are (make_slice_mask's AttentionBackwardParams overload), so their kernels compile without that code.
template <bool kRowLayouts>
JF_HOST_DEVICE SliceMask make_slice_mask_with(const AttentionParams& p, int64_t b, int64_t h) {
  SliceMask m;
  m.valid_q = p.q_seqlens ? p.q_seqlens[b] : p.seqlen_q;
  const int64_t kv_length = p.kv_seqlens ? p.kv_seqlens[b] : p.seqlen_k;
  m.valid_k = kv_length;
  if (m.valid_q > p.seqlen_q) m.valid_q = p.seqlen_q;
  if (m.valid_k > p.seqlen_k) m.valid_k = p.seqlen_k;
  if (m.valid_q < 0) m.valid_q = 0;
  if (m.valid_k < 0) m.valid_k = 0;
  int64_t aligned_k = m.valid_k, aligned_q = m.valid_q;  // where the sequences end, for the alignment below
  if constexpr (kRowLayouts) {
    // Split-KV (kv_chunks > 1): kv_length counts from this row's first key and may lie past either end of the
    // chunk; the sequence's end, where the diagonal aligns, is there all the same. Packed: rows >> shift positions.
    if (p.kv_chunks > 1) aligned_k = kv_length;
    m.position_shift = p.position_shift;
    aligned_q = m.valid_q >> p.position_shift;
  }
  m.diagonal_shift = p.diagonal_offset + (p.align_to_sequence_end ? aligned_k - aligned_q : 0);
  m.window_left = p.window_left;
  // Causal is the window's right edge pinned to the diagonal.
  m.window_right = p.causal ? 0 : p.window_right;
  m.alibi_slope = p.alibi_slopes ? p.alibi_slopes[b * p.heads_q + h] : 0.0f;
  if (p.q_segment_ids != nullptr) {
    m.q_segment_ids = p.q_segment_ids + b * p.seqlen_q;
    m.kv_segment_ids = p.kv_segment_ids + b * p.seqlen_k;
  }
  // broadcast_slice_offset's arithmetic, with the batch row split once for both operands (a 64-bit division).
  const int64_t outer = b / p.inner_batch, inner = b % p.inner_batch;
  if (p.bias != nullptr) {
    const BroadcastStrides& s = p.bias_strides;
    m.bias = p.bias + outer * s.outer + inner * s.batch + h * s.head;
    m.bias_strides = s;
  }
  if (p.mask != nullptr) {
    const BroadcastStrides& s = p.mask_strides;
    m.mask = p.mask + outer * s.outer + inner * s.batch + h * s.head;
    m.mask_strides = s;
  }
  return m;
}

JF_HOST_DEVICE SliceMask make_slice_mask(const AttentionParams& p, int64_t b, int64_t h) {
  return make_slice_mask_with<true>(p, b, h);
}
JF_HOST_DEVICE SliceMask make_slice_mask(const AttentionBackwardParams& p, int64_t b, int64_t h) {
  return make_slice_mask_with<false>(p, b, h);
}

// tanh(s / softcap) to IEEE float precision: the CPU specification and the float32 kernels.
struct ExactSoftcapTanh {
  JF_HOST_DEVICE float operator()(float s, float softcap) const { return tanhf(s / softcap); }
};

// Raw dot product -> score before masking. Also returns d(score)/d(scaled dot) for the backward (softcap).
// SoftcapTanh computes tanh(s / softcap): the half-precision GPU kernels pass a faster one (sm80/score_tile.h).
template <class SoftcapTanh = ExactSoftcapTanh>
JF_HOST_DEVICE float transform_score(float dot, float softmax_scale, float softcap, float alibi_slope,
                                      int64_t i, int64_t j, int64_t diagonal_shift, float* dscore_ddot,
                                      SoftcapTanh softcap_tanh = {}) {
  float s = dot * softmax_scale;
  float grad = 1.0f;
  if (softcap > 0.0f) {
    const float t = softcap_tanh(s, softcap);
    s = softcap * t;
    grad = 1.0f - t * t;
  }
  if (alibi_slope != 0.0f) {
    const int64_t dist = i + diagonal_shift - j;
    s -= alibi_slope * static_cast<float>(dist < 0 ? -dist : dist);
  }
  if (dscore_ddot) *dscore_ddot = grad;
  return s;
}

// transform_score's first half, for a kernel that runs it (the softcap's tanh, the costly part) apart from the
// rest: the scaled dot, through tanh(. / softcap) under a softcap; the same float operations as transform_score's
// with the same SoftcapTanh (a backward must recompute exactly the forward's logits, or P no longer matches lse).
// The sm90 backward's transforms form finishes it in sm90/transformed_scores.h (CappedScoreStep).
template <class SoftcapTanh = ExactSoftcapTanh>
JF_HOST_DEVICE float capped_dot(float dot, float softmax_scale, float softcap, SoftcapTanh softcap_tanh = {}) {
  const float s = dot * softmax_scale;
  return softcap > 0.0f ? softcap_tanh(s, softcap) : s;
}

}  // namespace jax_flash
