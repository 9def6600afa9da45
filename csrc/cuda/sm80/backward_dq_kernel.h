// Backward, dQ pass: one CTA owns kBlockM query rows of one head (the forward's shape) and streams the visible
// key tiles (picked as in the forward), recomputing S and dP and keeping dQ in registers, so dQ is formed in one
// fixed order with no atomics. Recomputing costs two GEMMs per tile, yet on the H200 (d=128, seqlen 4k) this
// pass plus the dK/dV pass ran 11% faster than accumulating dS K into a float32 workspace with atomics inside the
// dK/dV pass (228 vs 204 TFLOP/s), and it is deterministic for free. A later fused form (kFusedDq in
// backward_dkdv_kernel.h, 8-byte reductions) measured 233 vs 223 and is now the default of non-deterministic
// common-variant calls with head_dim <= 128 (jax_flash/_ffi_calls.py); this pass serves the rest. The general
// variant also hands each dS to dbias (DbiasMode; backward_launch.h decides).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../common/block_range.h"
#include "fragments.h"
#include "gmem_tile.h"
#include "kernel_traits.h"
#include "dbias.h"
#include "row_stats.h"
#include "score_tile.h"
#include "tensor_offsets.h"

namespace jax_flash::cuda::sm80 {

template <class Traits, bool kGeneral>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    dq_kernel(const AttentionBackwardParams p, bool vectorized, DbiasMode dbias_mode) {
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
  T* smem_q = reinterpret_cast<T*>(smem_bytes);  // Q, then dQ for the store
  T* smem_do = smem_q + Traits::kQElems;
  T* smem_k = smem_do + Traits::kQElems;
  T* smem_v = smem_k + kStages * Traits::kKVElems;

  const int num_m_blocks = static_cast<int>(ceil_div(p.seqlen_q, kBlockM));
  const BlockCoord cta = decode_block_coord(num_m_blocks, p.heads_q);
  const int m_block = num_m_blocks - 1 - cta.block;
  const int64_t head_kv = cta.head / (p.heads_q / p.heads_kv);
  const SliceMask mask = make_slice_mask(p, cta.batch, cta.head);
  const int64_t m0 = int64_t(m_block) * kBlockM;
  const int rows_in_bounds = static_cast<int>(min(int64_t(kBlockM), p.seqlen_q - m0));
  const BshdShape q_shape = query_shape(p);
  const BshdShape kv_shape = key_shape(p);
  const int64_t q_offset = q_shape.offset(cta.batch, m0, cta.head);
  T* dq_out = static_cast<T*>(p.dq) + q_offset;
  float* const dbias_slice = kGeneral && dbias_mode != DbiasMode::kNone ? dbias_slice_of(p, cta.batch, cta.head) : nullptr;

  const TileSpan key_tiles = key_tiles_for_rows(mask, m0, kBlockM, kBlockN);
  // As in the forward: key tiles whose boolean-mask blocks are all hidden are skipped (general variant).
  auto mask_cover = [&](int n_block) {
    return tile_mask_cover<kGeneral, kBlockM, kBlockN>(p, cta.batch, cta.head, m0, int64_t(n_block) * kBlockN);
  };
  auto next_tile = [&](int n_block) { return next_unhidden_tile(n_block, key_tiles.end, mask_cover); };
  const int first_tile = next_tile(key_tiles.begin);
  if (first_tile >= key_tiles.end) {
    QTile::store_zeros(dq_out, q_shape.row_stride(), rows_in_bounds, p.head_dim);
    return;
  }

  const int q_valid_rows = static_cast<int>(max(int64_t(0), min(int64_t(kBlockM), mask.valid_q - m0)));
  QTile::load(smem_q, static_cast<const T*>(p.q) + q_offset, q_shape.row_stride(), q_valid_rows, p.head_dim,
              vectorized);
  QTile::load(smem_do, static_cast<const T*>(p.d_o) + q_offset, q_shape.row_stride(), q_valid_rows, p.head_dim,
              vectorized);
  cp_async_fence();
  const T* k_head = static_cast<const T*>(p.k) + kv_shape.offset(cta.batch, 0, head_kv);
  const T* v_head = static_cast<const T*>(p.v) + kv_shape.offset(cta.batch, 0, head_kv);
  const int valid_k = static_cast<int>(mask.valid_k);
  auto load_key_tile = [&](int n_block, int stage) {
    const int valid = min(kBlockN, valid_k - n_block * kBlockN);
    const int64_t offset = int64_t(n_block) * kBlockN * kv_shape.row_stride();
    KVTile::load(smem_k + stage * Traits::kKVElems, k_head + offset, kv_shape.row_stride(), valid, p.head_dim,
                 vectorized);
    KVTile::load(smem_v + stage * Traits::kKVElems, v_head + offset, kv_shape.row_stride(), valid, p.head_dim,
                 vectorized);
  };
  // Two K/V buffers: the next visible tile loads while this one is computed.
  static_assert(kStages == 2, "the key-tile loop prefetches exactly one tile ahead");
  load_key_tile(first_tile, 0);
  cp_async_fence();

  const int tid = threadIdx.x;
  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  auto copy_a = make_tiled_copy_A(Copy_Atom<LdsmCopy, T>{}, mma);
  auto copy_b = make_tiled_copy_B(Copy_Atom<LdsmCopy, T>{}, mma);
  auto copy_bt = make_tiled_copy_B(Copy_Atom<LdsmTransposedCopy, T>{}, mma);
  auto thr_copy_b = copy_b.get_thread_slice(tid);
  auto thr_copy_bt = copy_bt.get_thread_slice(tid);

  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQ{});
  auto sK = [&](int stage) {
    return make_tensor(make_smem_ptr(smem_k + stage * Traits::kKVElems), typename Traits::SmemLayoutKV{});
  };
  auto sKt = [&](int stage) {
    return make_tensor(make_smem_ptr(smem_k + stage * Traits::kKVElems), typename Traits::SmemLayoutKVt{});
  };
  auto sV = [&](int stage) {
    return make_tensor(make_smem_ptr(smem_v + stage * Traits::kKVElems), typename Traits::SmemLayoutKV{});
  };
  Tensor frag_q = thr_mma.partition_fragment_A(sQ);
  Tensor frag_do = thr_mma.partition_fragment_A(sdO);
  Tensor frag_k = thr_mma.partition_fragment_B(sK(0));
  Tensor frag_v = thr_mma.partition_fragment_B(sV(0));
  Tensor frag_kt = thr_mma.partition_fragment_B(sKt(0));
  Tensor smem_q_part = copy_a.get_thread_slice(tid).partition_S(sQ);
  Tensor smem_do_part = copy_a.get_thread_slice(tid).partition_S(sdO);

