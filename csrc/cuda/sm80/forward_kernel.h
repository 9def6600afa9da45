// FlashAttention-2-style forward: one CTA owns kBlockM query rows of one (batch, head) and streams the key
// tiles its masks leave visible (position masks by range, the boolean mask by its block summary) through a
// kStages-deep cp.async pipeline. Per tile: S = Q K^T (both from swizzled smem via ldmatrix), the score
// pipeline, an online-softmax update, and O += P V with P converted to 16-bit in registers and V read by
// ldmatrix.trans.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "fragments.h"
#include "gmem_tile.h"
#include "kernel_traits.h"
#include "online_softmax.h"
#include "score_tile.h"
#include "tensor_offsets.h"

namespace jax_flash::cuda::sm80 {

template <class Traits, bool kGeneral>
__global__ void __launch_bounds__(Traits::kThreads, 1) forward_kernel(const AttentionParams p, bool vectorized) {
  using namespace cute;
  using T = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kThreads = Traits::kThreads;
  using QTile = TileCopy<T, kBlockM, kHeadDim, kThreads, typename Traits::SmemLayoutQ>;
  using KVTile = TileCopy<T, kBlockN, kHeadDim, kThreads, typename Traits::SmemLayoutKV>;

  extern __shared__ __align__(128) char smem_bytes[];
  T* smem_q = reinterpret_cast<T*>(smem_bytes);  // reused to stage O for the store
  T* smem_k = smem_q + Traits::kQElems;
  T* smem_v = smem_k + kStages * Traits::kKVElems;

  const int num_m_blocks = static_cast<int>(ceil_div(p.seqlen_q, kBlockM));
  const BlockCoord cta = decode_block_coord(num_m_blocks, p.heads_q);
  // Longest causal row blocks first, so the short ones fill the tail of the grid.
  const int m_block = num_m_blocks - 1 - cta.block;
  const int64_t head_kv = cta.head / (p.heads_q / p.heads_kv);
  const SliceMask mask = make_slice_mask(p, cta.batch, cta.head);

  const int64_t m0 = int64_t(m_block) * kBlockM;
  const int rows_in_bounds = static_cast<int>(min(int64_t(kBlockM), p.seqlen_q - m0));
  const BshdShape q_shape = query_shape(p);
  const BshdShape kv_shape = key_shape(p);
  const int64_t q_offset = q_shape.offset(cta.batch, m0, cta.head);
  T* out = static_cast<T*>(p.o) + q_offset;
  float* lse_out = p.lse + row_stat_offset(p, cta.batch, cta.head, m0);

  const TileSpan key_tiles = key_tiles_for_rows(mask, m0, kBlockM, kBlockN);
  auto mask_cover = [&](int n_block) {
    return tile_mask_cover<kGeneral, kBlockM, kBlockN>(p, cta.batch, cta.head, m0, int64_t(n_block) * kBlockN);
  };
  auto next_tile = [&](int n_block) { return next_unhidden_tile(n_block, key_tiles.end, mask_cover); };
  const int first_tile = next_tile(key_tiles.begin);
  if (first_tile >= key_tiles.end) {  // no visible key: o = 0, lse = -inf
    QTile::store_zeros(out, q_shape.row_stride(), rows_in_bounds, p.head_dim);
    for (int r = threadIdx.x; r < rows_in_bounds; r += kThreads) lse_out[r] = -INFINITY;
    return;
  }

  // Load: Q once, then the first kStages - 1 key tiles, one cp.async group each.
  const int q_valid_rows = static_cast<int>(max(int64_t(0), min(int64_t(kBlockM), mask.valid_q - m0)));
  QTile::load(smem_q, static_cast<const T*>(p.q) + q_offset, q_shape.row_stride(), q_valid_rows, p.head_dim,
              vectorized);
  cp_async_fence();
  const T* k_head = static_cast<const T*>(p.k) + kv_shape.offset(cta.batch, 0, head_kv);
  const T* v_head = static_cast<const T*>(p.v) + kv_shape.offset(cta.batch, 0, head_kv);
  const int valid_k = static_cast<int>(mask.valid_k);
  auto load_key_tile = [&](int n_block, int stage) {
    const int64_t n0 = int64_t(n_block) * kBlockN;
    const int valid = min(kBlockN, valid_k - n_block * kBlockN);
    const int64_t offset = n0 * kv_shape.row_stride();
    KVTile::load(smem_k + stage * Traits::kKVElems, k_head + offset, kv_shape.row_stride(), valid, p.head_dim,
                 vectorized);
    KVTile::load(smem_v + stage * Traits::kKVElems, v_head + offset, kv_shape.row_stride(), valid, p.head_dim,
                 vectorized);
  };
  // Two K/V buffers: the next visible tile loads while this one is computed.
  static_assert(kStages == 2, "the key-tile loop prefetches exactly one tile ahead");
  load_key_tile(first_tile, 0);
  cp_async_fence();

  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(threadIdx.x);
  auto copy_q = make_tiled_copy_A(Copy_Atom<LdsmCopy, T>{}, mma);
  auto copy_k = make_tiled_copy_B(Copy_Atom<LdsmCopy, T>{}, mma);
  auto copy_vt = make_tiled_copy_B(Copy_Atom<LdsmTransposedCopy, T>{}, mma);
  auto thr_copy_k = copy_k.get_thread_slice(threadIdx.x);
  auto thr_copy_vt = copy_vt.get_thread_slice(threadIdx.x);

  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  auto sK = [&](int stage) {
    return make_tensor(make_smem_ptr(smem_k + stage * Traits::kKVElems), typename Traits::SmemLayoutKV{});
  };
  auto sVt = [&](int stage) {
    return make_tensor(make_smem_ptr(smem_v + stage * Traits::kKVElems), typename Traits::SmemLayoutKVt{});
  };
  Tensor frag_q = thr_mma.partition_fragment_A(sQ);
  Tensor frag_k = thr_mma.partition_fragment_B(sK(0));
  Tensor frag_vt = thr_mma.partition_fragment_B(sVt(0));
  Tensor smem_q_part = copy_q.get_thread_slice(threadIdx.x).partition_S(sQ);

  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  // (row, column) inside the score tile of each accumulator element this thread holds.
  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kRowsPerThread = decltype(size<0>(rows_cols(acc_o.layout())))::value;
  OnlineSoftmax<kRowsPerThread> softmax;
  softmax.reset();
  const float to_log2 = ScoreTile<kGeneral>::to_log2(p);

  // One key tile: S = Q K^T, scores, online softmax, O += P V. Instantiated with and without the per-element
  // mask so that interior tiles carry none of its registers or instructions.
  auto attend_to_tile = [&](int n_block, int stage, bool read_boolean_mask, auto check_mask)
                            __attribute__((always_inline)) {
    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    // Dropout keep bits first, while the score accumulators are not yet live (Philox needs a dozen registers).
    [[maybe_unused]] KeepBitsFor<decltype(coords)> keep;
    [[maybe_unused]] const bool dropping = kGeneral && p.dropout_rate > 0.0f;
    if constexpr (kGeneral) {
      if (dropping) keep.compute(SliceDropout::make(p, cta.batch, cta.head), coords, m0, int64_t(n_block) * kBlockN);
    }
    clear(acc_s);
    gemm_smem_smem(mma, acc_s, frag_q, frag_k, smem_q_part, thr_copy_k.partition_S(sK(stage)), copy_q, copy_k);
    ScoreTile<kGeneral>::make(p, cta.batch, cta.head, read_boolean_mask)
        .apply<decltype(check_mask)::value>(acc_s, coords, m0, int64_t(n_block) * kBlockN);
    softmax.update(as_rows_cols(acc_s), as_rows_cols(acc_o), to_log2);
    if constexpr (kGeneral) {
      // The row sums (and so the lse) are of the undropped probabilities; only P V sees the dropout.
      if (dropping) {
        const float keep_scale = 1.0f / (1.0f - p.dropout_rate);
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) acc_s(i) = keep.kept(i) ? acc_s(i) * keep_scale : 0.0f;
      }
    }
    Tensor probs = converted<T>(acc_s);
    Tensor probs_operand = make_tensor(probs.data(), accumulator_as_operand_a(probs.layout()));
    gemm_reg_smem(mma, acc_o, probs_operand, frag_vt, thr_copy_vt.partition_S(sVt(stage)), copy_vt);
  };

