// Per-row softmax statistics the backward reads back: lse (from the forward) and softmax_d (from the pre-pass),
// for the score rows this thread holds.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "fragments.h"
#include "score_tile.h"
#include "tensor_offsets.h"

namespace jax_flash::cuda::sm80 {

template <int kRows>
struct RowStats {
  float lse_log2[kRows];   // lse in log2 units; +inf for rows that saw no key, so exp2(s - lse) is 0, not NaN
  float softmax_d[kRows];  // rowsum(dO * O) - dlse

  // coords: (row, col) in the tile of each accumulator element; rows at or past seqlen_q read as empty.
  template <class Coords>
  __device__ void load(const AttentionBackwardParams& p, int64_t batch, int64_t head, int64_t row0,
                       Coords const& coords) {
    auto row_coords = as_rows_cols(coords);
    static_assert(decltype(cute::size<0>(row_coords))::value == kRows);
    const int64_t base = row_stat_offset(p, batch, head, 0);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row0 + cute::get<0>(row_coords(r, 0));
      const bool in_bounds = row < p.seqlen_q;
      const float lse = in_bounds ? p.lse[base + row] : -INFINITY;
      lse_log2[r] = lse == -INFINITY ? INFINITY : lse * kLog2e;
      softmax_d[r] = in_bounds ? p.softmax_d[base + row] : 0.0f;
    }
  }
};

// scores -> P = exp(score - lse) and dp -> dS = P * (dP - D) (times the softcap factor, which with kTransforms
// the score pass has already folded into dp as (dP - D) * factor).
template <bool kTransforms, int kRows, class Scores, class Dp>
__device__ void probabilities_and_score_grads(Scores&& scores, Dp&& dp, RowStats<kRows> const& stats,
                                              float to_log2) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(scores); ++c) {
      const float prob = fast_exp2(scores(r, c) * to_log2 - stats.lse_log2[r]);
      scores(r, c) = prob;
      dp(r, c) = prob * (kTransforms ? dp(r, c) : dp(r, c) - stats.softmax_d[r]);
    }
  }
}

// The score pass of the backward: masks/transforms the score tile and, with kTransforms, turns dp into
// (dP - D) * d(score)/d(scaled dot) while the factor is at hand.
template <bool kTransforms, bool kCheckMask, int kRows, class Acc, class Coords>
__device__ void score_backward_tile(const ScoreTile<kTransforms>& scorer, Acc& acc_s, Acc& acc_dp,
                                    Coords const& coords, RowStats<kRows> const& stats, int64_t row0,
                                    int64_t col0) {
  auto dp = as_rows_cols(acc_dp);
  scorer.template apply<kCheckMask>(acc_s, coords, row0, col0, [&](int r, int c, float dscore_ddot) {
    dp(r, c) = (dp(r, c) - stats.softmax_d[r]) * dscore_ddot;
  });
}

}  // namespace jax_flash::cuda::sm80
