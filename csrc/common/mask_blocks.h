// Block summary of the boolean mask: one byte per kMaskBlock x kMaskBlock block of every (batch, head) slice,
// saying whether the mask hides the whole block, part of it, or nothing. The GPU kernels read it to skip the key
// tiles a mask hides entirely (a key-padding mask hides the tail of every short sequence) and to drop the
// per-element mask reads of tiles it hides nothing of. jax_flash/_mask_blocks.py computes it next to the mask
// (MASK_BLOCK there is kMaskBlock here); csrc/ffi checks its shape. The CPU kernels ignore it.
//
// Layout: like the mask, with its last two axes counted in blocks: [*vmap, B|1, Hq|1, blocks(Sq)|1, blocks(Sk)|1],
// where an axis the mask broadcasts (size 1) stays size 1 and is read with stride 0. A block at the end of a
// sequence summarises only its in-range elements.
#pragma once

#include <cstdint>

#include "attention_params.h"
#include "score_pipeline.h"

namespace jax_flash {

inline constexpr int kMaskBlock = 64;

// A summary byte, and what MaskBlocks::cover says about a tile.
enum class MaskCover : uint8_t { kHidden = 0, kPartial = 1, kVisible = 2 };

// Blocks along a mask axis of `size` elements (a broadcast axis of size 1 stays one block).
JF_HOST_DEVICE int64_t mask_blocks_along(int64_t size) {
  return size == 1 ? 1 : (size + kMaskBlock - 1) / kMaskBlock;
}

// The summary of one (batch, head) slice.
struct SliceMaskBlocks {
  const uint8_t* blocks = nullptr;  // block (0, 0) of this slice; nullptr: no summary, every tile is `unsummarised`
  MaskCover unsummarised = MaskCover::kVisible;  // kPartial for a mask without a summary (read, skip nothing)
  int64_t query_stride = 0;         // in bytes per query block; 0 when the mask broadcasts over queries
  int64_t key_stride = 0;           // likewise per key block
  int64_t query_blocks = 0;         // blocks of the whole query and key sequences
  int64_t key_blocks = 0;

  // How the mask covers the kRows x kCols tile at (row0, col0), which starts at a multiple of its own size (so it
  // spans whole blocks, or lies inside one): hidden or visible when every block it touches is (blocks past the
  // sequences ignored), partial otherwise. Fixed trip counts, so the kernels' loops carry no extra state.
  template <int kRows, int kCols>
  JF_HOST_DEVICE MaskCover cover(int64_t row0, int64_t col0) const {
    static_assert((kRows % kMaskBlock == 0 || kMaskBlock % kRows == 0) &&
                  (kCols % kMaskBlock == 0 || kMaskBlock % kCols == 0));
    constexpr int kBlocksQ = kRows > kMaskBlock ? kRows / kMaskBlock : 1;
    constexpr int kBlocksK = kCols > kMaskBlock ? kCols / kMaskBlock : 1;
    if (blocks == nullptr) return unsummarised;
    const int64_t q0 = row0 / kMaskBlock, k0 = col0 / kMaskBlock;
    unsigned least = 2, most = 0;
    for (int qb = 0; qb < kBlocksQ; ++qb) {
      for (int kb = 0; kb < kBlocksK; ++kb) {
        if (q0 + qb < query_blocks && k0 + kb < key_blocks) {
          const unsigned b = blocks[(q0 + qb) * query_stride + (k0 + kb) * key_stride];
          least = b < least ? b : least;
          most = b > most ? b : most;
        }
      }
    }
    if (most == 0) return MaskCover::kHidden;
    return least >= 2 ? MaskCover::kVisible : MaskCover::kPartial;
  }
};

// The summary row of one query tile, for a kernel that walks many key tiles of it with few registers (the sm90
// forward's producer): built once per query tile, then each key tile's cover is what SliceMaskBlocks::cover says
// for the same tile, from at most four byte loads at 32-bit offsets (a summary has one byte per 64 x 64 mask
// elements, so a slice's summary lies far below 2^31 bytes). Query tiles of at most two blocks.
struct QueryTileMaskBlocks {
  const uint8_t* first = nullptr;  // the tile's first query block, key block 0; nullptr: no summary
  // Bytes to the tile's second query block; 0 where it has none inside the sequence or the summary broadcasts
  // queries: the first block is then read twice, which changes neither the least nor the most byte.
  int query_step = 0;

  // The query tile of kRows rows at row0 (a multiple of kRows) of slice (b, h).
  template <int kRows>
  JF_HOST_DEVICE static QueryTileMaskBlocks make(const AttentionParams& p, int64_t b, int64_t h, int64_t row0);

  // How the mask covers the key tile of kCols keys at col0 (a multiple of kCols) in this query tile.
  template <int kCols>
  JF_HOST_DEVICE MaskCover cover(const AttentionParams& p, int64_t col0) const {
    static_assert(kCols % kMaskBlock == 0 || kMaskBlock % kCols == 0);
    constexpr int kBlocksK = kCols > kMaskBlock ? kCols / kMaskBlock : 1;
    if (p.mask == nullptr) return MaskCover::kVisible;
    if (first == nullptr) return MaskCover::kPartial;  // a mask without a summary: read it, skip nothing
    const int key_blocks = static_cast<int>(mask_blocks_along(p.seqlen_k));
    const int key_stride = static_cast<int>(p.mask_blocks_strides.key);
    const int k0 = static_cast<int>(col0 / kMaskBlock);
    unsigned least = 2, most = 0;
    for (int kb = 0; kb < kBlocksK; ++kb) {
      if (k0 + kb < key_blocks) {
        const uint8_t* block = first + (k0 + kb) * key_stride;
        const unsigned a = block[0], b = block[query_step];
        const unsigned low = a < b ? a : b, high = a > b ? a : b;
        least = low < least ? low : least;
        most = high > most ? high : most;
      }
    }
    if (most == 0) return MaskCover::kHidden;
    return least >= 2 ? MaskCover::kVisible : MaskCover::kPartial;
  }
};

JF_HOST_DEVICE SliceMaskBlocks make_slice_mask_blocks(const AttentionParams& p, int64_t b, int64_t h) {
  SliceMaskBlocks m;
  if (p.mask == nullptr) return m;
  if (p.mask_blocks == nullptr) {
    m.unsummarised = MaskCover::kPartial;
    return m;
  }
  const BroadcastStrides& s = p.mask_blocks_strides;
  m.blocks = p.mask_blocks + broadcast_slice_offset(s, p.inner_batch, b, h);
  m.query_stride = s.query;
  m.key_stride = s.key;
  m.query_blocks = mask_blocks_along(p.seqlen_q);
  m.key_blocks = mask_blocks_along(p.seqlen_k);
  return m;
}

template <int kRows>
JF_HOST_DEVICE QueryTileMaskBlocks QueryTileMaskBlocks::make(const AttentionParams& p, int64_t b, int64_t h,
                                                             int64_t row0) {
  static_assert(kRows % kMaskBlock == 0 || kMaskBlock % kRows == 0);
  static_assert(kRows <= 2 * kMaskBlock, "the tile's second query block is read at first + query_step");
  QueryTileMaskBlocks t;
  const SliceMaskBlocks slice = make_slice_mask_blocks(p, b, h);
  if (slice.blocks == nullptr) return t;
  const int64_t q0 = row0 / kMaskBlock;
  t.first = slice.blocks + q0 * slice.query_stride;
  if (kRows > kMaskBlock && q0 + 1 < slice.query_blocks) t.query_step = static_cast<int>(slice.query_stride);
  return t;
}

}  // namespace jax_flash
