// Backward, dK/dV pass: one CTA owns kBlockN keys of one KV head and keeps their dK and dV in registers while
// it streams every query tile that can see them (by position, and by the boolean mask's block summary), for
// every query head of the GQA group (so dK/dV are summed over the group without per-query-head copies, in a
// fixed order). Per query tile:
//   S = Q K^T, dP = dO V^T          (scores recomputed; warp grid 2x4)
//   P = exp(S - lse), dS = P (dP - D)   (general variant: dropout as in row_stats.h)
//   dV += P^T dO, dK += dS^T Q      (P, dS staged in smem and read transposed; warp grid 4x2)
// dQ comes from its own pass (backward_dq_kernel.h), or, in the fused form (kFusedDq: a call with a dq_accum
// workspace, not deterministic, common variant), from this one, between dV's and dK's GEMMs:
//   dQ_item = dS K                  (dS from the same smem tile, read row-wise; K resident; warp grid 2x4)
//   dq_accum += dQ_item             (float32 reductions in L2 into the item's workspace tile, common/dq_accum.h)
// which replaces the dQ pass's recomputed S and dP (and its own dS K): 5 GEMMs per item instead of 7, for
// kBlockM x head_dim float reductions per item. The fused form also splits its last wave's blocks across every SM
// (dkdv_tail_plan.h): a CTA there runs a piece of a block's items and adds its dK/dV to the block's workspace slot
// instead of storing them.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../common/block_range.h"
#include "../common/bulk_reduce.h"
#include "../common/dq_accum.h"
#include "../common/grid_dependency.h"
#include "dkdv_tail.h"
#include "fragments.h"
#include "gmem_tile.h"
#include "kernel_traits.h"
#include "row_stats.h"
#include "score_tile.h"
#include "tensor_offsets.h"

