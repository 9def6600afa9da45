// The masked backward form's per-element boolean-mask reads (backward_form.h), on one accumulator tile in either
// orientation of the Hopper backward: the dK/dV kernel's transposed tile (rows = keys, columns = queries) and the
// dQ kernel's tile (rows = queries). They run after the transforms form's score step has capped the dots and the
// position masks have hidden what they hide, and only on tiles whose mask blocks are partially hidden (a tile the
// summary shows all visible reads no mask element; one it shows all hidden is never visited:
// backward_mask_walk.h). A hidden element becomes -inf, from which the transforms form's step makes P = 0 and
// dS = 0, as the forward (forward_kernel.h, dense form) gave it no weight in its lse.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"

namespace jax_flash::cuda::sm90 {

// The boolean mask of slice (batch, head): element (query, key) at [query * strides.query + key * strides.key]
// (the pointer make_slice_mask forms, without the rest of the SliceMask, for a kernel that needs only this one).
__device__ __forceinline__ const bool* boolean_mask_slice(const AttentionParams& p, int64_t batch, int64_t head) {
  const BroadcastStrides& s = p.mask_strides;
  return p.mask + (batch / p.inner_batch) * s.outer + (batch % p.inner_batch) * s.batch + head * s.head;
}

// One bit per score element of this thread's share of a tile: whether its mask element lets the query see the key.
// The bits are gathered before the tile's GEMMs are issued, while the score accumulators hold nothing, and applied
// once the scores are ready: read in the score step itself, the byte loads in flight beside the S and dP
// accumulators spilled (ptxas, d=128 dK/dV: over 1 KiB per thread). One register per 32 elements stays live across
// the GEMMs instead.
template <int kElements>
struct MaskBits {
  uint32_t words[(kElements + 31) / 32];

  // coords: rows_cols view of (row, column) within the tile (kTransposed: rows are keys and columns queries, else
  // the reverse); query0 / key0: the tile's origin. Elements at or past seqlen_q / seqlen_k are not read (their bit
  // is 0: the position masks hide them anyway). Offsets from the thread's first element are compile-time multiples
  // of 32-bit strides, as in sm80::ScoreTile (a tile's query rows times the query stride stays below 2^31).
  template <bool kTransposed, class Coords>
  __device__ __forceinline__ static MaskBits gather(const bool* slice, const BroadcastStrides& strides,
                                                    Coords const& coords, int64_t query0, int64_t key0,
                                                    int64_t seqlen_q, int64_t seqlen_k) {
    static_assert(decltype(cute::size(coords))::value == kElements);
    auto query_of = [&](int r, int c) {
      if constexpr (kTransposed) {
        return int(cute::get<1>(coords(0, c)));
      } else {
        return int(cute::get<0>(coords(r, 0)));
      }
    };
    auto key_of = [&](int r, int c) {
      if constexpr (kTransposed) {
        return int(cute::get<0>(coords(r, 0)));
      } else {
        return int(cute::get<1>(coords(0, c)));
      }
    };
    const int first_query = query_of(0, 0), first_key = key_of(0, 0);
    const int64_t query = query0 + first_query, key = key0 + first_key;
    const bool* origin = slice + query * strides.query + key * strides.key;
    const int query_stride = static_cast<int>(strides.query), key_stride = static_cast<int>(strides.key);
    // Elements left in range from the first one (a tile is far narrower than 2^30).
    const int queries_left = static_cast<int>(min(seqlen_q - query, int64_t{1} << 30));
    const int keys_left = static_cast<int>(min(seqlen_k - key, int64_t{1} << 30));
    MaskBits bits;
    CUTE_UNROLL
    for (int w = 0; w < int(sizeof(words) / sizeof(words[0])); ++w) bits.words[w] = 0;
    constexpr int kRows = decltype(cute::size<0>(coords))::value;
    CUTE_UNROLL
    for (int c = 0; c < decltype(cute::size<1>(coords))::value; ++c) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int dq = query_of(r, c) - first_query, dk = key_of(r, c) - first_key;
        const int i = c * kRows + r;
        if (dq < queries_left && dk < keys_left && origin[dq * query_stride + dk * key_stride]) {
          bits.words[i / 32] |= 1u << (i % 32);
        }
      }
    }
    return bits;
  }

  // scores: the same rows_cols view the bits were gathered for; elements whose bit is 0 become -inf.
  template <class Scores>
  __device__ __forceinline__ void hide_masked(Scores&& scores) const {
    constexpr int kRows = decltype(cute::size<0>(scores))::value;
    CUTE_UNROLL
    for (int c = 0; c < decltype(cute::size<1>(scores))::value; ++c) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int i = c * kRows + r;
        if (!((words[i / 32] >> (i % 32)) & 1u)) scores(r, c) = -INFINITY;
      }
    }
  }
};

// The MaskBits of a score tile whose rows_cols view is Coords.
template <class Coords>
using MaskBitsFor = MaskBits<decltype(cute::size(std::declval<Coords>()))::value>;

}  // namespace jax_flash::cuda::sm90
