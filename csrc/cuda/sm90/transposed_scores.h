// The common-variant backward score step on a transposed tile (rows = keys, columns = query rows), as the sm90
// dK/dV kernel computes S^T = K Q^T: the position/length/segment masks of SliceMask (common/score_pipeline.h),
// then P = exp(scale * S - lse) and dS = P (dP - D), the arithmetic of sm80/row_stats.h with the per-query
// statistics indexed by column. sm80::ScoreTile walks rows of queries, hence this column-wise twin. (The transforms
// form, softcap/ALiBi, shares the masks; its score arithmetic is in transformed_scores.h.)
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/score_pipeline.h"
#include "../sm80/fragments.h"
#include "../sm80/score_tile.h"

namespace jax_flash::cuda::sm90 {

// scores: keys x queries (rows_cols view); coords: (key, query) within the tile; key0/query0: tile origin.
// Hidden elements become -inf (so their probability is exactly 0).
template <class Scores, class Coords>
__device__ void mask_transposed_scores(const SliceMask& mask, Scores&& scores, Coords const& coords, int64_t key0,
                                       int64_t query0) {
  CUTE_UNROLL
  for (int c = 0; c < cute::size<1>(scores); ++c) {
    const int64_t query = query0 + cute::get<1>(coords(0, c));
    // key_end is 0 for rows at or past valid_q, so such columns are hidden before a segment id is read.
    const int64_t begin = mask.key_begin(query);
    const int64_t end = mask.key_end(query);
    const bool segments = mask.q_segment_ids != nullptr && query < mask.valid_q;
    const int32_t query_segment = segments ? mask.q_segment_ids[query] : 0;
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(scores); ++r) {
      const int64_t key = key0 + cute::get<0>(coords(r, 0));
      if (key < begin || key >= end || (segments && mask.kv_segment_ids[key] != query_segment)) {
        scores(r, c) = -INFINITY;
      }
    }
  }
}

// scores (raw q.k dots) -> P = exp2(dot * scale_log2 - lse_log2[query]) in place.
template <class Scores, class Coords>
__device__ __forceinline__ void transposed_probabilities(Scores&& scores, Coords const& coords,
                                                         const float* lse_log2, float scale_log2) {
  CUTE_UNROLL
  for (int c = 0; c < cute::size<1>(scores); ++c) {
    const float row_lse = lse_log2[cute::get<1>(coords(0, c))];
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(scores); ++r) {
      scores(r, c) = sm80::fast_exp2(scores(r, c) * scale_log2 - row_lse);
    }
  }
}

// dp -> dS = P (dP - D[query]) in place.
template <class Probs, class Dp, class Coords>
__device__ __forceinline__ void transposed_score_grads(Probs const& probs, Dp&& dp, Coords const& coords,
                                                       const float* softmax_d) {
  CUTE_UNROLL
  for (int c = 0; c < cute::size<1>(dp); ++c) {
    const float row_d = softmax_d[cute::get<1>(coords(0, c))];
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(dp); ++r) dp(r, c) = probs(r, c) * (dp(r, c) - row_d);
  }
}

}  // namespace jax_flash::cuda::sm90
