// Which work items the Hopper backward visits under a boolean mask (the masked form, backward_form.h), from the
// mask's block summary (common/mask_blocks.h): an item whose mask blocks are all hidden contributes nothing (every
// score -inf: P = 0, dS = 0), so it is neither loaded nor computed. The summary is exact per 64 x 64 block and every
// tile of both kernels spans whole blocks, so each kernel skips exactly the (query tile, key tile) pairs with no
// visible element, whatever its own tile shape: the dK/dV kernel's items (query tiles of one key block, each query
// head of the group) and the dQ kernel's key tiles (of one query tile) cover the same visible pairs.
// Every function is a pure function of the kernel parameters and the CTA's block, so a kernel's producer threads
// and consumers walk the same list. The other forms compile none of it: every item exists.
#pragma once

#include <cstdint>

#include "../../common/attention_params.h"
#include "../../common/mask_blocks.h"
#include "../common/block_range.h"
#include "backward_form.h"
#include "backward_key_block.h"
#include "forward_kernel.h"  // RowBlock, locate_row_block

namespace jax_flash::cuda::sm90 {

// dK/dV kernel: the mask summary of a key block's items, built once per role from the kernel parameters, so that
// each item's cover is one or two byte loads at 32-bit offsets (a summary has one byte per 64 x 64 mask elements,
// so its slices lie far below 2^31 bytes). Walking items with make_slice_mask_blocks instead (its 64-bit batch
// split per item) spilled more (ptxas, d=128 dK/dV kernel: 388 against 234 bytes per thread, before the consumers
// stopped walking).
struct ItemMaskBlocks {
  const uint8_t* first = nullptr;  // the key block's first key block, query block 0, the group's first head
  MaskCover unsummarised = MaskCover::kVisible;  // the cover of every item when first is null (no summary)
  int head_step = 0;               // bytes per query head (0 where the mask broadcasts heads)
  int query_step = 0;              // bytes per query block
  int key_step = 0;                // bytes per key block
  int key_blocks = 0;              // key blocks of the key block inside the sequence (1 .. kBlockN / kMaskBlock)

  template <class Traits>
  __device__ static ItemMaskBlocks make(const AttentionParams& p, const KeyBlock& kb) {
    static_assert(Traits::kBlockM == kMaskBlock && Traits::kBlockN % kMaskBlock == 0,
                  "an item's query tile is one block row, its key tile whole block columns");
    ItemMaskBlocks m;
    const SliceMaskBlocks slice = make_slice_mask_blocks(p, kb.batch, kb.head_kv * kb.group);
    m.unsummarised = slice.unsummarised;
    if (slice.blocks == nullptr) return m;
    const int64_t k0 = kb.n0 / kMaskBlock;
    m.first = slice.blocks + k0 * slice.key_stride;
    m.head_step = static_cast<int>(p.mask_blocks_strides.head);
    m.query_step = static_cast<int>(slice.query_stride);
    m.key_step = static_cast<int>(slice.key_stride);
    m.key_blocks = static_cast<int>(min(int64_t(Traits::kBlockN / kMaskBlock), slice.key_blocks - k0));
    return m;
  }

  // The cover of item `item` (its query head and tile, KeyBlock::tile_of), as SliceMaskBlocks::cover says.
  template <class Traits>
  __device__ MaskCover cover(const KeyBlock& kb, int item) const {
    if (first == nullptr) return unsummarised;
    const int head = item / kb.query_tiles.size();
    const int m_block = kb.query_tiles.begin + item % kb.query_tiles.size();
    const uint8_t* row = first + head * head_step + m_block * query_step;
    unsigned least = 2, most = 0;
    CUTE_UNROLL
    for (int k = 0; k < Traits::kBlockN / kMaskBlock; ++k) {
      if (k < key_blocks) {
        const unsigned b = row[k * key_step];
        least = b < least ? b : least;
        most = b > most ? b : most;
      }
    }
    if (most == 0) return MaskCover::kHidden;
    return least >= 2 ? MaskCover::kVisible : MaskCover::kPartial;
  }
};

// The ItemMaskBlocks of a role of the dK/dV kernel (empty in the forms without a mask).
template <class Traits, BackwardForm kForm>
__device__ ItemMaskBlocks item_mask_blocks(const AttentionParams& p, const KeyBlock& kb) {
  if constexpr (reads_boolean_mask(kForm)) {
    return ItemMaskBlocks::make<Traits>(p, kb);
  } else {
    return {};
  }
}

// dK/dV kernel: the first item at or after `item` that the mask does not hide entirely; kb.items if none.
template <class Traits, BackwardForm kForm>
__device__ __forceinline__ int next_item(const KeyBlock& kb, const ItemMaskBlocks& blocks, int item) {
  if constexpr (reads_boolean_mask(kForm)) {
    return next_unhidden_tile(item, kb.items, [&](int i) { return blocks.template cover<Traits>(kb, i); });
  } else {
    return item;
  }
}

// dQ kernel: how the mask covers key tile n_block of row block rb (rebuilt from the parameters at each use, so the
// consumers hold no summary pointer through their score step).
template <class Traits, BackwardForm kForm>
__device__ MaskCover key_tile_mask_cover(const AttentionParams& p, const RowBlock& rb, int n_block) {
  if constexpr (reads_boolean_mask(kForm)) {
    return QueryTileMaskBlocks::make<Traits::kBlockM>(p, rb.batch, rb.head, rb.m0)
        .template cover<Traits::kBlockN>(p, int64_t(n_block) * Traits::kBlockN);
  } else {
    return MaskCover::kVisible;
  }
}

// dQ kernel (key tiles run last to first): the last key tile at or before n_block that the mask does not hide
// entirely; rb.key_tiles.begin - 1 if none.
template <class Traits, BackwardForm kForm>
__device__ __forceinline__ int previous_key_tile(const AttentionParams& p, const RowBlock& rb, int n_block) {
  if constexpr (reads_boolean_mask(kForm)) {
    return previous_unhidden_tile(n_block, rb.key_tiles.begin,
                                  [&](int n) { return key_tile_mask_cover<Traits, kForm>(p, rb, n); });
  } else {
    return n_block;
  }
}

// dQ kernel's row block: the forward's (locate_row_block), with key_tiles ending after the last key tile the mask
// leaves anything visible in (where every walk starts), so a row block that sees nothing is empty (dQ = 0).
template <class Traits, BackwardForm kForm>
__device__ RowBlock locate_backward_row_block(const AttentionBackwardParams& p) {
  RowBlock rb = locate_row_block<Traits>(p);
  if constexpr (reads_boolean_mask(kForm)) {
    if (!rb.key_tiles.empty()) rb.key_tiles.end = previous_key_tile<Traits, kForm>(p, rb, rb.key_tiles.end - 1) + 1;
  }
  return rb;
}

}  // namespace jax_flash::cuda::sm90
