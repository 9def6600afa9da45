// Hopper backward, dK/dV pass at d=256: the consumer side of the split-head-dim form (DkdvSplitTraits; the
// producer warpgroup and the kernel entry are backward_dkdv_kernel.h's). Accumulating dK and dV for 64 keys x 256
// columns in one warpgroup would take 256 floats per thread, so both consumer warpgroups share the CTA's 64 keys:
//      S^T = K Q^T, dP^T = V dO^T          warpgroup g: its half of the query columns (both operands from smem)
//      P^T = exp(S^T - lse), dS^T = P^T (dP^T - D)   (registers; masks only on boundary tiles)
//      P^T -> shared memory, barrier, dV[:, g-th half] += P^T dO[:, g-th half]
//      dS^T -> shared memory, barrier, dK[:, g-th half] += dS^T Q[:, g-th half]
//                                           (SS WGMMA, all block_m queries as the K of the GEMM)
// P^T and dS^T meet at separate barriers so that the exps overlap the dP^T GEMM and dS^T overlaps the dV GEMM.
// A Q/dO stage goes back to the producer only when both warpgroups have arrived (the pipeline counts all 256
// consumer threads), i.e. after both have retired their dV/dK GEMMs of that item.
// Float16 parts (Traits::kLowParts, d=128; float16_parts_backward_launch.h): K, V, Q, dO, P^T and dS^T each also as
// a lo part in shared memory (`low`), every GEMM as three (split_tf32_mma.h issue_wgmma_parts), P^T and dS^T split
// into float16 parts in registers before their stores (dS^T first scaled row by row, row_scaled_parts.h, each row
// of dK's partial scaled back), and dK and dV summed item by item: each item's three
// products into a fresh float32 partial, added to the total with float32 adds (split_tf32_mma.h add_partial_sums
// says why the tensor cores' own accumulation over a whole sequence would not do).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../sm80/fragments.h"
#include "backward_key_block.h"
#include "backward_traits.h"
#include "fragments.h"
#include "row_scaled_parts.h"
#include "split_tf32_mma.h"
#include "transposed_scores.h"

