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

  // How the mask covers rows [row0, row0 + rows) x keys [col0, col0 + cols) (rows and keys past the sequences
  // ignored): hidden or visible when every block it touches is, partial otherwise.
  JF_HOST_DEVICE MaskCover cover(int64_t row0, int rows, int64_t col0, int cols) const {
    if (blocks == nullptr) return unsummarised;
    const int64_t q_begin = row0 / kMaskBlock, k_begin = col0 / kMaskBlock;
    int64_t q_end = (row0 + rows + kMaskBlock - 1) / kMaskBlock;
    int64_t k_end = (col0 + cols + kMaskBlock - 1) / kMaskBlock;
    q_end = query_stride == 0 ? q_begin + 1 : (q_end < query_blocks ? q_end : query_blocks);
    k_end = key_stride == 0 ? k_begin + 1 : (k_end < key_blocks ? k_end : key_blocks);
    uint8_t least = 2, most = 0;
    for (int64_t qb = q_begin; qb < q_end; ++qb) {
      for (int64_t kb = k_begin; kb < k_end; ++kb) {
        const uint8_t b = blocks[qb * query_stride + kb * key_stride];
        least = b < least ? b : least;
        most = b > most ? b : most;
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
  m.blocks = p.mask_blocks + (b / p.inner_batch) * s.outer + (b % p.inner_batch) * s.batch + h * s.head;
  m.query_stride = s.query;
  m.key_stride = s.key;
  m.query_blocks = mask_blocks_along(p.seqlen_q);
  m.key_blocks = mask_blocks_along(p.seqlen_k);
  return m;
}

}  // namespace jax_flash
