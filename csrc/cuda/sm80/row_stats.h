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

// Common variant: scores -> P = exp(score - lse) and dp -> dS = P * (dP - D).
template <int kRows, class Scores, class Dp>
__device__ void probabilities_and_score_grads(Scores&& scores, Dp&& dp, RowStats<kRows> const& stats,
                                              float to_log2) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(scores); ++c) {
      const float prob = fast_exp2(scores(r, c) * to_log2 - stats.lse_log2[r]);
      scores(r, c) = prob;
      dp(r, c) = prob * (dp(r, c) - stats.softmax_d[r]);
    }
  }
}

struct IgnoreDscore {
  __device__ void operator()(int, int, int64_t, int64_t, float) const {}
};

// Keep bits of a backward score tile: computed only with dropout (a no-op otherwise).
template <class Layout, class Coords>
__device__ void backward_keep_bits(KeepBits<Layout>& keep, const AttentionParams& p, int64_t batch, int64_t head,
                                   Coords const& coords, int64_t row0, int64_t col0) {
  if (p.dropout_rate > 0.0f) keep.compute(SliceDropout::make(p, batch, head), coords, row0, col0);
}

// The score pass of the backward on a tile of raw dots acc_s and dP = dO V^T in acc_dp. Afterwards acc_s holds
// what dV = P^T dO needs (P, dropped out like the forward's P V) and acc_dp holds d loss / d(scaled dot).
// General variant, one pass per visible element, as the CPU backward does:
//   P = exp(S - lse), dP' = dropout(dP), dS = P (dP' - D)   (d loss / d biased score, what dbias sums:
//   on_dscore(r, c, row, col, dS) receives it), acc_dp <- dS * dsoftcap, acc_s <- dropout(P);
// hidden elements become 0 in both.
// With dropout, `keep` holds the tile's keep bits (computed by the caller before the GEMMs, while fewer registers
// are live); dropout_rate 0 ignores it.
template <bool kGeneral, bool kCheckMask, int kRows, class Acc, class Coords, class Keep,
          class OnDscore = IgnoreDscore>
__device__ void backward_scores(const ScoreTile<kGeneral>& scorer, const AttentionParams& p, Keep const& keep,
                                Acc& acc_s, Acc& acc_dp, Coords const& coords, RowStats<kRows> const& stats,
                                int64_t row0, int64_t col0, float to_log2, OnDscore on_dscore = {}) {
  if constexpr (!kGeneral) {
    scorer.template apply<kCheckMask>(acc_s, coords, row0, col0);
    probabilities_and_score_grads(as_rows_cols(acc_s), as_rows_cols(acc_dp), stats, to_log2);
  } else {
    auto scores = as_rows_cols(acc_s);
    auto dp = as_rows_cols(acc_dp);
    const bool dropping = p.dropout_rate > 0.0f;
    const float keep_scale = dropping ? 1.0f / (1.0f - p.dropout_rate) : 1.0f;
    scorer.template apply<kCheckMask>(
        acc_s, coords, row0, col0,
        [&](int r, int c, int64_t row, int64_t col, float dscore_ddot) {
          const float prob = fast_exp2(scores(r, c) * kLog2e - stats.lse_log2[r]);
          const bool kept = !dropping || keep.kept(scores.layout()(r, c));
          const float dprob = kept ? dp(r, c) * keep_scale : 0.0f;
          const float dscore = prob * (dprob - stats.softmax_d[r]);
          on_dscore(r, c, row, col, dscore);
          dp(r, c) = dscore * dscore_ddot;
          scores(r, c) = kept ? prob * keep_scale : 0.0f;
        },
        [&](int r, int c) {
          scores(r, c) = 0.0f;
          dp(r, c) = 0.0f;
        });
  }
}

}  // namespace jax_flash::cuda::sm80
