// The size of the float32 dq_accum workspace of a fused-dQ backward (AttentionBackwardParams::dq_accum), in one
// place for the Python side's declaration (jax_flash/_ffi_calls.py mirrors it), the FFI check, the launchers and
// the standalone check. Both kernel families lay it out tile-major, [batch, heads_q, query tile, the tile's
// 64 x head_dim floats] (cuda/common/dq_workspace_tile.h), so that one bulk reduction adds a whole tile; the order
// inside a tile is each family's own (sm90: its WGMMA fragments', sm90/dq_staging.h; sm80: column groups,
// cuda/common/dq_accum.h). The declared shape [*batch, heads_q, per_head] is that layout with seqlen_q rounded up
// to whole tiles.
#pragma once

#include <cstdint>

namespace jax_flash {

// Query rows of one workspace tile: the sm90 dK/dV kernel's query tile (sm90/backward_traits.h asserts they agree).
constexpr int64_t kDqWorkspaceTileRows = 64;

constexpr int64_t dq_workspace_query_tiles(int64_t seqlen_q) {
  return (seqlen_q + kDqWorkspaceTileRows - 1) / kDqWorkspaceTileRows;
}

// Float offset of the tile of query tile m_block of (batch row `batch`, query head `head`).
constexpr int64_t dq_workspace_tile_offset(int64_t batch, int64_t head, int64_t m_block, int64_t heads_q,
                                           int64_t seqlen_q, int64_t head_dim) {
  return ((batch * heads_q + head) * dq_workspace_query_tiles(seqlen_q) + m_block) * kDqWorkspaceTileRows * head_dim;
}

// Floats per (batch row, query head): the last axis of the declared shape.
constexpr int64_t dq_workspace_per_head(int64_t seqlen_q, int64_t head_dim) {
  return dq_workspace_query_tiles(seqlen_q) * kDqWorkspaceTileRows * head_dim;
}

// Floats of the whole workspace; `batch` is every leading axis folded together.
constexpr int64_t dq_workspace_elements(int64_t batch, int64_t seqlen_q, int64_t heads_q, int64_t head_dim) {
  return batch * heads_q * dq_workspace_per_head(seqlen_q, head_dim);
}

// The dkdv_tail workspace (AttentionBackwardParams::dkdv_tail), declared beside dq_accum: up to kDkdvTailMaxSlots
// slots of one key block's float32 dK and dV, sized for the widest sm80 block (128 keys x head_dim 128; d=192/256 have
// 64-key blocks, no larger; sm80/dkdv_tail.h asserts it), never more slots than the call has key blocks of 128. A wave holds at most
// SMs x CTAs per SM blocks, so this covers GPUs of up to 256 such CTAs per wave; the launcher splits no tail it has
// no room for.
constexpr int64_t kDkdvTailMaxSlots = 256;
constexpr int64_t kDkdvTailSlotFloats = 2 * 128 * 128;

constexpr int64_t dkdv_tail_elements(int64_t batch, int64_t seqlen_k, int64_t heads_kv) {
  const int64_t blocks = batch * heads_kv * ((seqlen_k + 127) / 128);
  return (blocks < kDkdvTailMaxSlots ? blocks : kDkdvTailMaxSlots) * kDkdvTailSlotFloats;
}

}  // namespace jax_flash
