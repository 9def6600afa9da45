// Hopper backward, dQ pass: one CTA owns kBlockM query rows of one head (the forward's row block: Q and dO
// resident), streams the visible key tiles and recomputes S and dP, keeping dQ in registers, so dQ is formed in
// one fixed order with no atomics (the design choice of sm80/backward_dq_kernel.h: deterministic for free).
//  - producer warpgroup, thread 0: TMA loads of Q and dO once and of K and V tiles into a kStages pipeline;
//  - each consumer warpgroup owns 64 of the rows: S = Q K^T and dP = dO V^T by WGMMA from smem, the shared
//    backward score step of sm80 (masks, P = exp(S - lse), dS = P (dP - D); in the transforms form,
//    S = transform_score(Q K^T) with softcap and/or ALiBi and dS times the softcap's factor: transformed_scores.h;
//    the masked form adds the boolean mask's elements where its block summary shows a tile partially hidden,
//    masked_scores.h, and skips the key tiles it hides entirely, backward_mask_walk.h; backward_form.h),
//    then dQ += dS K by WGMMA with dS from registers and K^T (MN-major) from smem. The dQ GEMM of tile n runs
//    while tile n+1's S and dP are issued; tile n's K/V stage is handed back once both have retired.
// For float32 inputs (Tf32DqTraits) the same producer and entry drive backward_dq_tf32_consumer.h's consumers.
// Float16 parts (Traits::kLowParts; float16_parts_backward_launch.h): Q, dO, K and V each also as a lo part in
// shared memory, every GEMM as three (split_tf32_mma.h issue_wgmma_parts), dS split into float16 parts in
// registers (each query's row first scaled by a power of two of its own, row_scaled_parts.h), and dQ summed key tile
// by key tile in a float32 partial, its rows scaled back as it joins the total.
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../sm80/fragments.h"
#include "../sm80/row_stats.h"
#include "../sm80/score_tile.h"
#include "../sm80/tensor_offsets.h"
#include "backward_traits.h"
#include "backward_mask_walk.h"
#include "backward_query_rows.h"
#include "backward_dq_tf32_consumer.h"
#include "forward_kernel.h"  // RowBlock, locate_row_block: the dQ pass visits exactly the forward's key tiles
#include "fragments.h"
#include "masked_scores.h"
#include "row_scaled_parts.h"
#include "split_tf32_mma.h"
#include "tma_shapes.h"
#include "transformed_scores.h"

