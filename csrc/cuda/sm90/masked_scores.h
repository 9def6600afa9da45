// The masked backward form's per-element boolean-mask reads (backward_form.h), on one accumulator tile in either
// orientation of the Hopper backward: the dK/dV kernel's transposed tile (rows = keys, columns = queries) and the
// dQ kernel's tile (rows = queries). Only tiles whose mask blocks are partially hidden read elements (a tile the
// summary shows all visible reads none; one it shows all hidden is never visited: backward_mask_walk.h). The bits
// are gathered before the tile's GEMMs and applied after the transforms form's softcap and the position masks; a
// hidden element becomes -inf, from which the transforms form's step makes P = 0 and dS = 0, as the forward
// (forward_kernel.h, dense form) gave it no weight in its lse.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"

namespace jax_flash::cuda::sm90 {

// The boolean mask's element (query0, key0) of slice (batch, head), a tile's origin (the slice make_slice_mask
// finds, without the rest of the SliceMask, for a kernel that needs only this one).
__device__ __forceinline__ const bool* tile_mask_origin(const AttentionParams& p, int64_t batch, int64_t head,
                                                        int64_t query0, int64_t key0) {
  const BroadcastStrides& s = p.mask_strides;
  return p.mask + broadcast_slice_offset(s, p.inner_batch, batch, head) + query0 * s.query + key0 * s.key;
}

// One bit per score element of this thread's share of a tile: whether its mask element lets the query see the key.
// The bits are gathered before the tile's GEMMs are issued, while the score accumulators hold nothing, and applied
// once the scores are ready: read in the score step itself, the byte loads in flight beside the S and dP
// accumulators spilled more (ptxas, d=128 dK/dV, with the item walk then still in the consumer loop: 1044 against
// 612 bytes per thread). One register per 32 elements stays live across the GEMMs instead.
template <int kElements>
struct MaskBits {
  static constexpr int kLoadsInFlight = 16;
  uint32_t words[(kElements + 31) / 32];

  // tile: the mask element of the tile's origin (tile_mask_origin); coords: rows_cols view of (row, column) within
  // the tile (kTransposed: rows are keys and columns queries, else the reverse); queries / keys: how many of the
  // tile's rows and columns lie inside the sequences. The elements past them are not read (their bit is 0: the
  // position masks hide them anyway). Offsets are compile-time multiples of 32-bit strides, as in sm80::ScoreTile
  // (dispatch.cu refuses strides whose sum reaches 2^23).
  template <bool kTransposed, class Coords>
  __device__ __forceinline__ static MaskBits gather(const bool* tile, const BroadcastStrides& strides,
                                                    Coords const& coords, int queries, int keys) {
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
    const int query_stride = static_cast<int>(strides.query), key_stride = static_cast<int>(strides.key);
    const bool* origin = tile + (first_query * query_stride + first_key * key_stride);
    const int queries_left = queries - first_query, keys_left = keys - first_key;
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
        // At most kLoadsInFlight byte loads before their bits are folded in: all of them at once (64 per thread in
        // the d=64 dQ kernel) took registers the accumulators need (spills 116 -> 88 bytes). A compiler barrier
        // for the front end, not a wait.
        if ((i + 1) % kLoadsInFlight == 0 && i + 1 < kElements) asm volatile("" ::: "memory");
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
