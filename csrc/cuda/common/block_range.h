// Which tiles of the score matrix a slice mask leaves anything visible in. Kernels skip the other tiles
// entirely and apply per-element masking only to tiles that straddle a mask boundary.
#pragma once

#include <cstdint>

#include "../../common/mask_blocks.h"
#include "../../common/score_pipeline.h"

namespace jax_flash::cuda {

// Tile indices [begin, end); empty when end <= begin.
struct TileSpan {
  int begin = 0;
  int end = 0;
  JF_HOST_DEVICE bool empty() const { return end <= begin; }
  JF_HOST_DEVICE int size() const { return end > begin ? end - begin : 0; }
  JF_HOST_DEVICE bool contains(int i) const { return i >= begin && i < end; }
};

JF_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Key tiles of width `block_n` that rows [row_begin, row_begin + rows) can see. key_begin and key_end are
// nondecreasing in the row, so the first row's begin and the last valid row's end bound the union.
JF_HOST_DEVICE TileSpan key_tiles_for_rows(const SliceMask& mask, int64_t row_begin, int rows, int block_n) {
  int64_t last_row = row_begin + rows - 1;
  if (last_row >= mask.valid_q) last_row = mask.valid_q - 1;
  if (last_row < row_begin) return {};
  const int64_t first_key = mask.key_begin(row_begin);
  const int64_t end_key = mask.key_end(last_row);
  if (end_key <= first_key) return {};
  return {static_cast<int>(first_key / block_n), static_cast<int>(ceil_div(end_key, block_n))};
}

// Query tiles of height `block_m` with a row that can see a key in [key_begin, key_begin + keys). Row i sees
// key j iff key_begin(i) <= j < key_end(i); solving both bounds for i's position gives one contiguous range of
// positions, whose rows are 2^position_shift times as many.
JF_HOST_DEVICE TileSpan query_tiles_for_keys(const SliceMask& mask, int64_t key_begin, int keys, int block_m) {
  int64_t key_end = key_begin + keys;
  if (key_end > mask.valid_k) key_end = mask.valid_k;
  if (key_end <= key_begin) return {};
  int64_t first_row = 0;
  int64_t end_row = mask.valid_q;
  const int64_t rows_per_position = int64_t(1) << mask.position_shift;
  if (mask.window_right >= 0) {
    const int64_t r = (key_begin - mask.diagonal_shift - mask.window_right) * rows_per_position;
    if (r > first_row) first_row = r;
  }
  if (mask.window_left >= 0) {
    const int64_t r = (key_end - mask.diagonal_shift + mask.window_left) * rows_per_position;
    if (r < end_row) end_row = r;
  }
  if (end_row <= first_row) return {};
  return {static_cast<int>(first_row / block_m), static_cast<int>(ceil_div(end_row, block_m))};
}

// Key tiles in which every key is visible to every row in [row_begin, row_begin + rows): they need no
// per-element mask. The tiles between the last row's first key and the first row's last key.
JF_HOST_DEVICE TileSpan fully_visible_key_tiles(const SliceMask& mask, int64_t row_begin, int rows, int block_n) {
  if (mask.q_segment_ids != nullptr || row_begin + rows > mask.valid_q) return {};
  const int64_t first_key = mask.key_begin(row_begin + rows - 1);
  const int64_t end_key = mask.key_end(row_begin);
  if (end_key <= first_key) return {};
  return {static_cast<int>(ceil_div(first_key, block_n)), static_cast<int>(end_key / block_n)};
}

// Query tiles of height `block_m` in which every row sees every key of [key_begin, key_begin + keys): the tiles m
// for which tile_fully_visible(mask, m * block_m, block_m, key_begin, keys) holds. One contiguous range: a tile
// qualifies when it lies inside valid_q (a prefix of the tiles), its last row's key_begin is at most key_begin (a
// prefix: nondecreasing in the row) and its first row's key_end at least key_begin + keys (a suffix, among rows
// inside valid_q). A loop over a key block's query tiles then compares two integers per tile instead of evaluating
// the position bounds (csrc/cuda/tests/tile_span_check.cc checks the two agree).
JF_HOST_DEVICE TileSpan fully_visible_query_tiles(const SliceMask& mask, int64_t key_begin, int keys, int block_m) {
  const int64_t key_end = key_begin + keys;
  if (mask.q_segment_ids != nullptr || key_end > mask.valid_k) return {};
  int64_t begin = 0;
  int64_t end = mask.valid_q / block_m;
  if (mask.window_right >= 0) {
    // key_end(row) >= key_end  <=>  position(row) >= key_end - diagonal_shift - window_right - 1
    const int64_t position = key_end - mask.diagonal_shift - mask.window_right - 1;
    if (position > 0) begin = ceil_div(position << mask.position_shift, block_m);
  }
  if (mask.window_left >= 0) {
    // key_begin(row) <= key_begin  <=>  position(row) <= key_begin - diagonal_shift + window_left
    const int64_t position = key_begin - mask.diagonal_shift + mask.window_left;
    if (position < 0) return {};
    const int64_t rows = (position + 1) << mask.position_shift;  // the rows at or below that position
    if (rows / block_m < end) end = rows / block_m;
  }
  if (end <= begin) return {};
  return {static_cast<int>(begin), static_cast<int>(end)};
}

// True when every (row, key) of the tile is visible, so the tile needs no per-element mask.
JF_HOST_DEVICE bool tile_fully_visible(const SliceMask& mask, int64_t row_begin, int rows, int64_t key_begin,
                                       int keys) {
  if (mask.q_segment_ids != nullptr) return false;
  if (row_begin + rows > mask.valid_q) return false;
  return mask.key_begin(row_begin + rows - 1) <= key_begin && key_begin + keys <= mask.key_end(row_begin);
}

// The first tile in [tile, end) that the boolean mask does not hide entirely (end if none); cover(t) is tile t's
// MaskCover (common/mask_blocks.h). Kernels walk their tiles with it, so hidden tiles are neither loaded nor
// computed: they would only contribute -inf scores (no probability, no gradient).
// How the boolean mask's block summary covers the kRows x kCols tile at (row0, col0) of slice (batch, head):
// general variant only (the common one has no mask: everything is visible). Rebuilt from the kernel parameters at
// each use rather than held in registers across the tile loop.
template <bool kGeneral, int kRows, int kCols>
JF_HOST_DEVICE MaskCover tile_mask_cover(const AttentionParams& p, int64_t batch, int64_t head, int64_t row0,
                                         int64_t col0) {
  if constexpr (kGeneral) {
    return make_slice_mask_blocks(p, batch, head).template cover<kRows, kCols>(row0, col0);
  } else {
    return MaskCover::kVisible;
  }
}

template <class Cover>
JF_HOST_DEVICE int next_unhidden_tile(int tile, int end, Cover const& cover) {
  while (tile < end && cover(tile) == MaskCover::kHidden) ++tile;
  return tile;
}

// The last tile in [begin, tile] that the boolean mask does not hide entirely (begin - 1 if none): the same walk for
// kernels that visit their tiles from last to first.
template <class Cover>
JF_HOST_DEVICE int previous_unhidden_tile(int tile, int begin, Cover const& cover) {
  while (tile >= begin && cover(tile) == MaskCover::kHidden) --tile;
  return tile;
}

}  // namespace jax_flash::cuda