namespace jax_flash::cuda::sm90 {

// Named barrier of consumer g's epilogue: kDqEpilogueBarrier + g.
constexpr int kDqEpilogueBarrier = 1;

// Producer thread: Q and dO once, then K and V of every visible key tile, last to first.
template <class Traits, BackwardForm kForm>
__device__ void produce_dq_tiles(const BackwardArgs<Traits>& args, const RowBlock& rb,
                                 typename Traits::SharedStorage& smem, typename Traits::Pipeline& pipeline) {
  using namespace cute;
  const AttentionBackwardParams& p = args.p;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
  const auto q_shape = query_tma_shape(p);
  const auto kv_shape = key_tma_shape(p);
  const int m_block = static_cast<int>(rb.m0 / kBlockM);
  Tensor gQ = local_tile(args.tma_q.get_tma_tensor(q_shape)(_, _, rb.head, rb.batch),
                         Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gdO = local_tile(args.tma_do.get_tma_tensor(q_shape)(_, _, rb.head, rb.batch),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(args.tma_k.get_tma_tensor(kv_shape)(_, _, rb.head_kv, rb.batch),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n)
  Tensor gV = local_tile(args.tma_v.get_tma_tensor(kv_shape)(_, _, rb.head_kv, rb.batch),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
  auto tma_q = args.tma_q.get_slice(0);
  auto tma_do = args.tma_do.get_slice(0);
  auto tma_k = args.tma_k.get_slice(0);
  auto tma_v = args.tma_v.get_slice(0);

  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.q_full, 2 * Traits::kQBytes);
  copy(args.tma_q.with(smem.q_full), tma_q.partition_S(gQ), tma_q.partition_D(sQ));
  copy(args.tma_do.with(smem.q_full), tma_do.partition_S(gdO), tma_do.partition_D(sdO));
  // Operands in parts (split TF32, float16 parts): the lo parts of Q and dO on the same barrier (kQBytes counts both
  // parts), and below of each K / V tile on its stage's.
  if constexpr (Traits::kLowParts) {
    for (auto [tma, buffer] : {std::make_pair(&args.tma_lo.tma_q, smem.low.q.data()),
                               std::make_pair(&args.tma_lo.tma_do, smem.low.d_o.data())}) {
      auto [src, dst] = tma_load_pair(*tma, q_shape, rb.head, rb.batch, Shape<Int<kBlockM>, Int<kHeadDim>>{},
                                      make_coord(m_block, 0), buffer, typename Traits::SmemLayoutQ{});
      copy(tma->with(smem.q_full), src, dst);
    }
  }

  Tensor tKgK = tma_k.partition_S(gK);  // (TMA, TMA_N, TMA_D, n)
  Tensor tKsK = tma_k.partition_D(sK);  // (TMA, TMA_N, TMA_D, stage)
  Tensor tVgV = tma_v.partition_S(gV);
  Tensor tVsV = tma_v.partition_D(sV);
  typename Traits::PipelineState write = cutlass::make_producer_start_state<typename Traits::Pipeline>();
  for (int n_block = rb.key_tiles.end - 1; n_block >= rb.key_tiles.begin;
       n_block = previous_key_tile<Traits, kForm>(p, rb, n_block - 1)) {
    pipeline.producer_acquire(write);
    auto* full = pipeline.producer_get_barrier(write);
    copy(args.tma_k.with(*full), tKgK(_, _, _, n_block), tKsK(_, _, _, write.index()));
    copy(args.tma_v.with(*full), tVgV(_, _, _, n_block), tVsV(_, _, _, write.index()));
    if constexpr (Traits::kLowParts) {
      for (auto [tma, buffer] : {std::make_pair(&args.tma_lo.tma_k, smem.low.k.data()),
                                 std::make_pair(&args.tma_lo.tma_v, smem.low.v.data())}) {
        auto [src, dst] = tma_load_pair(*tma, kv_shape, rb.head_kv, rb.batch, Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                        make_coord(n_block, 0), buffer, typename Traits::SmemLayoutKV{});
        copy(tma->with(*full), src, dst(_, _, _, write.index()));
      }
    }
    ++write;
  }
}

// Consumer warpgroup `group`: dQ of its 64 rows over every visible key tile, then the epilogue.
// Force-inlined: as a called function, ptxas may serialise its WGMMAs (C7510; see forward_kernel.h).
template <class Traits, BackwardForm kForm>
__device__ __forceinline__ void consume_key_tiles(const AttentionBackwardParams& p, const RowBlock& rb,
                                                 typename Traits::SharedStorage& smem,
                                                 typename Traits::Pipeline& pipeline_kv, int group) {
  using namespace cute;
  using T = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr bool kParts = Traits::kLowParts;
  const int thread = threadIdx.x - 128;  // among all consumer threads

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(thread);
  auto thr_dq = mma_dq.get_thread_slice(thread);
  // Descriptors from the warpgroup's first thread and warp-uniform stages (fragments.h warp_uniform), for the
  // storage `parts` (smem, or its lo parts): q, d_o A of S and dP; k, v B of S and dP and kt B of dQ
  // (MMA, MMA_N, MMA_K, stage).
  const int descriptor_thread = warp_uniform(thread / 128 * 128);
  auto desc_sdp = mma_sdp.get_thread_slice(descriptor_thread);
  auto desc_dq = mma_dq.get_thread_slice(descriptor_thread);
  auto operand_fragments = [&](auto& parts) {
    return cute::make_tuple(
        desc_sdp.partition_fragment_A(make_tensor(make_smem_ptr(parts.q.data()), typename Traits::SmemLayoutQ{})),
        desc_sdp.partition_fragment_A(make_tensor(make_smem_ptr(parts.d_o.data()), typename Traits::SmemLayoutQ{})),
        desc_sdp.partition_fragment_B(make_tensor(make_smem_ptr(parts.k.data()), typename Traits::SmemLayoutKV{})),
        desc_sdp.partition_fragment_B(make_tensor(make_smem_ptr(parts.v.data()), typename Traits::SmemLayoutKV{})),
        desc_dq.partition_fragment_B(make_tensor(make_smem_ptr(parts.k.data()), typename Traits::SmemLayoutKt{})));
  };
  auto [frag_q, frag_do, frag_k, frag_v, frag_kt] = operand_fragments(smem);
  // Without parts, `low` is smem again and these are never read.
  auto [frag_q_lo, frag_do_lo, frag_k_lo, frag_v_lo, frag_kt_lo] = operand_fragments(low_parts<kParts>(smem));

  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);
  // Float16 parts: one key tile's dQ products, added to acc_dq once retired, with the exponents its dS rows were
  // scaled by (row_scaled_parts.h; unused otherwise).
  Tensor partial_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor coords = sm80_view(thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  constexpr int kRows = decltype(size<0>(sm80::rows_cols(coords.layout())))::value;
  sm80::RowStats<kRows> stats;
  [[maybe_unused]] int row_exponents[kRows];  // float16 parts: of the dS rows of the tile whose dQ GEMM is in flight
  stats.load(p, rb.batch, rb.head, rb.m0, coords);
  const float to_log2 = sm80::ScoreTile<false>::to_log2(p);

  Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
  // dS of the previous tile stays in these registers until its dQ GEMM has retired (the next tile's wait).
  Tensor score_grads = make_tensor_like<T>(acc_dp);
  Tensor score_grads_operand = make_tensor(score_grads.data(), accumulator_as_operand_a(score_grads.layout()));
  Tensor score_grads_lo = make_tensor_like<T>(acc_dp);  // float16 parts: dS's lo part
  Tensor score_grads_lo_operand =
      make_tensor(score_grads_lo.data(), accumulator_as_operand_a(score_grads_lo.layout()));
  sm80::NoKeepBits no_dropout;  // the common variant never reads keep bits

  cutlass::arch::ClusterBarrier::wait(&smem.q_full, 0);
  typename Traits::PipelineState read, previous;
  for (int n_block = rb.key_tiles.end - 1; n_block >= rb.key_tiles.begin;
       n_block = previous_key_tile<Traits, kForm>(p, rb, n_block - 1)) {
    const int stage = warp_uniform(read.index());
    const int64_t n0 = int64_t(n_block) * kBlockN;
    // Masked form: whether this tile reads mask elements (its blocks are not all visible), and their bits, gathered
    // before the GEMMs (MaskBits says why).
    [[maybe_unused]] const bool read_mask_elements =
        key_tile_mask_cover<Traits, kForm>(p, rb, n_block) != MaskCover::kVisible;
    [[maybe_unused]] MaskBitsFor<decltype(sm80::as_rows_cols(coords))> mask_bits;
    if constexpr (reads_boolean_mask(kForm)) {
      if (read_mask_elements) {
        mask_bits = decltype(mask_bits)::template gather</*kTransposed=*/false>(
            tile_mask_origin(p, rb.batch, rb.head, rb.m0, n0), p.mask_strides, sm80::as_rows_cols(coords),
            rb.rows_in_bounds, static_cast<int>(min(int64_t(kBlockN), p.seqlen_k - n0)));
      }
    }
    pipeline_kv.consumer_wait(read);
    issue_wgmma_parts<true, kParts>(mma_sdp, frag_q, frag_q_lo, frag_k(_, _, _, stage), frag_k_lo(_, _, _, stage),
                                    acc_s);
    issue_wgmma_parts<true, kParts>(mma_sdp, frag_do, frag_do_lo, frag_v(_, _, _, stage), frag_v_lo(_, _, _, stage),
                                    acc_dp);
    warpgroup_wait<0>();  // S, dP and the previous tile's dQ GEMM have retired
    if (n_block != rb.key_tiles.end - 1) {
      if constexpr (kParts) add_row_scaled_partial(acc_dq, partial_dq, row_exponents);  // the previous tile's
      pipeline_kv.consumer_release(previous);
    }

    const auto scorer = sm80::ScoreTile<false>::make(p, rb.batch, rb.head);
    auto s_view = sm80_view(acc_s);
    auto dp_view = sm80_view(acc_dp);
    const bool interior = n_block >= rb.interior.begin && n_block < rb.interior.end;
    if constexpr (transforms_scores(kForm)) {
      // Transformed scores, then the position masks (hidden: -inf) where the tile needs them, then (masked form)
      // the boolean mask's elements where its blocks are partially hidden.
      auto scores = sm80::as_rows_cols(s_view);
      auto score_coords = sm80::as_rows_cols(coords);
      cap_scores(scores, p.softmax_scale, p.softcap);
      if (!interior) scorer.template apply<true>(s_view, coords, rb.m0, n0);
      if constexpr (reads_boolean_mask(kForm)) {
        if (read_mask_elements) mask_bits.hide_masked(scores);
      }
      capped_step(CappedScoreStep::make(p.softcap, rb.mask.alibi_slope), scores, sm80::as_rows_cols(dp_view),
                  score_coords, first_alibi_distance(rb.mask, score_coords, rb.m0, n0, /*transposed=*/false), stats);
    } else if (interior) {
      sm80::backward_scores<false, false>(scorer, p, no_dropout, s_view, dp_view, coords, stats, rb.m0, n0,
                                          to_log2);
    } else {
      sm80::backward_scores<false, true>(scorer, p, no_dropout, s_view, dp_view, coords, stats, rb.m0, n0,
                                         to_log2);
    }
    if constexpr (kParts) {  // each query's row of dS scaled by a power of two of its own (row_scaled_parts.h)
      auto ds_rows = sm80::as_rows_cols(dp_view);
      quad_row_exponents(ds_rows, row_exponents);
      scale_rows_for_parts(ds_rows, row_exponents);
      split_registers(acc_dp, score_grads, score_grads_lo);
    } else {
      Tensor converted = sm80::converted<T>(acc_dp);
      CUTE_UNROLL
      for (int i = 0; i < size(score_grads); ++i) score_grads(i) = converted(i);
    }
    issue_wgmma_parts<kParts, kParts>(mma_dq, score_grads_operand, score_grads_lo_operand, frag_kt(_, _, _, stage),
                                      frag_kt_lo(_, _, _, stage), gemm_target<kParts>(acc_dq, partial_dq));
    previous = read;
    ++read;
  }
  warpgroup_wait<0>();
  if constexpr (kParts) add_row_scaled_partial(acc_dq, partial_dq, row_exponents);
  pipeline_kv.consumer_release(previous);

  // Epilogue: dQ carries the softmax scale (transforms form: dS is d loss / d(scaled dot)); staged in this
  // warpgroup's own rows of Q (its GEMMs read only those and have retired) for 16-byte row stores.
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) *= p.softmax_scale;
  if constexpr (!std::is_same_v<typename Traits::OutElement, T>) {  // float32 gradients: straight to global memory
    store_float_query_rows<kBlockM, kHeadDim>(p, rb, mma_dq, thread, acc_dq);
  } else {
    Tensor dq_out = sm80::converted<T>(acc_dq);
    copy(dq_out, thr_dq.partition_C(sQ));
    named_barrier_sync(kDqEpilogueBarrier + group, 128);
    store_query_rows<Traits>(p, rb, &sQ, group * 64, group * 64 + 64, thread % 128, 128);
  }
}

template <class Traits, BackwardForm kForm>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    dq_kernel(const __grid_constant__ BackwardArgs<Traits> args) {
  using namespace cute;
  extern __shared__ __align__(1024) char smem_bytes[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bytes);
  const AttentionBackwardParams& p = args.p;

  const RowBlock rb = locate_backward_row_block<Traits, kForm>(p);
  if (rb.key_tiles.empty()) {  // rows that see no key: dQ = 0
    using NoStage = decltype(make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{}));
    store_query_rows<Traits, NoStage>(p, rb, nullptr, 0, Traits::kBlockM, threadIdx.x, Traits::kThreads);
    return;
  }

  const int warp_group = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptors(args.tma_q, args.tma_do, args.tma_k, args.tma_v);
    if constexpr (Traits::kLowParts) {
      prefetch_tma_descriptors(args.tma_lo.tma_q, args.tma_lo.tma_do, args.tma_lo.tma_k, args.tma_lo.tma_v);
    }
    cutlass::arch::ClusterTransactionBarrier::init(&smem.q_full, 1);
  }
  using Pipeline = typename Traits::Pipeline;
  const auto params = tma_pipeline_params<Pipeline>(Traits::kConsumerThreads, 2 * Traits::kKVBytes);
  Pipeline pipeline_kv(smem.pipeline_kv, params, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier initialisation visible to every thread before any use

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x == 0) produce_dq_tiles<Traits, kForm>(args, rb, smem, pipeline_kv);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    if constexpr (Traits::kTf32) {
      static_assert(kForm == BackwardForm::kCommon, "the TF32 dQ pass has the common form only");
      consume_key_tiles_tf32<Traits>(p, rb, smem, pipeline_kv, warp_group - 1);
    } else {
      consume_key_tiles<Traits, kForm>(p, rb, smem, pipeline_kv, warp_group - 1);
    }
  }
}

}  // namespace jax_flash::cuda::sm90