  Tensor acc_dq = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);
  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kRowsPerThread = decltype(size<0>(rows_cols(coords.layout())))::value;
  RowStats<kRowsPerThread> stats;
  stats.load(p, cta.batch, cta.head, m0, coords);
  const float to_log2 = ScoreTile<kGeneral>::to_log2(p);

  auto accumulate_key_tile = [&](int n_block, int stage, bool read_boolean_mask, auto check_mask)
                                 __attribute__((always_inline)) {
    const int64_t n0 = int64_t(n_block) * kBlockN;
    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    KeepBitsFor<decltype(coords)> keep;
    if constexpr (kGeneral) backward_keep_bits(keep, p, cta.batch, cta.head, coords, m0, n0);
    clear(acc_s);
    clear(acc_dp);
    gemm_smem_smem(mma, acc_s, frag_q, frag_k, smem_q_part, thr_copy_b.partition_S(sK(stage)), copy_a, copy_b);
    gemm_smem_smem(mma, acc_dp, frag_do, frag_v, smem_do_part, thr_copy_b.partition_S(sV(stage)), copy_a, copy_b);
    const auto scorer = ScoreTile<kGeneral>::make(p, cta.batch, cta.head, read_boolean_mask);
    if constexpr (kGeneral) {
      backward_scores<kGeneral, decltype(check_mask)::value>(
          scorer, p, keep, acc_s, acc_dp, coords, stats, m0, n0, to_log2,
          [&](int, int, int64_t row, int64_t col, float dscore) {
            if (dbias_mode == DbiasMode::kStore) {
              dbias_slice[row * p.bias_strides.query + col * p.bias_strides.key] = dscore;
            } else if (dbias_mode == DbiasMode::kAtomicAdd) {
              atomicAdd(dbias_slice + row * p.bias_strides.query + col * p.bias_strides.key, dscore);
            }
          });
    } else {
      backward_scores<kGeneral, decltype(check_mask)::value>(scorer, p, keep, acc_s, acc_dp, coords, stats, m0, n0,
                                                              to_log2);
    }
    Tensor score_grads = converted<T>(acc_dp);
    Tensor score_grads_operand = make_tensor(score_grads.data(), accumulator_as_operand_a(score_grads.layout()));
    gemm_reg_smem(mma, acc_dq, score_grads_operand, frag_kt, thr_copy_bt.partition_S(sKt(stage)), copy_bt);
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
      accumulate_key_tile(n_block, stage, read_boolean_mask, cute::false_type{});
    } else {
      accumulate_key_tile(n_block, stage, read_boolean_mask, cute::true_type{});
    }
    cursor = next_tile(n_block + 1) * 2 + (stage ^ 1);
  }

  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) *= p.softmax_scale;
  Tensor dq_frag = converted<T>(acc_dq);
  cp_async_wait<0>();
  __syncthreads();
  auto copy_out = make_tiled_copy_C(Copy_Atom<UniversalCopy<uint32_t>, T>{}, mma);
  auto thr_copy_out = copy_out.get_thread_slice(tid);
  copy(copy_out, thr_copy_out.retile_S(dq_frag), thr_copy_out.partition_D(sQ));
  __syncthreads();
  QTile::store(dq_out, smem_q, q_shape.row_stride(), rows_in_bounds, p.head_dim, vectorized);
}

}  // namespace jax_flash::cuda::sm80
