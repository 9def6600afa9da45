// Hopper backward, dK/dV pass for float32 inputs on TF32 tensor cores: the consumer side of Tf32DkdvTraits (the
// producer warpgroup and the kernel entry are backward_dkdv_kernel.h's; the common form only). Per item, consumer
// warpgroup g (keys 64 g .. 64 g + 63 of the CTA):
//      S^T = K Q^T, dP^T = V dO^T                      (SS WGMMA, both operands K-major, as the 16-bit kernel)
//      P^T = exp(S^T - lse), dS^T = P^T (dP^T - D)     (registers; masks only on boundary tiles)
//      P^T -> its rows of a shared [keys, queries] tile, barrier, dV^T += dO^T P
//      dS^T -> its rows of a second one, barrier,      dK^T += Q^T dS
// The last two are RS WGMMAs with M = head dim, N = its 64 keys, K = the item's queries: the A operands dO^T and
// Q^T go from the item's Q / dO stage into registers (loads through the transposed view; a register operand has no
// major-ness, while a shared 32-bit one must be K-major, which dO and Q are not along the queries), the B operands
// P and dS are K-major as stored. Only this warpgroup reads its rows of P^T / dS^T, so its barriers are its own.
// Split TF32 (Traits::kSplitTf32, float32_precision="highest"): every shared operand has a lo part beside it (K, V,
// Q, dO loaded by the producer from the call's pre-split workspace; P^T and dS^T split here as they are stored), the
// A operands' lo parts are loaded like their hi parts, and each GEMM is three WGMMAs (split_tf32_mma.h).
#pragma once

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../sm80/fragments.h"
#include "backward_key_block.h"
#include "backward_traits.h"
#include "fragments.h"
#include "split_tf32_mma.h"
#include "transposed_scores.h"

