// The transforms form's backward score step (softcap and/or ALiBi; backward_form.h) on one accumulator tile of raw
// dots, in both orientations of the Hopper backward: the dK/dV kernel's transposed tile (rows = keys, columns =
// queries, per-query statistics in shared memory) and the dQ kernel's tile (rows = queries, statistics in
// registers). It computes what the sm80 general variant (sm80/row_stats.h backward_scores) and the CPU backward
// compute, without their bias, boolean-mask and dropout work:
//   S = transform_score(dot)              (score_pipeline.h: scale, softcap, ALiBi; then the position masks)
//   P = exp2(S log2(e) - lse log2(e))     (lse is the forward's, which it formed from the same S)
//   dS = P (dP - D) dS/d(scaled dot)      (the softcap's factor 1 - tanh^2; dK, dQ then carry softmax_scale)
// in two halves: cap_scores (score_pipeline.h capped_dot: the scaled dot, through tanh under a softcap), then the
// masks turn hidden elements to -inf, then CappedScoreStep finishes each element. The dK/dV kernel runs the first
// half (the tanh, the costly part) while its dP^T GEMM is still in flight.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/score_pipeline.h"
#include "../sm80/fragments.h"
#include "../sm80/score_tile.h"

namespace jax_flash::cuda::sm90 {

// Raw dots -> capped_dot in place (either orientation), with the half-precision kernels' fast tanh
// (sm80::FastSoftcapTanh), as the forward computed them. The softcap test is hoisted out of the loop, so that an
// ALiBi-only call computes no tanh.
template <class Scores>
__device__ __forceinline__ void cap_scores(Scores&& scores, float softmax_scale, float softcap) {
  if (softcap > 0.0f) {
    const sm80::FastSoftcapTanh softcap_tanh = sm80::FastSoftcapTanh::of(softcap);
    CUTE_UNROLL
    for (int i = 0; i < cute::size(scores); ++i) {
      scores(i) = capped_dot(scores(i), softmax_scale, softcap, softcap_tanh);
    }
  } else {
    CUTE_UNROLL
    for (int i = 0; i < cute::size(scores); ++i) scores(i) = capped_dot(scores(i), softmax_scale, 0.0f);
  }
}

// The rest of transform_score (the softcap's factor, ALiBi), and the probability and score gradient, of one
// element. transform_score's softcap test is folded into two per-call multipliers rather than a branch (two copies
// of the tile loop cost the fused d=128 dK/dV kernel 50 more bytes of spills):
//   S = cap_factor * capped - slope * |distance|,   dS/d(scaled dot) = max(1 - (square_factor * capped) * capped, 0)
// with (cap_factor, square_factor) = (softcap, 1) under a softcap, else (1, 0). Multiplying by 1, subtracting
// 0 * |distance| (slope 0 without ALiBi) and the max (1 - tanh^2 >= 0) change no value of a visible element, so S
// and the factor are transform_score's (softcap * tanh - slope * |distance|, 1 - tanh^2). A hidden element
// (capped = -inf) gets P = 0 and a factor of 0 (the max also drops the NaN of 0 * inf), hence dS = 0.
struct CappedScoreStep {
  float cap_factor;
  float square_factor;
  float alibi_slope;

  __device__ static CappedScoreStep make(float softcap, float alibi_slope) {
    return {softcap > 0.0f ? softcap : 1.0f, softcap > 0.0f ? 1.0f : 0.0f, alibi_slope};
  }

  // distance = query + diagonal_shift - key (32 bits: dispatch.cu refuses ALiBi calls whose distances could reach
  // 2^30); returns P and replaces dp by dS.
  __device__ __forceinline__ float operator()(float capped, float& dp, int distance, float lse_log2,
                                              float softmax_d) const {
    const float score = cap_factor * capped - alibi_slope * static_cast<float>(distance < 0 ? -distance : distance);
    const float dscore_ddot = fmaxf(1.0f - (square_factor * capped) * capped, 0.0f);
    const float prob = sm80::fast_exp2(score * sm80::kLog2e - lse_log2);
    dp = prob * (dp - softmax_d) * dscore_ddot;
    return prob;
  }
};

// The distance query + diagonal_shift - key of a tile's element (r, c) is this thread's first element's plus a
// compile-time offset: one 32-bit value stays live, no per-row or per-column coordinate.
template <class Coords>
__device__ __forceinline__ int first_alibi_distance(const SliceMask& mask, Coords const& coords, int64_t query0,
                                                    int64_t key0, bool transposed) {
  const int64_t query = query0 + (transposed ? cute::get<1>(coords(0, 0)) : cute::get<0>(coords(0, 0)));
  const int64_t key = key0 + (transposed ? cute::get<0>(coords(0, 0)) : cute::get<1>(coords(0, 0)));
  return static_cast<int>(query + mask.diagonal_shift - key);
}

// dK/dV kernel: capped (keys x queries, rows_cols view, -inf where hidden) and dP^T -> P^T in place and dS^T in dp.
template <class Scores, class Dp, class Coords>
__device__ __forceinline__ void transposed_capped_step(const CappedScoreStep& step, Scores&& capped, Dp&& dp,
                                                       Coords const& coords, int first_distance,
                                                       const float* lse_log2, const float* softmax_d) {
  CUTE_UNROLL
  for (int c = 0; c < cute::size<1>(dp); ++c) {
    const int query = cute::get<1>(coords(0, c));
    const float row_lse = lse_log2[query];
    const float row_d = softmax_d[query];
    const int query_offset = query - cute::get<1>(coords(0, 0));
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(dp); ++r) {
      const int key_offset = cute::get<0>(coords(r, 0)) - cute::get<0>(coords(0, 0));
      capped(r, c) = step(capped(r, c), dp(r, c), first_distance + (query_offset - key_offset), row_lse, row_d);
    }
  }
}

// dQ kernel: capped (queries x keys, rows_cols view, -inf where hidden) and dP -> P in place and dS in dp; the
// row statistics of sm80::RowStats.
template <class Scores, class Dp, class Coords, class Stats>
__device__ __forceinline__ void capped_step(const CappedScoreStep& step, Scores&& capped, Dp&& dp,
                                            Coords const& coords, int first_distance, Stats const& stats) {
  CUTE_UNROLL
  for (int r = 0; r < cute::size<0>(dp); ++r) {
    const int query_offset = cute::get<0>(coords(r, 0)) - cute::get<0>(coords(0, 0));
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(dp); ++c) {
      const int key_offset = cute::get<1>(coords(0, c)) - cute::get<1>(coords(0, 0));
      capped(r, c) = step(capped(r, c), dp(r, c), first_distance + (query_offset - key_offset), stats.lse_log2[r],
                          stats.softmax_d[r]);
    }
  }
}

}  // namespace jax_flash::cuda::sm90
