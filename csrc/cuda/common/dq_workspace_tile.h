// The dq_accum workspace's tiles, for both families' fused dQ (common/dq_workspace.h has the size): the workspace
// is [batch, heads_q, query tile, chunk], a chunk holding one 64-row query tile's 64 x head_dim floats in an order
// private to the family (sm90/dq_staging.h: the WGMMA fragments'; common/dq_accum.h: sm80's column groups). Either
// way a chunk is contiguous, so one bulk reduction adds a whole staged tile.
#pragma once

#include <cstdint>

#include "../../common/attention_params.h"
#include "../../common/dq_workspace.h"
#include "bulk_reduce.h"

namespace jax_flash::cuda {

// Chunks of the call: one per (batch, query head, query tile); each family's conversion runs one CTA per chunk.
__host__ __device__ inline int64_t dq_workspace_chunks(const AttentionBackwardParams& p) {
  return p.batch * p.heads_q * dq_workspace_query_tiles(p.seqlen_q);
}

// The chunk of query tile m_block of query head `head`: 64 * head_dim floats, 16-byte aligned when the workspace
// is and head_dim is a multiple of 4 (a chunk is then a multiple of 1 KiB).
__device__ __forceinline__ float* dq_workspace_chunk(const AttentionBackwardParams& p, int64_t batch, int64_t head,
                                                     int64_t m_block) {
  return p.dq_accum + dq_workspace_tile_offset(batch, head, m_block, p.heads_q, p.seqlen_q, p.head_dim);
}

// One thread: a staged tile's first 64 * head_dim floats (the chunk's order) added to the item's chunk with ONE
// bulk reduction (at most 64 KiB), committed as its own bulk group. The stores that staged it are fenced for the
// async proxy and ordered before this call by a barrier.
__device__ __forceinline__ void reduce_dq_tile(const AttentionBackwardParams& p, const float* tile, int64_t batch,
                                               int64_t head, int64_t m_block) {
  const int bytes = static_cast<int>(kDqWorkspaceTileRows * p.head_dim * 4);
  bulk_reduce_add(dq_workspace_chunk(p, batch, head, m_block), tile, bytes);
  bulk_commit();
}

}  // namespace jax_flash::cuda