namespace jax_flash::cuda::sm80 {

// One CTA: key block blockIdx.x whole; or with kPiece (the fused form's split tail, dkdv_tail_plan.h, launched after
// the whole blocks) piece tail.full_blocks + blockIdx.x of a tail block's items, whose dK/dV it adds to the block's
// slot instead of storing them. The piece arithmetic is all under kPiece, so that the whole blocks run the code
// without it: with pieces in the same launch (the body a device function taking the parameters by reference, with a
// segment walk) the whole blocks ran 3% slower at d=128 4k (seventeenth session). `tail` is unused without kPiece.
template <class Traits, bool kGeneral, bool kFusedDq, bool kPiece = false>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    dkdv_kernel(const AttentionBackwardParams p, bool vectorized, const DkdvTail tail) {
  static_assert(kFusedDq || !kPiece, "only the fused form splits its tail");
  static_assert(!(kGeneral && kFusedDq), "fused dQ is built for the common variant (dbias needs the dQ pass)");
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
  T* smem_k = reinterpret_cast<T*>(smem_bytes);  // K, then dK for the store
  T* smem_v = smem_k + Traits::kKVElems;          // V, then dV
  T* smem_q = smem_v + Traits::kKVElems;          // kStages buffers
  T* smem_do = smem_q + kStages * Traits::kQElems;
  T* smem_p = smem_do + kStages * Traits::kQElems;
  T* smem_ds = smem_p + Traits::kPElems;

  // The pieces add only to their own slots and (like every block) to dq_accum, so they may start on the SMs that the
  // last whole blocks free (backward_launch.h launches them as a dependent grid on sm_90); each piece waits for the
  // whole blocks before it exits, so that the conversions queued after the pieces follow both.
  if constexpr (kFusedDq && !kPiece) allow_dependent_grid();
  const int num_n_blocks = static_cast<int>(ceil_div(p.seqlen_k, kBlockN));
  DkdvSegment segment;
  if constexpr (kPiece) segment = dkdv_segment_of(tail, int64_t(tail.full_blocks) + blockIdx.x);
  const BlockCoord cta = kPiece ? block_coord(static_cast<unsigned>(segment.block), num_n_blocks, p.heads_kv)
                                : decode_block_coord(num_n_blocks, p.heads_kv);
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t n0 = int64_t(cta.block) * kBlockN;
  const int keys_in_bounds = static_cast<int>(min(int64_t(kBlockN), p.seqlen_k - n0));
  const BshdShape q_shape = query_shape(p);
  const BshdShape kv_shape = key_shape(p);
  const int64_t kv_offset = kv_shape.offset(cta.batch, n0, cta.head);

  // Position masks are the same for every head of the group (only the ALiBi slope differs).
  const SliceMask group_mask = make_slice_mask(p, cta.batch, cta.head * group);
  const TileSpan query_tiles = query_tiles_for_keys(group_mask, n0, kBlockN, kBlockM);
  const int items = static_cast<int>(group) * query_tiles.size();  // (query head, query tile) pairs
  const int item_end = kPiece ? min(items, segment.item_end) : items;
  auto item_head = [&](int item) { return cta.head * group + item / query_tiles.size(); };
  auto item_row0 = [&](int item) { return int64_t(query_tiles.begin + item % query_tiles.size()) * kBlockM; };
  // How the boolean mask's block summary covers an item's tile (general variant only); items it hides entirely
  // are skipped, so a KV head whose keys no query head sees (a padded tail) loads and computes nothing.
  auto mask_cover = [&](int item) {
    return tile_mask_cover<kGeneral, kBlockM, kBlockN>(p, cta.batch, item_head(item), item_row0(item), n0);
  };
  auto next_item = [&](int item) { return next_unhidden_tile(item, item_end, mask_cover); };
  const int first_item = next_item(kPiece ? segment.item_begin : 0);
  if (first_item >= item_end) {
    if constexpr (kPiece) {  // adds nothing to the slot (zeroed by the launcher)
      wait_for_prior_grid();
      return;
    }
    KVTile::store_zeros(static_cast<T*>(p.dk) + kv_offset, kv_shape.row_stride(), keys_in_bounds, p.head_dim);
    KVTile::store_zeros(static_cast<T*>(p.dv) + kv_offset, kv_shape.row_stride(), keys_in_bounds, p.head_dim);
    return;
  }

  // Load: K and V once, then the first kStages - 1 (Q, dO) tiles.
  const int valid_keys = static_cast<int>(max(int64_t(0), min(int64_t(kBlockN), group_mask.valid_k - n0)));
  KVTile::load(smem_k, static_cast<const T*>(p.k) + kv_offset, kv_shape.row_stride(), valid_keys, p.head_dim,
               vectorized);
  KVTile::load(smem_v, static_cast<const T*>(p.v) + kv_offset, kv_shape.row_stride(), valid_keys, p.head_dim,
               vectorized);
  cp_async_fence();
  const int valid_q = static_cast<int>(group_mask.valid_q);
  auto load_query_tile = [&](int item, int stage) {
    const int64_t m0 = item_row0(item);
    const int valid = static_cast<int>(min(int64_t(kBlockM), valid_q - m0));
    const int64_t offset = q_shape.offset(cta.batch, m0, item_head(item));
    QTile::load(smem_q + stage * Traits::kQElems, static_cast<const T*>(p.q) + offset, q_shape.row_stride(), valid,
                p.head_dim, vectorized);
    QTile::load(smem_do + stage * Traits::kQElems, static_cast<const T*>(p.d_o) + offset, q_shape.row_stride(),
                valid, p.head_dim, vectorized);
  };
  // One Q/dO buffer (loaded at the top of each step) or two (the next item's loads overlap this one's math).
  static_assert(kStages == 1 || kStages == 2, "the item loop prefetches at most one item ahead");
  if constexpr (kStages == 2) {
    load_query_tile(first_item, 0);
    cp_async_fence();
  }

  const int tid = threadIdx.x;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto copy_sdp_a = make_tiled_copy_A(Copy_Atom<LdsmCopy, T>{}, mma_sdp);
  auto copy_sdp_b = make_tiled_copy_B(Copy_Atom<LdsmCopy, T>{}, mma_sdp);
  auto copy_dkv_a = make_tiled_copy_A(Copy_Atom<LdsmTransposedCopy, T>{}, mma_dkv);
  auto copy_dkv_b = make_tiled_copy_B(Copy_Atom<LdsmTransposedCopy, T>{}, mma_dkv);

  using LayoutQ = typename Traits::SmemLayoutQ;
  using LayoutQt = typename Traits::SmemLayoutQt;
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutP{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutP{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPt{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPt{});
  auto sQ = [&](int stage) { return make_tensor(make_smem_ptr(smem_q + stage * Traits::kQElems), LayoutQ{}); };
  auto sdO = [&](int stage) { return make_tensor(make_smem_ptr(smem_do + stage * Traits::kQElems), LayoutQ{}); };
  auto sQt = [&](int stage) { return make_tensor(make_smem_ptr(smem_q + stage * Traits::kQElems), LayoutQt{}); };
  auto sdOt = [&](int stage) { return make_tensor(make_smem_ptr(smem_do + stage * Traits::kQElems), LayoutQt{}); };

  Tensor frag_q = thr_sdp.partition_fragment_A(sQ(0));
  Tensor frag_do = thr_sdp.partition_fragment_A(sdO(0));
  Tensor frag_k = thr_sdp.partition_fragment_B(sK);
  Tensor frag_v = thr_sdp.partition_fragment_B(sV);
  Tensor frag_pt = thr_dkv.partition_fragment_A(sPt);
  Tensor frag_dst = thr_dkv.partition_fragment_A(sdSt);
  Tensor frag_dot = thr_dkv.partition_fragment_B(sdOt(0));
  Tensor frag_qt = thr_dkv.partition_fragment_B(sQt(0));
  Tensor smem_k_part = copy_sdp_b.get_thread_slice(tid).partition_S(sK);
  Tensor smem_v_part = copy_sdp_b.get_thread_slice(tid).partition_S(sV);
  Tensor smem_pt_part = copy_dkv_a.get_thread_slice(tid).partition_S(sPt);
  Tensor smem_dst_part = copy_dkv_a.get_thread_slice(tid).partition_S(sdSt);
  // Fused dQ only (unused tensors cost no registers in the other forms): dS as the A operand, K^T as the B.
  auto copy_sdp_bt = make_tiled_copy_B(Copy_Atom<LdsmTransposedCopy, T>{}, mma_sdp);
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
  Tensor frag_ds = thr_sdp.partition_fragment_A(sdS);
  Tensor frag_kt = thr_sdp.partition_fragment_B(sKt);
  Tensor smem_ds_part = copy_sdp_a.get_thread_slice(tid).partition_S(sdS);
  Tensor smem_kt_part = copy_sdp_bt.get_thread_slice(tid).partition_S(sKt);
  Tensor dq_coords = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // The warp grid spans 64 columns, so at d=96 (or 32) the dQ accumulator is padded to the next multiple and its
  // extra columns lie past the row: only a grid that divides the head dim may leave out the column tests.
  constexpr bool kDqTileExact = Traits::kDqTileExact;
  // Built for sm_90, the fused dQ stages each item's tile in shared memory (after the kSmemBytes above), in the
  // workspace chunk's order, and thread 0 adds the whole tile with one bulk reduction, issued after the next CTA
  // barrier that the loop passes anyway (the next item's, or the epilogue's), so staging needs no barrier of its
  // own. The ninth session's form (one bulk reduction per row after a barrier of its own) ran d=128 4k at 259
  // against 253 TFLOP/s with a red.global per pair and 342 without reductions (NOTES.md). The launcher runs the
  // fused form only where head_dim % 4 == 0 (whole column groups; a tile a multiple of 16 bytes).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kBulkDq = kFusedDq;
#else
  constexpr bool kBulkDq = false;
#endif
  // Computed where used, not kept live across the item loop.
  auto dq_staging = [&]() { return reinterpret_cast<float*>(smem_bytes + Traits::kSmemBytes); };
  // The item whose staged tile awaits its bulk reduction (-1: none); the same in every thread.
  int staged_item = -1;
  auto reduce_staged_dq = [&]() {
    if (kBulkDq && staged_item >= 0 && tid == 0) {
      int item = staged_item;
      asm volatile("" : "+r"(item));
      reduce_dq_tile(p, dq_staging(), cta.batch, item_head(item), item_row0(item) / kBlockM);
    }
  };
  auto copy_p_out = make_tiled_copy_C(Copy_Atom<UniversalCopy<uint32_t>, T>{}, mma_sdp);
  auto thr_copy_p_out = copy_p_out.get_thread_slice(tid);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);
  Tensor score_coords = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kRowsPerThread = decltype(size<0>(rows_cols(score_coords.layout())))::value;
  const float to_log2 = ScoreTile<kGeneral>::to_log2(p);

  // One query tile against this CTA's keys; instantiated with and without the per-element mask.
  auto accumulate_query_tile = [&](int item, int stage, bool read_boolean_mask, auto check_mask)
                                   __attribute__((always_inline)) {
    const int64_t head = item_head(item);
    const int64_t m0 = item_row0(item);
    RowStats<kRowsPerThread> stats;
    stats.load(p, cta.batch, head, m0, score_coords);

    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    KeepBitsFor<decltype(score_coords)> keep;
    if constexpr (kGeneral) backward_keep_bits(keep, p, cta.batch, head, score_coords, m0, n0);
    clear(acc_s);
    clear(acc_dp);
    gemm_smem_smem(mma_sdp, acc_s, frag_q, frag_k, copy_sdp_a.get_thread_slice(tid).partition_S(sQ(stage)),
                   smem_k_part, copy_sdp_a, copy_sdp_b);
    gemm_smem_smem(mma_sdp, acc_dp, frag_do, frag_v, copy_sdp_a.get_thread_slice(tid).partition_S(sdO(stage)),
                   smem_v_part, copy_sdp_a, copy_sdp_b);

    const auto scorer = ScoreTile<kGeneral>::make(p, cta.batch, head, read_boolean_mask);
    backward_scores<kGeneral, decltype(check_mask)::value>(scorer, p, keep, acc_s, acc_dp, score_coords, stats, m0,
                                                            n0, to_log2);

    Tensor probs = converted<T>(acc_s);
    Tensor score_grads = converted<T>(acc_dp);
    copy(copy_p_out, thr_copy_p_out.retile_S(probs), thr_copy_p_out.partition_D(sP));
    copy(copy_p_out, thr_copy_p_out.retile_S(score_grads), thr_copy_p_out.partition_D(sdS));
    // The previous item's bulk reduction (issued at this item's first barrier) has read the staged dQ tile before
    // anyone passes this barrier and overwrites it (long done by now: the S and dP GEMMs ran since).
    if constexpr (kBulkDq) {
      if (tid == 0) bulk_wait_read();
    }
    __syncthreads();

    gemm_smem_smem(mma_dkv, acc_dv, frag_pt, frag_dot, smem_pt_part,
                   copy_dkv_b.get_thread_slice(tid).partition_S(sdOt(stage)), copy_dkv_a, copy_dkv_b);
    if constexpr (kFusedDq) {
      // sdS and sK are read-only until the next item's __syncthreads, so dS K needs no barrier of its own. The
      // S/dP warp grid (2x4) reads less of sdS and sK per warp than 4x2 would, and its accumulator is dead here.
      // Before dK's GEMM rather than after it, so that the reductions issue while that GEMM's MMAs run.
      Tensor acc_dq = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(acc_dq);
      gemm_smem_smem(mma_sdp, acc_dq, frag_ds, frag_kt, smem_ds_part, smem_kt_part, copy_sdp_a, copy_sdp_bt);
      // The whole tile, rows past the q length included: their scores are masked, so they add zeros.
      if constexpr (kBulkDq) {
        stage_dq_columns(dq_staging(), acc_dq, dq_coords);
        staged_item = item;
      } else {
        float* chunk = dq_workspace_chunk(p, cta.batch, head, m0 / kBlockM);
        if (kDqTileExact && p.head_dim == kHeadDim) {
          add_dq_columns<false>(chunk, acc_dq, dq_coords, kHeadDim);
        } else {
          add_dq_columns<true>(chunk, acc_dq, dq_coords, static_cast<int>(p.head_dim));
        }
      }
    }
    gemm_smem_smem(mma_dkv, acc_dk, frag_dst, frag_qt, smem_dst_part,
                   copy_dkv_b.get_thread_slice(tid).partition_S(sQt(stage)), copy_dkv_a, copy_dkv_b);
  };

  // cursor: the tile's index times 2 plus the buffer stage it was loaded into (one register, as a plain index);
  // the next unhidden tile is found again at the end of each step rather than held across the tile's math.
  for (int cursor = first_item * 2; (cursor >> 1) < item_end;) {
    const int item = cursor >> 1;
    const int stage = cursor & 1;
    if constexpr (kStages == 1) {
      __syncthreads();  // everyone is done with the single Q/dO buffer
      load_query_tile(item, 0);
      cp_async_fence();
    }
    cp_async_wait<0>();
    // This item's Q/dO are in smem for everyone; everyone is done with the previous item's P/dS and with the
    // stage the prefetch overwrites; and everyone has staged (and fenced) the previous item's dQ tile.
    __syncthreads();
    reduce_staged_dq();
    if constexpr (kStages == 2) {
      const int next = next_item(item + 1);
      if (next < item_end) load_query_tile(next, stage ^ 1);
      cp_async_fence();
    }
    const bool read_boolean_mask = mask_cover(item) != MaskCover::kVisible;
    const int64_t m0 = item_row0(item);
    if (tile_fully_visible(group_mask, m0, kBlockM, n0, kBlockN)) {
      accumulate_query_tile(item, stage, read_boolean_mask, cute::false_type{});
    } else {
      accumulate_query_tile(item, stage, read_boolean_mask, cute::true_type{});
    }
    cursor = next_item(item + 1) * 2 + (kStages == 2 ? stage ^ 1 : 0);
  }

  // Epilogue: dK carries the softmax scale of S = scale * Q K^T; stage dK/dV in the K/V buffers for row stores, or add
  // them to the block's slot.
  if constexpr (kPiece) {
    cp_async_wait<0>();
    __syncthreads();  // also orders the last item's staged dQ tile before its bulk reduction
    reduce_staged_dq();
    Tensor dkv_coords = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    add_to_dkdv_slot<kBlockN, kHeadDim>(tail.slots + segment.slot * dkdv_tail_slot_floats<kBlockN, kHeadDim>(),
                                        acc_dk, acc_dv, dkv_coords, p.softmax_scale);
    if constexpr (kBulkDq) {
      if (tid == 0) bulk_wait_all();
    }
    wait_for_prior_grid();
    return;
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
  Tensor dk_out = converted<T>(acc_dk);
  Tensor dv_out = converted<T>(acc_dv);
  cp_async_wait<0>();
  __syncthreads();  // also orders the last item's staged dQ tile before its bulk reduction
  reduce_staged_dq();
  auto copy_kv_out = make_tiled_copy_C(Copy_Atom<UniversalCopy<uint32_t>, T>{}, mma_dkv);
  auto thr_copy_kv_out = copy_kv_out.get_thread_slice(tid);
  copy(copy_kv_out, thr_copy_kv_out.retile_S(dk_out), thr_copy_kv_out.partition_D(sK));
  copy(copy_kv_out, thr_copy_kv_out.retile_S(dv_out), thr_copy_kv_out.partition_D(sV));
  __syncthreads();
  KVTile::store(static_cast<T*>(p.dk) + kv_offset, smem_k, kv_shape.row_stride(), keys_in_bounds, p.head_dim,
                vectorized);
  KVTile::store(static_cast<T*>(p.dv) + kv_offset, smem_v, kv_shape.row_stride(), keys_in_bounds, p.head_dim,
                vectorized);
  if constexpr (kBulkDq) {
    if (tid == 0) bulk_wait_all();  // the last reduction is complete (and has read its smem) before the CTA exits
  }
}

}  // namespace jax_flash::cuda::sm80