namespace jax_flash::cuda::sm90 {

// Named barriers of the TF32 consumers (id 0 is __syncthreads), one set per warpgroup g (ids kTf32Barriers + 3 g + i):
// its P^T and dS^T rows are free (the previous item's GEMMs, all four warps' parts, read them), its P^T is stored,
// its dS^T is stored; and one of both warpgroups, kTf32KVRounded.
constexpr int kTf32Barriers = 1;
constexpr int kTf32ScoresFree = 0, kTf32ProbsStored = 1, kTf32ScoreGradsStored = 2;
constexpr int kTf32KVRounded = 7;  // both warpgroups: K and V are rounded in place

template <class Traits>
__device__ __forceinline__ void consume_query_tiles_tf32(const AttentionBackwardParams& p, const KeyBlock& kb,
                                                        typename Traits::SharedStorage& smem,
                                                        typename Traits::Pipeline& pipeline_qdo,
                                                        typename Traits::StatsPipeline& pipeline_stats, int group) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr bool kSplit = Traits::kSplitTf32;
  const int thread = threadIdx.x - 128;  // among all consumer threads: S^T and dP^T span both warpgroups' keys
  const int wg_thread = thread % 128;    // within the warpgroup: dV^T and dK^T are its own MMAs
  auto barrier = [&](int which) { named_barrier_sync(kTf32Barriers + 3 * group + which, 128); };

  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});   // (key, d)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});    // (query, d, stage)
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});  // (d, query, stage)
  Tensor sdOt = make_tensor(make_smem_ptr(smem.d_o.data()), typename Traits::SmemLayoutQt{});
  Tensor sP = make_tensor(make_smem_ptr(smem.probs.data()), typename Traits::SmemLayoutScoresT{});  // (key, query)
  Tensor sdS = make_tensor(make_smem_ptr(smem.score_grads.data()), typename Traits::SmemLayoutScoresT{});
  Tensor sP_mine = local_tile(sP, Shape<_64, Int<kBlockM>>{}, make_coord(group, 0));
  Tensor sdS_mine = local_tile(sdS, Shape<_64, Int<kBlockM>>{}, make_coord(group, 0));

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaDkvT mma_dkvt;
  auto thr_sdp = mma_sdp.get_thread_slice(thread);
  auto thr_dkvt = mma_dkvt.get_thread_slice(wg_thread);
  Tensor frag_k = thr_sdp.partition_fragment_A(sK);  // smem descriptors
  Tensor frag_v = thr_sdp.partition_fragment_A(sV);
  Tensor frag_q = thr_sdp.partition_fragment_B(sQ);  // (MMA, MMA_N, MMA_K, stage)
  Tensor frag_do = thr_sdp.partition_fragment_B(sdO);
  Tensor frag_p = thr_dkvt.partition_fragment_B(sP_mine);  // descriptors of this warpgroup's rows
  Tensor frag_ds = thr_dkvt.partition_fragment_B(sdS_mine);
  // dO^T and Q^T: this thread's A values of a stage (smem view) and the registers they go to.
  Tensor smem_dot = thr_dkvt.partition_A(sdOt);  // (MMA, MMA_M, MMA_K, stage)
  Tensor smem_qt = thr_dkvt.partition_A(sQt);
  Tensor regs_a = thr_dkvt.partition_fragment_A(sdOt(_, _, 0));  // (MMA, MMA_M, MMA_K), reused for both
  // Split TF32: the lo parts (elsewhere the hi buffers again and an unused register tensor, optimised away).
  auto& low = low_parts<kSplit>(smem);
  Tensor sK_lo = make_tensor(make_smem_ptr(low.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV_lo = make_tensor(make_smem_ptr(low.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sQ_lo = make_tensor(make_smem_ptr(low.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO_lo = make_tensor(make_smem_ptr(low.d_o.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt_lo = make_tensor(sQ_lo.data(), typename Traits::SmemLayoutQt{});
  Tensor sdOt_lo = make_tensor(sdO_lo.data(), typename Traits::SmemLayoutQt{});
  Tensor sP_lo = make_tensor(make_smem_ptr(low.probs.data()), typename Traits::SmemLayoutScoresT{});
  Tensor sdS_lo = make_tensor(make_smem_ptr(low.score_grads.data()), typename Traits::SmemLayoutScoresT{});
  Tensor frag_k_lo = thr_sdp.partition_fragment_A(sK_lo);
  Tensor frag_v_lo = thr_sdp.partition_fragment_A(sV_lo);
  Tensor frag_q_lo = thr_sdp.partition_fragment_B(sQ_lo);
  Tensor frag_do_lo = thr_sdp.partition_fragment_B(sdO_lo);
  Tensor frag_p_lo =
      thr_dkvt.partition_fragment_B(local_tile(sP_lo, Shape<_64, Int<kBlockM>>{}, make_coord(group, 0)));
  Tensor frag_ds_lo =
      thr_dkvt.partition_fragment_B(local_tile(sdS_lo, Shape<_64, Int<kBlockM>>{}, make_coord(group, 0)));
  Tensor smem_dot_lo = thr_dkvt.partition_A(sdOt_lo);
  Tensor smem_qt_lo = thr_dkvt.partition_A(sQt_lo);
  Tensor regs_a_lo = make_fragment_like(regs_a);

  Tensor acc_dvt = partition_fragment_C(mma_dkvt, Shape<Int<kHeadDim>, _64>{});
  Tensor acc_dkt = partition_fragment_C(mma_dkvt, Shape<Int<kHeadDim>, _64>{});
  clear(acc_dvt);
  clear(acc_dkt);
  // Split TF32: each item's dV^T, then its dK^T, sums into `partial` first (split_tf32_mma.h add_partial_sums says
  // why); elsewhere unused.
  Tensor partial = partition_fragment_C(mma_dkvt, Shape<Int<kHeadDim>, _64>{});
  Tensor coords = sm80::as_rows_cols(
      sm80_view(thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}))));
  const float scale_log2 = p.softmax_scale * sm80::kLog2e;

  cutlass::arch::ClusterBarrier::wait(&smem.kv_full[0], 0);
  // K and V stay for the CTA's life: rounded to nearest once here (the tensor cores would truncate them, as they
  // do the streamed Q and dO of S^T and dP^T; the A operands below are rounded in registers). Split TF32's parts
  // are TF32 numbers already.
  if constexpr (!kSplit) {
    round_tiles_to_tf32(reinterpret_cast<float*>(smem.k.data()), reinterpret_cast<float*>(smem.v.data()),
                        int(cosize_v<typename Traits::SmemLayoutKV>), thread, Traits::kConsumerThreads,
                        kTf32KVRounded);
  }
  typename Traits::PipelineState read;  // Q/dO and their row stats advance in lock step
  const TileSpan unmasked = fully_visible_query_tiles(kb.mask, kb.n0, kBlockN, kBlockM);  // no per-element mask
  ItemTile tile = kb.first_tile();  // every item in order
  for (int item = 0; item < kb.items; ++item, tile = kb.next_tile(tile)) {
    const int stage = read.index();
    const int64_t m0 = int64_t(tile.m_block) * kBlockM;
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    pipeline_qdo.consumer_wait(read);
    issue_wgmma_parts<true, kSplit>(mma_sdp, frag_k, frag_k_lo, frag_q(_, _, _, stage), frag_q_lo(_, _, _, stage),
                                    acc_s);
    issue_wgmma_parts<true, kSplit>(mma_sdp, frag_v, frag_v_lo, frag_do(_, _, _, stage), frag_do_lo(_, _, _, stage),
                                    acc_dp);
    pipeline_stats.consumer_wait(read);
    auto scores = sm80::as_rows_cols(sm80_view(acc_s));
    auto dp = sm80::as_rows_cols(sm80_view(acc_dp));
    warpgroup_wait<1>();  // S^T is ready; dP^T may still run
    warpgroup_fence_operand(acc_s);
    if (!unmasked.contains(tile.m_block)) {
      mask_transposed_scores(kb.mask, scores, coords, kb.n0, m0);
    }
    transposed_probabilities(scores, coords, smem.lse_log2[stage], scale_log2);
    barrier(kTf32ScoresFree);  // every warp retired the previous item's dV^T / dK^T: P^T, dS^T are free
    // P^T rounded to TF32 (the conversion), generic-proxy stores fenced before the WGMMA (async proxy) reads them.
    store_operand_parts<kSplit>(acc_s, thr_sdp.partition_C(sP), thr_sdp.partition_C(sP_lo));
    fence_stores_for_async_proxy();
    load_operand_parts<kSplit>(smem_dot(_, _, _, stage), smem_dot_lo(_, _, _, stage), regs_a, regs_a_lo);
    barrier(kTf32ProbsStored);
    issue_wgmma_parts<kSplit, kSplit>(mma_dkvt, regs_a, regs_a_lo, frag_p, frag_p_lo,
                                      gemm_target<kSplit>(acc_dvt, partial));

    warpgroup_wait<1>();  // dP^T is ready (issued before dV^T's GEMM, which may still run)
    warpgroup_fence_operand(acc_dp);
    transposed_score_grads(scores, dp, coords, smem.softmax_d[stage]);
    store_operand_parts<kSplit>(acc_dp, thr_sdp.partition_C(sdS), thr_sdp.partition_C(sdS_lo));
    fence_stores_for_async_proxy();
    warpgroup_wait<0>();  // dV^T has read regs_a: it takes Q^T now
    if constexpr (kSplit) add_partial_sums(acc_dvt, partial);
    load_operand_parts<kSplit>(smem_qt(_, _, _, stage), smem_qt_lo(_, _, _, stage), regs_a, regs_a_lo);
    barrier(kTf32ScoreGradsStored);
    issue_wgmma_parts<kSplit, kSplit>(mma_dkvt, regs_a, regs_a_lo, frag_ds, frag_ds_lo,
                                      gemm_target<kSplit>(acc_dkt, partial));
    // Both stages go back only now that this thread's loads from them have landed (as in the dQ pass: an arrive
    // does not wait for earlier loads): Q^T is in the registers dK^T was issued with, and the row stats are in dS,
    // stored before the barrier above. S^T and dP^T have retired.
    pipeline_stats.consumer_release(read);
    pipeline_qdo.consumer_release(read);
    // dK^T retires within its item. Left running under the next item's S^T and dP^T (retired by that item's
    // wait<1>), it made ptxas serialise every WGMMA of the kernel (C7515: it cannot follow a WGMMA in flight across
    // the loop's back edge, as the 16-bit consumers never leave one).
    warpgroup_wait<0>();
    if constexpr (kSplit) add_partial_sums(acc_dkt, partial);
    ++read;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc_dkt);

  // Epilogue: dK carries the softmax scale of S = scale * Q K^T. This warpgroup's GEMMs read only its own 64 rows
  // of K and V (S^T, dP^T; all retired), so it stages its dV and dK there, as float32 (the Element view would
  // round), through the transposed view: the accumulators are (d, key).
  Tensor sK_out = make_tensor(make_smem_ptr(reinterpret_cast<float*>(smem.k.data())), typename Traits::SmemLayoutKV{});
  Tensor sV_out = make_tensor(make_smem_ptr(reinterpret_cast<float*>(smem.v.data())), typename Traits::SmemLayoutKV{});
  Tensor sKt_out = make_tensor(sK_out.data(), typename Traits::SmemLayoutKVt{});
  Tensor sVt_out = make_tensor(sV_out.data(), typename Traits::SmemLayoutKVt{});
  copy(acc_dvt, thr_dkvt.partition_C(local_tile(sVt_out, Shape<Int<kHeadDim>, _64>{}, make_coord(0, group))));
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dkt); ++i) acc_dkt(i) *= p.softmax_scale;
  copy(acc_dkt, thr_dkvt.partition_C(local_tile(sKt_out, Shape<Int<kHeadDim>, _64>{}, make_coord(0, group))));
  barrier(kTf32ScoresFree);
  const int rows_begin = group * 64;
  store_key_rows<Traits>(p, kb, p.dk, &sK_out, rows_begin, rows_begin + 64, wg_thread, 128);
  store_key_rows<Traits>(p, kb, p.dv, &sV_out, rows_begin, rows_begin + 64, wg_thread, 128);
}

}  // namespace jax_flash::cuda::sm90