namespace jax_flash::cuda::sm90 {

// Named barriers of the split form, all over both consumer warpgroups (id 0 is __syncthreads).
constexpr int kSplitProbsStoredBarrier = 1;       // both halves of an item's P^T are in shared memory
constexpr int kSplitScoreGradsStoredBarrier = 2;  // both halves of an item's dS^T are in shared memory
constexpr int kSplitEpilogueBarrier = 3;          // both halves of dK and dV are staged in K's and V's buffers
constexpr int kSplitExponentsBarrier = 4;         // float16 parts: both consumers published their dS^T rows' exponents

// Stores float32 scores `acc` (P^T or dS^T, this warpgroup's columns) as the 16-bit A operand of the dK/dV GEMMs:
// rounded into `hi`, or with kParts as float16 parts into `hi` and `lo`.
template <bool kParts, class TiledMma, class Acc, class Hi, class Lo>
__device__ __forceinline__ void store_score_parts(TiledMma const& mma, int thread, Acc const& acc, Hi&& hi, Lo&& lo) {
  using T = typename std::decay_t<Hi>::value_type;
  if constexpr (kParts) {
    auto hi_part = cute::make_tensor_like<T>(acc);
    auto lo_part = cute::make_tensor_like<T>(acc);
    split_registers(acc, hi_part, lo_part);
    store_accumulators(mma, thread, hi_part, hi);
    store_accumulators(mma, thread, lo_part, lo);
  } else {
    store_accumulators(mma, thread, sm80::converted<T>(acc), hi);
  }
}

// Consumer warpgroup `group` (0 or 1): its head-dim half of dK and dV for the CTA's keys over every item, then
// the epilogue. Force-inlined: as a called function, ptxas may serialise its WGMMAs (C7510; see forward_kernel.h).
template <class Traits>
__device__ __forceinline__ void consume_query_tiles_split_head_dim(const AttentionBackwardParams& p,
                                                                  const KeyBlock& kb,
                                                                  typename Traits::SharedStorage& smem,
                                                                  typename Traits::Pipeline& pipeline_qdo,
                                                                  typename Traits::StatsPipeline& pipeline_stats,
                                                                  int group) {
  using namespace cute;
  using T = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kQueryCols = Traits::kQueryCols, kDkvCols = Traits::kDkvCols;
  constexpr bool kParts = Traits::kLowParts;
  const int thread = threadIdx.x % 128;  // within the warpgroup: each warpgroup runs MMAs of its own
  auto& low = low_parts<kParts>(smem);  // the lo parts, or without them the hi parts again (never read then)

  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});      // (key, d)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(smem.probs.data()), typename Traits::SmemLayoutPdS{});  // (key, query, buf)
  Tensor sdS = make_tensor(make_smem_ptr(smem.score_grads.data()), typename Traits::SmemLayoutPdS{});
  Tensor sP_lo = make_tensor(make_smem_ptr(low.probs.data()), typename Traits::SmemLayoutPdS{});
  Tensor sdS_lo = make_tensor(make_smem_ptr(low.score_grads.data()), typename Traits::SmemLayoutPdS{});
  // This warpgroup's share: its query rows of Q / dO (the N of S^T and dP^T), its query columns of P^T / dS^T
  // (where its scores go) and its head-dim columns of Q^T / dO^T (the N of dK and dV).
  auto queries_mine = [&](auto scores) {
    return local_tile(scores, Shape<Int<kBlockN>, Int<kQueryCols>>{}, make_coord(0, group));
  };
  Tensor sP_mine = queries_mine(sP);
  Tensor sdS_mine = queries_mine(sdS);
  Tensor sP_lo_mine = queries_mine(sP_lo);
  Tensor sdS_lo_mine = queries_mine(sdS_lo);

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaDkv mma_dkv;
  auto thr_sdp = mma_sdp.get_thread_slice(thread);
  auto thr_dkv = mma_dkv.get_thread_slice(thread);
  // The shared operands' descriptors (smem descriptors) for the storage `parts` (smem, or its lo parts):
  //   k, v:     A of S^T and dP^T;   q, d_o: B of S^T and dP^T, this warpgroup's query rows (MMA, MMA_N, MMA_K, stage)
  //   p, ds:    A of dV and dK (MMA, MMA_M, MMA_K, buffer);   qt, dot: B of dK and dV, this warpgroup's head-dim
  //             columns (MMA, MMA_N, MMA_K, stage)
  auto operand_fragments = [&](auto& parts) {
    Tensor q = make_tensor(make_smem_ptr(parts.q.data()), typename Traits::SmemLayoutQ{});     // (query, d, stage)
    Tensor d_o = make_tensor(make_smem_ptr(parts.d_o.data()), typename Traits::SmemLayoutQ{});
    Tensor qt = make_tensor(make_smem_ptr(parts.q.data()), typename Traits::SmemLayoutQt{});   // (d, query, stage)
    Tensor dot = make_tensor(make_smem_ptr(parts.d_o.data()), typename Traits::SmemLayoutQt{});
    auto rows_mine = [&](auto rows) {
      return local_tile(rows, Shape<Int<kQueryCols>, Int<kHeadDim>>{}, make_coord(group, 0));
    };
    auto cols_mine = [&](auto cols) {
      return local_tile(cols, Shape<Int<kDkvCols>, Int<kBlockM>>{}, make_coord(group, 0));
    };
    return cute::make_tuple(
        thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(parts.k.data()), typename Traits::SmemLayoutKV{})),
        thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(parts.v.data()), typename Traits::SmemLayoutKV{})),
        thr_sdp.partition_fragment_B(rows_mine(q)), thr_sdp.partition_fragment_B(rows_mine(d_o)),
        thr_dkv.partition_fragment_A(
            make_tensor(make_smem_ptr(parts.probs.data()), typename Traits::SmemLayoutPdS{})),
        thr_dkv.partition_fragment_A(
            make_tensor(make_smem_ptr(parts.score_grads.data()), typename Traits::SmemLayoutPdS{})),
        thr_dkv.partition_fragment_B(cols_mine(qt)), thr_dkv.partition_fragment_B(cols_mine(dot)));
  };
  auto [frag_k, frag_v, frag_q, frag_do, frag_p, frag_ds, frag_qt, frag_dot] = operand_fragments(smem);
  auto [frag_k_lo, frag_v_lo, frag_q_lo, frag_do_lo, frag_p_lo, frag_ds_lo, frag_qt_lo, frag_dot_lo] =
      operand_fragments(low);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kDkvCols>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kDkvCols>>{});
  clear(acc_dk);
  clear(acc_dv);
  // Float16 parts: each item's dK and dV products, added to the totals once retired (unused otherwise).
  Tensor partial_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kDkvCols>>{});
  Tensor partial_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kDkvCols>>{});
  // (key, query) of each score element within the CTA's tile, as rows x cols of this thread: the query
  // coordinates include this warpgroup's offset, so the row statistics are indexed directly.
  Tensor coords = sm80::as_rows_cols(sm80_view(thr_sdp.partition_C(
      local_tile(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}), Shape<Int<kBlockN>, Int<kQueryCols>>{},
                 make_coord(0, group)))));
  const float scale_log2 = p.softmax_scale * sm80::kLog2e;
  constexpr int kScoreRows = decltype(size<0>(coords))::value;  // this thread's keys: rows of S^T, dS^T, dK

  cutlass::arch::ClusterBarrier::wait(&smem.kv_full[0], 0);
  typename Traits::PipelineState read;  // Q/dO and their row stats advance in lock step
  const TileSpan unmasked = fully_visible_query_tiles(kb.mask, kb.n0, kBlockN, kBlockM);  // no per-element mask
  ItemTile tile = kb.first_tile();  // every item in order
  for (int item = 0; item < kb.items; ++item, tile = kb.next_tile(tile)) {
    const int stage = read.index();
    const int buffer = item & 1;  // of P^T / dS^T (DkdvSplitTraits::SmemLayoutPdS says why two suffice)
    const int64_t m0 = int64_t(tile.m_block) * kBlockM;
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kQueryCols>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kQueryCols>>{});
    pipeline_qdo.consumer_wait(read);
    issue_wgmma_parts<true, kParts>(mma_sdp, frag_k, frag_k_lo, frag_q(_, _, _, stage), frag_q_lo(_, _, _, stage),
                                    acc_s);
    issue_wgmma_parts<true, kParts>(mma_sdp, frag_v, frag_v_lo, frag_do(_, _, _, stage), frag_do_lo(_, _, _, stage),
                                    acc_dp);
    pipeline_stats.consumer_wait(read);
    auto scores = sm80::as_rows_cols(sm80_view(acc_s));
    auto dp = sm80::as_rows_cols(sm80_view(acc_dp));
    warpgroup_wait<1>();  // S^T is ready; dP^T may still run
    warpgroup_fence_operand(acc_s);  // its reads stay after the wait
    if (!unmasked.contains(tile.m_block)) {
      mask_transposed_scores(kb.mask, scores, coords, kb.n0, m0);
    }
    transposed_probabilities(scores, coords, smem.lse_log2[stage], scale_log2);
    // P^T first, with a barrier of its own, so that dV's GEMM runs while dS^T is formed and stored. Generic-proxy
    // stores (stmatrix), fenced before the WGMMAs (async proxy) of both warpgroups read them.
    store_score_parts<kParts>(mma_sdp, thread, acc_s, sP_mine(_, _, buffer), sP_lo_mine(_, _, buffer));  // stmatrix
    fence_stores_for_async_proxy();
    named_barrier_sync(kSplitProbsStoredBarrier, Traits::kConsumerThreads);
    Tensor frag_p_item = frag_p(_, _, _, buffer);
    Tensor frag_p_lo_item = frag_p_lo(_, _, _, buffer);
    issue_wgmma_parts<kParts, kParts>(mma_dkv, frag_p_item, frag_p_lo_item, frag_dot(_, _, _, stage),
                                      frag_dot_lo(_, _, _, stage), gemm_target<kParts>(acc_dv, partial_dv));

    warpgroup_wait<1>();  // dP^T is ready (it was issued before dV's GEMM, which may still run)
    warpgroup_fence_operand(acc_dp);
    transposed_score_grads(scores, dp, coords, smem.softmax_d[stage]);
    // Float16 parts: each key's row of dS^T scaled by a power of two of its own (row_scaled_parts.h), the two
    // consumers' halves of the row by the same one: each publishes its rows' exponents, and takes the larger.
    [[maybe_unused]] int row_exponents[kScoreRows];
    if constexpr (kParts) {
      quad_row_exponents(dp, row_exponents);
      if (thread % 4 == 0) {
        CUTE_UNROLL
        for (int r = 0; r < kScoreRows; ++r) low.score_grad_exponents[group][get<0>(coords(r, 0))] = row_exponents[r];
      }
      named_barrier_sync(kSplitExponentsBarrier, Traits::kConsumerThreads);
      CUTE_UNROLL
      for (int r = 0; r < kScoreRows; ++r) {
        row_exponents[r] = max(row_exponents[r], low.score_grad_exponents[1 - group][get<0>(coords(r, 0))]);
      }
      scale_rows_for_parts(dp, row_exponents);
    }
    store_score_parts<kParts>(mma_sdp, thread, acc_dp, sdS_mine(_, _, buffer), sdS_lo_mine(_, _, buffer));
    fence_stores_for_async_proxy();
    named_barrier_sync(kSplitScoreGradsStoredBarrier, Traits::kConsumerThreads);
    // The row-stats stage goes back only now: the dS^T stores above consume every softmax_d value loaded from it,
    // so they (and the barrier) issue after those loads have returned.
    pipeline_stats.consumer_release(read);
    Tensor frag_ds_item = frag_ds(_, _, _, buffer);
    Tensor frag_ds_lo_item = frag_ds_lo(_, _, _, buffer);
    issue_wgmma_parts<kParts, kParts>(mma_dkv, frag_ds_item, frag_ds_lo_item, frag_qt(_, _, _, stage),
                                      frag_qt_lo(_, _, _, stage), gemm_target<kParts>(acc_dk, partial_dk));
    warpgroup_wait<0>();  // dV and dK read this stage's Q / dO: retired before it goes back
    if constexpr (kParts) {
      add_partial_sums(acc_dv, partial_dv);
      add_row_scaled_partial(acc_dk, partial_dk, row_exponents);
    }
    pipeline_qdo.consumer_release(read);
    ++read;
  }

  // Epilogue: dK carries the softmax scale of S = scale * Q K^T. K and V are free: both warpgroups' last S^T and
  // dP^T GEMMs (their only readers) retired before they met at the last item's dS^T barrier. Each warpgroup stages its
  // columns of dV and dK there; after a barrier all consumer threads store whole 16-byte row chunks.
  // One tensor at a time, so that the other's float accumulators are not live during the swizzled stores.
  // Float32 gradients (of float16 operands or parts) go straight from the accumulators to global memory instead.
  if constexpr (!std::is_same_v<typename Traits::OutElement, T>) {
    store_float_key_rows<kBlockN, kDkvCols>(p, kb, p.dv, mma_dkv, thread, acc_dv, group * kDkvCols);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
    store_float_key_rows<kBlockN, kDkvCols>(p, kb, p.dk, mma_dkv, thread, acc_dk, group * kDkvCols);
  } else {
    Tensor dv_out = sm80::converted<T>(acc_dv);
    store_accumulators(mma_dkv, thread, dv_out,
                       local_tile(sV, Shape<Int<kBlockN>, Int<kDkvCols>>{}, make_coord(0, group)));
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
    Tensor dk_out = sm80::converted<T>(acc_dk);
    store_accumulators(mma_dkv, thread, dk_out,
                       local_tile(sK, Shape<Int<kBlockN>, Int<kDkvCols>>{}, make_coord(0, group)));
    named_barrier_sync(kSplitEpilogueBarrier, Traits::kConsumerThreads);
    const int consumer_thread = threadIdx.x - 128;
    store_key_rows<Traits>(p, kb, p.dk, &sK, 0, kBlockN, consumer_thread, Traits::kConsumerThreads);
    store_key_rows<Traits>(p, kb, p.dv, &sV, 0, kBlockN, consumer_thread, Traits::kConsumerThreads);
  }
}

}  // namespace jax_flash::cuda::sm90
