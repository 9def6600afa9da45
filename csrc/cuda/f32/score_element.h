// The per-element score work of the float32 kernels, as in the CPU specification. Two compile-time variants
// (kernels are built both ways, launch.h picks): the common one scales the dot and masks by position only;
// the general one (softcap, ALiBi, an additive bias, a boolean mask, dropout) runs the whole score pipeline
// of common/score_pipeline.h: scale -> softcap -> ALiBi -> + bias -> masks, then dropout on the probabilities
// (common/philox.h). Its registers and instructions stay out of the common variant's kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../common/attention_params.h"
#include "../../common/philox.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../common/dbias_plan.h"

namespace jax_flash::cuda::f32 {

// True when a call needs the general variant.
inline bool needs_general_variant(const AttentionParams& p) {
  return p.softcap > 0.0f || p.alibi_slopes != nullptr || p.bias != nullptr || p.mask != nullptr ||
         p.dropout_rate > 0.0f;
}

// Whether a tile needs the per-element mask test: a boolean mask has no tile structure, so with one (general
// variant only) every tile is tested.
template <bool kGeneral>
__device__ __forceinline__ bool tile_needs_mask(const SliceMask& mask, int64_t row0, int rows, int64_t col0,
                                                int cols) {
  return (kGeneral && mask.mask != nullptr) || !tile_fully_visible(mask, row0, rows, col0, cols);
}

// General variant: final score of element (i, j) from its raw dot, -inf where masked. The visibility test
// comes first: it keeps the bias read inside the slice. *grad: d(score)/d(scaled dot) (the softcap factor).
__device__ __forceinline__ float general_score(const AttentionParams& p, const SliceMask& mask, bool check_mask,
                                               int64_t i, int64_t j, float dot, float* grad) {
  if (check_mask && !mask.visible(i, j)) return -INFINITY;
  return transform_score(dot, p.softmax_scale, p.softcap, mask.alibi_slope, i, j, mask.diagonal_shift, grad) +
         mask.bias_at(i, j);
}

// Forward score of element (i, j) in either variant: the general transform above, or the plain scaled dot with
// the position mask (tested only where the tile needs it).
template <bool kGeneral>
__device__ __forceinline__ float forward_score(const AttentionParams& p, const SliceMask& mask, bool check_mask,
                                               int64_t i, int64_t j, float dot) {
  if constexpr (kGeneral) {
    float grad;
    return general_score(p, mask, check_mask, i, j, dot, &grad);
  } else {
    return check_mask && !mask.visible(i, j) ? -INFINITY : dot * p.softmax_scale;
  }
}

// Dropout of one (batch, head) slice: element (i, j) is kept when its 16-bit Philox draw reaches the threshold;
// kept probabilities are scaled by 1 / (1 - rate). `active` is false without dropout (then every element is
// kept unscaled and no Philox runs).
struct SliceDropout {
  const uint32_t* seed = nullptr;
  uint32_t threshold = 0;
  float keep_scale = 1.0f;
  int64_t head = 0;
  bool active = false;

  __device__ static SliceDropout make(const AttentionParams& p, int64_t batch, int64_t head) {
    SliceDropout d;
    d.active = p.dropout_rate > 0.0f;
    if (d.active) {
      d.seed = p.dropout_seeds + 2 * batch;
      d.threshold = dropout_threshold(p.dropout_rate);
      d.keep_scale = 1.0f / (1.0f - p.dropout_rate);
      d.head = head;
    }
    return d;
  }
  // Keep bits of a thread's kElems (<= 32) score elements, bit e for element e at coordinates
  // coord(e, &i, &j). Computed before a tile's GEMMs, while their accumulators are not yet live, in a loop that
  // is deliberately not unrolled: Philox's rounds then appear once in the code instead of once per element.
  // One call per element (common/philox.h's dropout_keeps): these kernels' layouts do not line up with the
  // eight elements a call serves, and correctness, not speed, is what matters here.
  template <int kElems, class Coord>
  __device__ __forceinline__ uint32_t keep_bits(Coord coord) const {
    static_assert(kElems <= 32, "one 32-bit word of keep bits");
    uint32_t bits = 0;
    if (!active) return bits;
#pragma unroll 1
    for (int e = 0; e < kElems; ++e) {
      int64_t i, j;
      coord(e, &i, &j);
      bits |= uint32_t(dropout_keeps(seed, threshold, head, i, j)) << e;
    }
    return bits;
  }
  // What multiplies the probability of element e: 0 (dropped), keep_scale (kept), 1 without dropout.
  __device__ __forceinline__ float factor(uint32_t bits, int e) const {
    if (!active) return 1.0f;
    return (bits >> e) & 1u ? keep_scale : 0.0f;
  }
};

// An lse of -inf (a row that saw no key) read as +inf, so that exp(score - lse) is 0 and never NaN, even for a
// score of -inf (a -inf bias).
__device__ __forceinline__ float backward_lse(float lse) { return lse == -INFINITY ? INFINITY : lse; }

// General variant, backward of one score element: P = exp(score - lse) and, with dropout factor f (0,
// 1/(1-rate), or 1: SliceDropout::factor),
//   prob_for_dv = f P,  dbias = P (f dP - D)  (d loss / d biased score),  dscore = dbias * dsoftcap.
// All 0 where masked (scored: false there, and for a score of -inf).
struct ElementGrad {
  float prob_for_dv;
  float dscore;
  float dbias;
  bool scored;
};

__device__ __forceinline__ ElementGrad general_grad(const AttentionParams& p, const SliceMask& mask, bool check_mask,
                                                   int64_t i, int64_t j, float dot, float dp, float lse,
                                                   float softmax_d, float f) {
  float grad = 1.0f;
  const float score = general_score(p, mask, check_mask, i, j, dot, &grad);
  if (score == -INFINITY) return {0.0f, 0.0f, 0.0f, false};
  const float prob = expf(score - lse);
  const float dbias = prob * (f * dp - softmax_d);
  return {f * prob, dbias * grad, dbias, true};
}

// Common variant: P = exp(scale dot - lse) and dS = P (dP - D) for one score element; 0 where masked.
__device__ __forceinline__ void common_probability_and_grad(const AttentionParams& p, const SliceMask& mask,
                                                            bool check_mask, int64_t i, int64_t j, float dot,
                                                            float dp, float lse, float softmax_d, float* prob,
                                                            float* dscore) {
  float grad = 1.0f;
  const float score = dot * p.softmax_scale;
  const bool visible = !check_mask || mask.visible(i, j);
  const float pr = visible ? expf(score - lse) : 0.0f;
  *prob = pr;
  *dscore = pr * (dp - softmax_d) * grad;
}

// The dQ passes hand each scored element's d loss / d biased score to dbias (dbias_plan.h); the others add 0.
// Elements outside the slice's valid rows and keys are never scored, so every write lands inside dbias.
__device__ __forceinline__ void add_dbias(const AttentionBackwardParams& p, DbiasMode mode, float* dbias_slice,
                                          int64_t i, int64_t j, const ElementGrad& g) {
  if (mode == DbiasMode::kNone || !g.scored) return;
  float* target = dbias_slice + i * p.bias_strides.query + j * p.bias_strides.key;
  if (mode == DbiasMode::kStore) {
    *target = g.dbias;
  } else {
    atomicAdd(target, g.dbias);
  }
}

}  // namespace jax_flash::cuda::f32
