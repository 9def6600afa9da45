// Streaming softmax over key tiles: per row, a running maximum and a running sum of exp2 relative to it; the
// output accumulator is rescaled whenever the maximum grows. Rows whose every score so far is -inf use 0 as
// the reference, so they produce exact zeros instead of NaN from (-inf) - (-inf).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "fragments.h"
#include "score_tile.h"

namespace jax_flash::cuda::sm80 {

// The per-row state both kernel families stream (running maximum and this thread's running sum), its reset, and
// the final normalisation; sm80::OnlineSoftmax and sm90::OnlineSoftmax add their update steps.
template <int kRows>
struct SoftmaxRows {
  float row_max[kRows];
  float row_sum[kRows];  // this thread's columns only; the quad's total is formed once, in finalize()

  __device__ void reset() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
    }
  }

  // Normalises the output rows and returns each row's log-sum-exp (natural log; -inf for rows that saw no
  // visible key, whose output is then exactly 0).
  template <class Out>
  __device__ void finalize(Out&& out, float to_log2, float (&lse)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_allreduce(row_sum[r], [](float a, float b) { return a + b; });
      const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(out); ++c) out(r, c) *= inv_sum;
      lse[r] = sum > 0.0f ? (row_max[r] * to_log2 + log2f(sum)) * kLn2 : -INFINITY;
    }
  }
};

template <int kRows>
struct OnlineSoftmax : SoftmaxRows<kRows> {
  using SoftmaxRows<kRows>::row_max;
  using SoftmaxRows<kRows>::row_sum;

  // scores: rows x cols view of a score tile, overwritten with unnormalised probabilities.
  // out: rows x cols view of the output accumulator (same rows).
  template <class Scores, class Out>
  __device__ void update(Scores&& scores, Out&& out, float to_log2) {
    static_assert(decltype(cute::size<0>(scores))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float tile_max = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(scores); ++c) tile_max = fmaxf(tile_max, scores(r, c));
      tile_max = quad_allreduce(tile_max, [](float a, float b) { return fmaxf(a, b); });
      const float reference = tile_max == -INFINITY ? 0.0f : tile_max;
      const float correction = fast_exp2((row_max[r] - reference) * to_log2);
      row_max[r] = tile_max;
      row_sum[r] *= correction;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(out); ++c) out(r, c) *= correction;
      const float reference_log2 = reference * to_log2;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(scores); ++c) {
        const float p = fast_exp2(scores(r, c) * to_log2 - reference_log2);
        scores(r, c) = p;
        row_sum[r] += p;
      }
    }
  }
};

}  // namespace jax_flash::cuda::sm80
