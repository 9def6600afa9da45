// Hopper backward, dQ pass for float32 inputs on TF32 tensor cores: the consumer side of Tf32DqTraits (the producer
// and the kernel entry are backward_dq_kernel.h's; the common form only). Per key tile, consumer warpgroup g
// (query rows 64 g .. 64 g + 63 of the CTA):
//      S = Q K^T, dP = dO V^T                    (SS WGMMA, both operands K-major, as the 16-bit kernel)
//      P = exp(S - lse), dS = P (dP - D)         (registers, the sm80 score step; masks only on boundary tiles)
//      dS -> its rows of a shared [queries, keys] tile, barrier, dQ^T += K^T dS^T
// The last is an RS WGMMA with M = head dim, N = its 64 rows, K = the tile's keys: A = K^T goes from the K stage
// into registers through the transposed view (a shared 32-bit operand must be K-major, which K is not along the
// keys), B = dS is K-major as stored. Q and dO, resident, are rounded to TF32 once; K^T in registers per tile.
// Split TF32 (Traits::kSplitTf32): Q, dO, K and V come with lo parts (the producer loads both from the call's
// pre-split workspace), dS is stored as two parts, K^T's lo part is loaded like its hi part, and each GEMM is three
// WGMMAs (split_tf32_mma.h).
#pragma once

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../sm80/fragments.h"
#include "../sm80/row_stats.h"
#include "../sm80/score_tile.h"
#include "backward_query_rows.h"
#include "backward_traits.h"
#include "forward_kernel.h"  // RowBlock
#include "fragments.h"
#include "split_tf32_mma.h"

