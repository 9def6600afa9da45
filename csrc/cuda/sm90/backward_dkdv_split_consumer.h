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
#include "transposed_scores.h"

namespace jax_flash::cuda::sm90 {

// Named barriers of the split form, all over both consumer warpgroups (id 0 is __syncthreads).
constexpr int kSplitProbsStoredBarrier = 1;       // both halves of an item's P^T are in shared memory
constexpr int kSplitScoreGradsStoredBarrier = 2;  // both halves of an item's dS^T are in shared memory
constexpr int kSplitEpilogueBarrier = 3;          // both halves of dK and dV are staged in K's and V's buffers

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
  const int thread = threadIdx.x % 128;  // within the warpgroup: each warpgroup runs MMAs of its own

  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});      // (key, d)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});       // (query, d, stage)
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});     // (d, query, stage)
  Tensor sdOt = make_tensor(make_smem_ptr(smem.d_o.data()), typename Traits::SmemLayoutQt{});
  Tensor sP = make_tensor(make_smem_ptr(smem.probs.data()), typename Traits::SmemLayoutPdS{});  // (key, query, buf)
  Tensor sdS = make_tensor(make_smem_ptr(smem.score_grads.data()), typename Traits::SmemLayoutPdS{});
  // This warpgroup's share: its query rows of Q / dO (the N of S^T and dP^T), its query columns of P^T / dS^T
  // (where its scores go) and its head-dim columns of Q^T / dO^T (the N of dK and dV).
  Tensor sQ_mine = local_tile(sQ, Shape<Int<kQueryCols>, Int<kHeadDim>>{}, make_coord(group, 0));
  Tensor sdO_mine = local_tile(sdO, Shape<Int<kQueryCols>, Int<kHeadDim>>{}, make_coord(group, 0));
  Tensor sP_mine = local_tile(sP, Shape<Int<kBlockN>, Int<kQueryCols>>{}, make_coord(0, group));
  Tensor sdS_mine = local_tile(sdS, Shape<Int<kBlockN>, Int<kQueryCols>>{}, make_coord(0, group));
  Tensor sQt_mine = local_tile(sQt, Shape<Int<kDkvCols>, Int<kBlockM>>{}, make_coord(group, 0));
  Tensor sdOt_mine = local_tile(sdOt, Shape<Int<kDkvCols>, Int<kBlockM>>{}, make_coord(group, 0));

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaDkv mma_dkv;
  auto thr_sdp = mma_sdp.get_thread_slice(thread);
  auto thr_dkv = mma_dkv.get_thread_slice(thread);
  Tensor frag_k = thr_sdp.partition_fragment_A(sK);          // smem descriptors
  Tensor frag_v = thr_sdp.partition_fragment_A(sV);
  Tensor frag_q = thr_sdp.partition_fragment_B(sQ_mine);     // (MMA, MMA_N, MMA_K, stage)
  Tensor frag_do = thr_sdp.partition_fragment_B(sdO_mine);
  Tensor frag_p = thr_dkv.partition_fragment_A(sP);          // (MMA, MMA_M, MMA_K, buffer)
  Tensor frag_ds = thr_dkv.partition_fragment_A(sdS);
  Tensor frag_qt = thr_dkv.partition_fragment_B(sQt_mine);   // (MMA, MMA_N, MMA_K, stage)
  Tensor frag_dot = thr_dkv.partition_fragment_B(sdOt_mine);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kDkvCols>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kDkvCols>>{});
  clear(acc_dk);
  clear(acc_dv);
  // (key, query) of each score element within the CTA's tile, as rows x cols of this thread: the query
  // coordinates include this warpgroup's offset, so the row statistics are indexed directly.
  Tensor coords = sm80::as_rows_cols(sm80_view(thr_sdp.partition_C(
      local_tile(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}), Shape<Int<kBlockN>, Int<kQueryCols>>{},
                 make_coord(0, group)))));
  const float scale_log2 = p.softmax_scale * sm80::kLog2e;

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
    issue_wgmma<true>(mma_sdp, frag_k, frag_q(_, _, _, stage), acc_s);
    issue_wgmma<true>(mma_sdp, frag_v, frag_do(_, _, _, stage), acc_dp);
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
    store_accumulators(mma_sdp, thread, sm80::converted<T>(acc_s), sP_mine(_, _, buffer));  // stmatrix
    fence_stores_for_async_proxy();
    named_barrier_sync(kSplitProbsStoredBarrier, Traits::kConsumerThreads);
    Tensor frag_p_item = frag_p(_, _, _, buffer);
    issue_wgmma<false>(mma_dkv, frag_p_item, frag_dot(_, _, _, stage), acc_dv);

    warpgroup_wait<1>();  // dP^T is ready (it was issued before dV's GEMM, which may still run)
    warpgroup_fence_operand(acc_dp);
    transposed_score_grads(scores, dp, coords, smem.softmax_d[stage]);
    store_accumulators(mma_sdp, thread, sm80::converted<T>(acc_dp), sdS_mine(_, _, buffer));
    fence_stores_for_async_proxy();
    named_barrier_sync(kSplitScoreGradsStoredBarrier, Traits::kConsumerThreads);
    // The row-stats stage goes back only now: the dS^T stores above consume every softmax_d value loaded from it,
    // so they (and the barrier) issue after those loads have returned.
    pipeline_stats.consumer_release(read);
    Tensor frag_ds_item = frag_ds(_, _, _, buffer);
    issue_wgmma<false>(mma_dkv, frag_ds_item, frag_qt(_, _, _, stage), acc_dk);
    warpgroup_wait<0>();  // dV and dK read this stage's Q / dO: retired before it goes back
    pipeline_qdo.consumer_release(read);
    ++read;
  }

  // Epilogue: dK carries the softmax scale of S = scale * Q K^T. K and V are free: both warpgroups' last S^T and
  // dP^T GEMMs (their only readers) retired before they met at the last item's dS^T barrier. Each warpgroup stages its
  // columns of dV and dK there; after a barrier all consumer threads store whole 16-byte row chunks.
  // One tensor at a time, so that the other's float accumulators are not live during the swizzled stores.
  // Float32 gradients (of float16 operands) go straight from the accumulators to global memory instead.
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
