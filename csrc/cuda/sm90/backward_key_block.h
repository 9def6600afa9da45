// The keys one CTA of the Hopper dK/dV pass owns (every consumer form: backward_dkdv_kernel.h,
// backward_dkdv_split_consumer.h, backward_dkdv_tf32_consumer.h), the (query head, query tile) items it visits, and
// the store of its dK/dV rows.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../sm80/tensor_offsets.h"

namespace jax_flash::cuda::sm90 {

// An item: a query head and one of its query tiles (index in tiles of Traits::kBlockM rows).
struct ItemTile {
  int64_t head;
  int m_block;
};

// The keys a CTA owns and the (query head, query tile) items it visits, query heads outer; computed identically by
// every thread.
struct KeyBlock {
  int64_t batch;
  int64_t head_kv;
  int64_t group;        // query heads per KV head
  int64_t n0;           // first key
  int keys_in_bounds;   // keys of the tile that exist (< seqlen_k)
  SliceMask mask;       // of the group's first query head: position masks are the same for the whole group
  TileSpan query_tiles;
  int items;            // group * query_tiles.size()

  // Item `item`'s query head and tile, by division: for walks that skip items (the masked form's).
  __device__ ItemTile tile_of(int item) const {
    return {head_kv * group + item / query_tiles.size(), query_tiles.begin + item % query_tiles.size()};
  }
  __device__ ItemTile first_tile() const { return {head_kv * group, query_tiles.begin}; }
  // The item after `t`, for walks that visit every item: the division by the run-time tile count cost a d=64
  // consumer 25 instructions per item with a dependent MUFU.RCP chain, 7.5% of the dK/dV kernel's stall samples
  // (Nsight Compute on the H200, 8k keys; benchmarks/NOTES.md, 27th session).
  __device__ ItemTile next_tile(ItemTile t) const {
    return ++t.m_block == query_tiles.end ? ItemTile{t.head + 1, query_tiles.begin} : t;
  }
};

// The CTA's (key block, KV head, batch) where the slices ((batch, KV head) pairs) are cut into bands of
// band_slices and each band is ordered key block first: causal key blocks see fewer query tiles the later they
// start, so every band runs its longest CTAs first and the grid ends on short ones, instead of the last slice's
// longest block starting in the last wave; a band's Q, dO and dQ workspace rows are sized to stay in L2 together
// (backward_launch.h causal_band_slices).
__device__ inline sm80::BlockCoord banded_block_coord(int64_t linear, int num_n_blocks, int64_t heads_kv,
                                                      int64_t batch, int64_t band_slices) {
  const int64_t slices = heads_kv * batch;
  const int64_t band_ctas = band_slices * num_n_blocks;
  const int64_t first_slice = linear / band_ctas * band_slices;
  const int64_t in_band = linear % band_ctas;
  const int64_t width = min(band_slices, slices - first_slice);
  const int64_t slice = first_slice + in_band % width;
  return {static_cast<int>(in_band / width), slice % heads_kv, slice / heads_kv};
}

// Key block `linear` of the call, in the CTA order above (dkdv_kernel says which CTA takes which).
template <class Traits>
__device__ KeyBlock locate_key_block(const AttentionBackwardParams& p, int64_t band_slices, int64_t linear) {
  const int num_n_blocks = static_cast<int>(ceil_div(p.seqlen_k, Traits::kBlockN));
  const sm80::BlockCoord cta =
      band_slices > 0 ? banded_block_coord(linear, num_n_blocks, p.heads_kv, p.batch, band_slices)
                      : sm80::block_coord(static_cast<unsigned>(linear), num_n_blocks, p.heads_kv);
  KeyBlock kb;
  kb.batch = cta.batch;
  kb.head_kv = cta.head;
  kb.group = p.heads_q / p.heads_kv;
  kb.n0 = int64_t(cta.block) * Traits::kBlockN;
  kb.keys_in_bounds = static_cast<int>(min(int64_t(Traits::kBlockN), p.seqlen_k - kb.n0));
  kb.mask = make_slice_mask(p, kb.batch, kb.head_kv * kb.group);
  kb.query_tiles = query_tiles_for_keys(kb.mask, kb.n0, Traits::kBlockN, Traits::kBlockM);
  kb.items = static_cast<int>(kb.group) * kb.query_tiles.size();
  return kb;
}

// Stores rows [row_begin, row_end) of a [kBlockN, kHeadDim] tile of Traits::OutElement staged in `staged`
// (16-byte chunks; head_dim is a multiple of a chunk on this path: 8 bf16/fp16, 4 float32), or zeros when staged
// is null.
template <class Traits, class Staged>
__device__ void store_key_rows(const AttentionParams& p, const KeyBlock& kb, void* out, Staged const* staged,
                               int row_begin, int row_end, int thread, int threads) {
  using T = typename Traits::OutElement;
  constexpr int kChunk = 16 / int(sizeof(T));
  const sm80::BshdShape kv_shape = sm80::key_shape(p);
  constexpr int kChunksPerRow = Traits::kHeadDim / kChunk;
  const int chunks_in_bounds = static_cast<int>(p.head_dim / kChunk);
  const int rows = min(row_end, kb.keys_in_bounds) - row_begin;
  for (int i = thread; i < rows * kChunksPerRow; i += threads) {
    const int row = row_begin + i / kChunksPerRow, chunk = i % kChunksPerRow;
    if (chunk < chunks_in_bounds) {
      T* dst = static_cast<T*>(out) + kv_shape.offset(kb.batch, kb.n0 + row, kb.head_kv) + chunk * kChunk;
      *reinterpret_cast<uint4*>(dst) =
          staged ? *reinterpret_cast<const uint4*>(&(*staged)(row, chunk * kChunk)) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Stores a float32 accumulator tile `acc` of a key block's dK or dV (the fragment of `mma`, whose tile is [kRows,
// kCols]: the block's keys from its first, head-dim columns from col0, which the split-head-dim consumers take by
// halves; held by its thread `thread`) straight into `out`, leaving out keys past keys_in_bounds and columns past
// head_dim: the float32 gradients of float16 operands (AttentionBackwardParams::float32_gradients), which the
// 16-bit K and V buffers are too small to stage. Each warp's store writes 4 bytes at every other float of eight
// 32-byte row pieces (whole sectors once the neighbouring element's store lands); once per key block, so the
// epilogue's share of the pass stays small. The addresses are formed here, after the coordinates: computed as
// arguments by the caller instead, the d=128 fused-dQ kernel spilled 284 bytes (8 this way; ptxas, sm_90a).
template <int kRows, int kCols, class TiledMma, class Acc>
__device__ __forceinline__ void store_float_key_rows(const AttentionParams& p, const KeyBlock& kb, void* out,
                                                     TiledMma const& mma, int thread, Acc const& acc, int col0 = 0) {
  using namespace cute;
  const sm80::BshdShape kv_shape = sm80::key_shape(p);
  Tensor coords = mma.get_thread_slice(thread).partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
  float* base = static_cast<float*>(out) + kv_shape.offset(kb.batch, kb.n0, kb.head_kv);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int row = get<0>(coords(i)), col = col0 + get<1>(coords(i));
    if (row < kb.keys_in_bounds && col < p.head_dim) base[row * kv_shape.row_stride() + col] = acc(i);
  }
}

}  // namespace jax_flash::cuda::sm90