namespace jax_flash::cuda::sm90 {

// Named barriers of the TF32 dQ consumers (id 0 is __syncthreads), per warpgroup g: kTf32DqBarriers + 2 g + i,
// its dS rows are free (the previous tile's dQ^T GEMM, all four warps' parts, read them) / stored; and one of
// both warpgroups, kTf32DqRounded: Q and dO are rounded in place.
constexpr int kTf32DqBarriers = 1;
constexpr int kTf32DqScoreGradsFree = 0, kTf32DqScoreGradsStored = 1;
constexpr int kTf32DqRounded = 5;

template <class Traits>
__device__ __forceinline__ void consume_key_tiles_tf32(const AttentionBackwardParams& p, const RowBlock& rb,
                                                      typename Traits::SharedStorage& smem,
                                                      typename Traits::Pipeline& pipeline_kv, int group) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr bool kSplit = Traits::kSplitTf32;
  const int thread = threadIdx.x - 128;  // among all consumer threads: S and dP span both warpgroups' rows
  const int wg_thread = thread % 128;    // within the warpgroup: dQ^T is its own MMA
  auto barrier = [&](int which) { named_barrier_sync(kTf32DqBarriers + 2 * group + which, 128); };

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});    // (query, d)
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});   // (key, d, stage)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});  // (d, key, stage)
  Tensor sdS = make_tensor(make_smem_ptr(smem.score_grads.data()), typename Traits::SmemLayoutDs{});  // (q, key)
  Tensor sdS_mine = local_tile(sdS, Shape<_64, Int<kBlockN>>{}, make_coord(group, 0));

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaDqT mma_dqt;
  auto thr_sdp = mma_sdp.get_thread_slice(thread);
  auto thr_dqt = mma_dqt.get_thread_slice(wg_thread);
  Tensor frag_q = thr_sdp.partition_fragment_A(sQ);  // smem descriptors
  Tensor frag_do = thr_sdp.partition_fragment_A(sdO);
  Tensor frag_k = thr_sdp.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stage)
  Tensor frag_v = thr_sdp.partition_fragment_B(sV);
  Tensor frag_ds = thr_dqt.partition_fragment_B(sdS_mine);  // descriptors of this warpgroup's rows
  Tensor smem_kt = thr_dqt.partition_A(sKt);  // this thread's A values of each stage: (MMA, MMA_M, MMA_K, stage)
  Tensor regs_kt = thr_dqt.partition_fragment_A(sKt(_, _, 0));
  // Split TF32: the lo parts (elsewhere the hi buffers again and an unused register tensor, optimised away).
  auto& low = low_parts<kSplit>(smem);
  Tensor sQ_lo = make_tensor(make_smem_ptr(low.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO_lo = make_tensor(make_smem_ptr(low.d_o.data()), typename Traits::SmemLayoutQ{});
  Tensor sK_lo = make_tensor(make_smem_ptr(low.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV_lo = make_tensor(make_smem_ptr(low.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sKt_lo = make_tensor(sK_lo.data(), typename Traits::SmemLayoutKt{});
  Tensor sdS_lo = make_tensor(make_smem_ptr(low.score_grads.data()), typename Traits::SmemLayoutDs{});
  Tensor frag_q_lo = thr_sdp.partition_fragment_A(sQ_lo);
  Tensor frag_do_lo = thr_sdp.partition_fragment_A(sdO_lo);
  Tensor frag_k_lo = thr_sdp.partition_fragment_B(sK_lo);
  Tensor frag_v_lo = thr_sdp.partition_fragment_B(sV_lo);
  Tensor frag_ds_lo =
      thr_dqt.partition_fragment_B(local_tile(sdS_lo, Shape<_64, Int<kBlockN>>{}, make_coord(group, 0)));
  Tensor smem_kt_lo = thr_dqt.partition_A(sKt_lo);
  Tensor regs_kt_lo = make_fragment_like(regs_kt);

  Tensor acc_dqt = partition_fragment_C(mma_dqt, Shape<Int<kHeadDim>, _64>{});
  clear(acc_dqt);
  // Split TF32: each key tile's dQ^T sums into `partial`, added to acc_dqt once it has retired (under the next
  // tile's S and dP; split_tf32_mma.h add_partial_sums says why); elsewhere unused. Cleared for the first add.
  Tensor partial = partition_fragment_C(mma_dqt, Shape<Int<kHeadDim>, _64>{});
  if constexpr (kSplit) clear(partial);
  Tensor coords = sm80_view(thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  constexpr int kRows = decltype(size<0>(sm80::rows_cols(coords.layout())))::value;
  sm80::RowStats<kRows> stats;
  stats.load(p, rb.batch, rb.head, rb.m0, coords);
  const float to_log2 = sm80::ScoreTile<false>::to_log2(p);
  sm80::NoKeepBits no_dropout;  // the common variant never reads keep bits

  cutlass::arch::ClusterBarrier::wait(&smem.q_full, 0);
  // Q and dO stay for the CTA's life: rounded to nearest once (the tensor cores would truncate them). Split TF32's
  // parts are TF32 numbers already.
  if constexpr (!kSplit) {
    round_tiles_to_tf32(reinterpret_cast<float*>(smem.q.data()), reinterpret_cast<float*>(smem.d_o.data()),
                        int(cosize_v<typename Traits::SmemLayoutQ>), thread, Traits::kConsumerThreads,
                        kTf32DqRounded);
  }
  typename Traits::PipelineState read;
  for (int n_block = rb.key_tiles.end - 1; n_block >= rb.key_tiles.begin; --n_block) {
    const int stage = read.index();
    const int64_t n0 = int64_t(n_block) * kBlockN;
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    pipeline_kv.consumer_wait(read);
    issue_wgmma_parts<true, kSplit>(mma_sdp, frag_q, frag_q_lo, frag_k(_, _, _, stage), frag_k_lo(_, _, _, stage),
                                    acc_s);
    issue_wgmma_parts<true, kSplit>(mma_sdp, frag_do, frag_do_lo, frag_v(_, _, _, stage), frag_v_lo(_, _, _, stage),
                                    acc_dp);
    warpgroup_wait<0>();  // S, dP and the previous tile's dQ^T GEMM have retired
    warpgroup_fence_operand(acc_s);
    warpgroup_fence_operand(acc_dp);
    if constexpr (kSplit) add_partial_sums(acc_dqt, partial);  // the previous tile's dQ^T

    const auto scorer = sm80::ScoreTile<false>::make(p, rb.batch, rb.head);
    auto s_view = sm80_view(acc_s);
    auto dp_view = sm80_view(acc_dp);
    if (n_block >= rb.interior.begin && n_block < rb.interior.end) {
      sm80::backward_scores<false, false>(scorer, p, no_dropout, s_view, dp_view, coords, stats, rb.m0, n0,
                                          to_log2);
    } else {
      sm80::backward_scores<false, true>(scorer, p, no_dropout, s_view, dp_view, coords, stats, rb.m0, n0,
                                         to_log2);
    }
    barrier(kTf32DqScoreGradsFree);  // every warp has retired the previous dQ^T GEMM, the reader of dS and K^T
    store_operand_parts<kSplit>(acc_dp, thr_sdp.partition_C(sdS), thr_sdp.partition_C(sdS_lo));
    fence_stores_for_async_proxy();
    load_operand_parts<kSplit>(smem_kt(_, _, _, stage), smem_kt_lo(_, _, _, stage), regs_kt, regs_kt_lo);
    barrier(kTf32DqScoreGradsStored);
    issue_wgmma_parts<kSplit, kSplit>(mma_dqt, regs_kt, regs_kt_lo, frag_ds, frag_ds_lo,
                                      gemm_target<kSplit>(acc_dqt, partial));
    // The stage goes back only now. S and dP have retired, and the K^T loads have landed: the WGMMA above could not
    // issue before its registers held them. Released right after the loads, the arrive does not wait for them (it
    // did not in the SASS), so the last warpgroup to release raced the producer's refill of the stage and read
    // K^T partly from the next tile (session 13: dQ wrong in one warpgroup's rows, different run to run).
    pipeline_kv.consumer_release(read);
    ++read;
  }
  warpgroup_wait<0>();
  if constexpr (kSplit) add_partial_sums(acc_dqt, partial);  // the last tile's dQ^T
  warpgroup_fence_operand(acc_dqt);

  // Epilogue: dQ carries the softmax scale; staged as float32 in this warpgroup's own rows of Q (its S GEMMs read
  // only those, and have retired) through the transposed view, the accumulator being (d, query).
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dqt); ++i) acc_dqt(i) *= p.softmax_scale;
  Tensor sQ_out = make_tensor(make_smem_ptr(reinterpret_cast<float*>(smem.q.data())), typename Traits::SmemLayoutQ{});
  Tensor sQt_out = make_tensor(sQ_out.data(), typename Traits::SmemLayoutQt{});
  copy(acc_dqt, thr_dqt.partition_C(local_tile(sQt_out, Shape<Int<kHeadDim>, _64>{}, make_coord(0, group))));
  barrier(kTf32DqScoreGradsFree);
  store_query_rows<Traits>(p, rb, &sQ_out, group * 64, group * 64 + 64, wg_thread, 128);
}

}  // namespace jax_flash::cuda::sm90