  const TileSpan interior = fully_visible_key_tiles(mask, m0, kBlockM, kBlockN);
  // cursor: the tile's index times 2 plus the buffer stage it was loaded into (one register, as a plain index);
  // the next unhidden tile is found again at the end of each step rather than held across the tile's math.
  for (int cursor = first_tile * 2; (cursor >> 1) < key_tiles.end;) {
    const int n_block = cursor >> 1;
    const int stage = cursor & 1;
    cp_async_wait<0>();
    // Tile n_block is in smem for everyone, and everyone is done with the stage the prefetch overwrites.
    __syncthreads();
    const int next = next_tile(n_block + 1);
    if (next < key_tiles.end) load_key_tile(next, stage ^ 1);
    cp_async_fence();
    const bool read_boolean_mask = mask_cover(n_block) != MaskCover::kVisible;
    if (n_block >= interior.begin && n_block < interior.end) {
      attend_to_tile(n_block, stage, read_boolean_mask, cute::false_type{});
    } else {
      attend_to_tile(n_block, stage, read_boolean_mask, cute::true_type{});
    }
    cursor = next_tile(n_block + 1) * 2 + (stage ^ 1);
  }

  // Epilogue: normalise, stage O in smem (Q's buffer) for 16-byte row stores, write lse.
  float lse[kRowsPerThread];
  softmax.finalize(as_rows_cols(acc_o), to_log2, lse);
  Tensor out_frag = converted<T>(acc_o);
  cp_async_wait<0>();
  __syncthreads();
  auto copy_o = make_tiled_copy_C(Copy_Atom<UniversalCopy<uint32_t>, T>{}, mma);
  auto thr_copy_o = copy_o.get_thread_slice(threadIdx.x);
  copy(copy_o, thr_copy_o.retile_S(out_frag), thr_copy_o.partition_D(sQ));
  __syncthreads();
  QTile::store(out, smem_q, q_shape.row_stride(), rows_in_bounds, p.head_dim, vectorized);

  if (threadIdx.x % 4 == 0) {  // one thread of each quad holds the row's statistics
    Tensor row_coords = as_rows_cols(coords);
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = get<0>(row_coords(r, 0));
      if (row < rows_in_bounds) lse_out[row] = lse[r];
    }
  }
}

}  // namespace jax_flash::cuda::sm80
