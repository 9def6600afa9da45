// Addressing of one (batch, head) slice of the BSHD tensors, and the key range a query tile can see.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include "../common/score_pipeline.h"
#include "element_convert.h"
#include "row_ops.h"
#include "tile_gemm.h"

namespace jax_flash::cpu {

struct SliceGeometry {
  explicit SliceGeometry(const AttentionParams& p)
      : params(p),
        group_size(p.heads_q / p.heads_kv),
        padded_head_dim(round_up(p.head_dim, kTileColumnMultiple)),
        q_row_stride(p.heads_q * p.head_dim),
        kv_row_stride(p.heads_kv * p.head_dim),
        bytes(element_size(p.element_type)) {}

  // Pointer to element [b, 0, h, 0] of a tensor with `seqlen` rows of `heads` heads. 64-bit offsets.
  const void* slice(const void* base, int64_t seqlen, int64_t heads, int64_t b, int64_t h) const {
    return static_cast<const char*>(base) + ((b * seqlen * heads + h) * params.head_dim) * bytes;
  }
  void* slice(void* base, int64_t seqlen, int64_t heads, int64_t b, int64_t h) const {
    return slice(base, seqlen, heads, b, h, bytes);
  }
  // The same of a tensor whose elements take `element_bytes` (float32 gradients of float16 operands).
  void* slice(void* base, int64_t seqlen, int64_t heads, int64_t b, int64_t h, int64_t element_bytes) const {
    return static_cast<char*>(base) + ((b * seqlen * heads + h) * params.head_dim) * element_bytes;
  }
  const void* q_slice(int64_t b, int64_t h) const { return slice(params.q, params.seqlen_q, params.heads_q, b, h); }
  void* o_slice(int64_t b, int64_t h) const { return slice(params.o, params.seqlen_q, params.heads_q, b, h); }
  const void* k_slice(int64_t b, int64_t h) const { return slice(params.k, params.seqlen_k, params.heads_kv, b, h); }
  const void* v_slice(int64_t b, int64_t h) const { return slice(params.v, params.seqlen_k, params.heads_kv, b, h); }

  const AttentionParams& params;
  int64_t group_size;
  int64_t padded_head_dim;
  int64_t q_row_stride;
  int64_t kv_row_stride;
  int64_t bytes;
};

// [lo, hi): the union of the key ranges rows i0 .. i0 + rows - 1 can see by position.
inline std::pair<int64_t, int64_t> visible_key_range(const SliceMask& mask, int64_t i0, int64_t rows) {
  int64_t lo = INT64_MAX;
  int64_t hi = 0;
  for (int64_t i = i0; i < i0 + rows; ++i) {
    const int64_t begin = mask.key_begin(i);
    const int64_t end = mask.key_end(i);
    if (begin >= end) continue;
    lo = std::min(lo, begin);
    hi = std::max(hi, end);
  }
  return lo < hi ? std::make_pair(lo, hi) : std::make_pair<int64_t, int64_t>(0, 0);
}

// True when a boolean mask hides every element of the tile rows [i0, i0 + rows) x keys [j0, j0 + cols): the tile
// can be skipped. Scanning the mask costs a fraction of the tile's GEMMs (it reads no head_dim axis).
inline bool mask_hides_tile(const SliceMask& mask, int64_t i0, int64_t rows, int64_t j0, int64_t cols) {
  if (mask.mask == nullptr) return false;
  for (int64_t i = i0; i < i0 + rows; ++i)
    for (int64_t j = j0; j < j0 + cols; ++j)
      if (mask.mask_allows(i, j)) return false;
  return true;
}

// Dropout settings of query row i of slice (b, h).
inline DropoutRow dropout_for_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  return {p.dropout_rate, dropout_threshold(p.dropout_rate), p.dropout_seeds + 2 * b, h, i};
}

}  // namespace jax_flash::cpu
