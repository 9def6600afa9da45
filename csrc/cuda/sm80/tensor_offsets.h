// 64-bit element offsets into the BSHD tensors and the [batch, heads, seqlen] row statistics.
#pragma once

#include <cstdint>

#include "../../common/attention_params.h"

namespace jax_flash::cuda::sm80 {

struct BshdShape {
  int64_t seqlen;
  int64_t heads;
  int64_t head_dim;

  __host__ __device__ int64_t row_stride() const { return heads * head_dim; }
  __host__ __device__ int64_t offset(int64_t b, int64_t s, int64_t h) const {
    return ((b * seqlen + s) * heads + h) * head_dim;
  }
};

__host__ __device__ inline BshdShape query_shape(const AttentionParams& p) {
  return {p.seqlen_q, p.heads_q, p.head_dim};
}
__host__ __device__ inline BshdShape key_shape(const AttentionParams& p) {
  return {p.seqlen_k, p.heads_kv, p.head_dim};
}
// lse, softmax_d: [batch, heads_q, seqlen_q].
__host__ __device__ inline int64_t row_stat_offset(const AttentionParams& p, int64_t b, int64_t h, int64_t s) {
  return (b * p.heads_q + h) * p.seqlen_q + s;
}

// Which (query block, head, batch) or (key block, head, batch) a CTA owns: blockIdx.x folds all three so the
// grid never hits the 65535 limit of y/z however many batch axes vmap folded in.
struct BlockCoord {
  int block;
  int64_t head;
  int64_t batch;
};

// Linear block `linear` of that folding (32-bit arithmetic: the grid has fewer than 2^31 CTAs).
__host__ __device__ inline BlockCoord block_coord(unsigned linear, int num_blocks, int64_t heads) {
  const int64_t slice = linear / num_blocks;
  return {static_cast<int>(linear % num_blocks), slice % heads, slice / heads};
}

__device__ inline BlockCoord decode_block_coord(int num_blocks, int64_t heads) {
  return block_coord(blockIdx.x, num_blocks, heads);
}

}  // namespace jax_flash::cuda::sm80
