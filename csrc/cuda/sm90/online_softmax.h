// Streaming softmax for the Hopper kernel, split in two so that a warpgroup can exponentiate the scores of key
// tile n while its P V GEMM of tile n-1 still runs: step() turns a score tile into unnormalised probabilities
// and returns each row's correction factor; rescale() applies those factors to O once that GEMM has retired.
// Same arithmetic as sm80::OnlineSoftmax (rows whose scores are all -inf so far use 0 as their reference), except
// that with kLazy a row may keep a reference below its running maximum (step's slack_log2): the reference only has
// to be one value per row, used alike by every tile's probabilities, the row sum and the lse; the true maximum
// merely keeps them in range. A warp whose rows all kept theirs skips the rescale of O.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "../sm80/fragments.h"
#include "../sm80/online_softmax.h"
#include "../sm80/score_tile.h"

namespace jax_flash::cuda::sm90 {

template <int kRows, bool kLazy = false>
struct OnlineSoftmax : sm80::SoftmaxRows<kRows> {  // reset() and finalize() are sm80's
  using sm80::SoftmaxRows<kRows>::row_max;
  using sm80::SoftmaxRows<kRows>::row_sum;

  // scores: rows x cols view, overwritten with exp2((s - reference) * to_log2). With kLazy, a row whose new maximum
  // exceeds its reference (row_max) by at most slack_log2 (in log2 units, >= 0; to_log2 > 0) keeps that reference,
  // so its correction is exactly 1 and its probabilities reach up to 2^slack_log2. Otherwise (and with slack_log2
  // = 0) the reference is the running maximum.
  template <class Scores>
  __device__ __forceinline__ void step(Scores&& scores, float to_log2, float slack_log2, float (&correction)[kRows]) {
    static_assert(decltype(cute::size<0>(scores))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float tile_max = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(scores); ++c) tile_max = fmaxf(tile_max, scores(r, c));
      tile_max = sm80::quad_allreduce(tile_max, [](float a, float b) { return fmaxf(a, b); });
      bool keep = false;
      if constexpr (kLazy) keep = row_max[r] != -INFINITY && (tile_max - row_max[r]) * to_log2 <= slack_log2;
      if (keep) tile_max = row_max[r];
      const float reference = tile_max == -INFINITY ? 0.0f : tile_max;
      correction[r] = keep ? 1.0f : sm80::fast_exp2((row_max[r] - reference) * to_log2);
      row_max[r] = tile_max;
      const float reference_log2 = reference * to_log2;
      float sum = 0.0f;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(scores); ++c) {
        const float p = sm80::fast_exp2(scores(r, c) * to_log2 - reference_log2);
        scores(r, c) = p;
        sum += p;
      }
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
  }

  // With kLazy, called by every lane of the warp (the vote below).
  template <class Out>
  __device__ __forceinline__ void rescale(Out&& out, const float (&correction)[kRows]) {
    if constexpr (kLazy) {
      bool unchanged = true;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) unchanged &= correction[r] == 1.0f;
      // A warp whose rows all kept their reference skips the multiplies; the vote makes the branch warp-uniform (a
      // per-thread condition would leave the multiplies predicated, costing their issue slots all the same).
      if (__all_sync(0xffffffffu, unchanged)) return;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(out); ++c) out(r, c) *= correction[r];
    }
  }
};

}  // namespace jax_flash::cuda::sm90
