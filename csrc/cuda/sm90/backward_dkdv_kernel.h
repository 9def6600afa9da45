// Hopper backward, dK/dV pass. One CTA owns kBlockN keys of one KV head; K and V stay in shared memory and dK, dV
// in registers while it streams every query tile that can see them, for every query head of the GQA group (dK/dV
// summed over the group in a fixed order: no atomics, bit-reproducible), like sm80/backward_dkdv_kernel.h.
//  - producer warpgroup: thread 0 issues the TMA loads (K and V once; Q and dO tiles into a kStages-deep
//    PipelineTmaAsync); warp 1 copies the lse / softmax_d rows of the same tiles into a PipelineAsync;
//  - each consumer warpgroup owns 64 of the keys. Per query tile, all with WGMMA:
//      S^T = K Q^T, dP^T = V dO^T        (both operands from smem)
//      P^T = exp(S^T - lse), dS^T = P^T (dP^T - D)   (in registers; masks only on boundary tiles)
//        (transforms form: S^T = transform_score(K Q^T) with softcap and/or ALiBi, and dS^T also carries the
//        softcap's factor; transformed_scores.h. Masked form: the same, plus the boolean mask's elements read in
//        the items its block summary shows partially hidden, masked_scores.h; backward_form.h)
//      dV += P^T dO, dK += dS^T Q        (P^T, dS^T straight from the accumulators as register A operands)
// Computing the transposed scores is what lets P and dS skip shared memory: their rows are already the keys.
// Items (query head of the group, query tile) run in order; the masked form skips those the mask hides entirely
// (backward_mask_walk.h next_item), and every role of the CTA walks the same list.
// Fused dQ (kFusedDq, when the call gives a dq_accum workspace; not for deterministic calls): each consumer also
// stores its dS^T into shared memory, the two meet at a barrier, and consumer g computes
//      dQ[:, g-th column slice] = dS K    (WGMMA, both operands from smem; all kBlockN keys)
// (at d=64 one consumer computes all the columns, the two taking turns by item: DkdvTraits::kDqAlternating)
// and stages it in shared memory in fragment order; one thread of producer warp 2 adds the whole staged tile to its
// chunk of the tile-major dq_accum with one bulk reduction (dq_staging.h), so the consumers issue no global
// atomics. Then no separate dQ pass recomputes S and dP: 5 GEMMs instead of 7.
// At d=256 (DkdvSplitTraits) the same producer and kernel entry drive the split-head-dim consumers of
// backward_dkdv_split_consumer.h instead (no fused dQ there), and for float32 inputs (Tf32DkdvTraits) the TF32
// consumers of backward_dkdv_tf32_consumer.h.
#pragma once

#include <climits>
#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../sm80/fragments.h"
#include "../sm80/score_tile.h"
#include "../sm80/tensor_offsets.h"
#include "backward_dkdv_split_consumer.h"
#include "backward_dkdv_tf32_consumer.h"
#include "backward_key_block.h"
#include "backward_mask_walk.h"
#include "backward_traits.h"
#include "dq_staging.h"
#include "fragments.h"
#include "masked_scores.h"
#include "persistent_pass.h"
#include "tma_shapes.h"
#include "transformed_scores.h"
#include "transposed_scores.h"

namespace jax_flash::cuda::sm90 {

// Named barriers (id 0 is __syncthreads): consumer g's epilogue kDkdvEpilogueBarrier + g; both consumers (fused
// dQ) kDsStoredBarrier: their dS of an item is in shared memory, or their last dQ GEMM read of K has retired.
constexpr int kDkdvEpilogueBarrier = 1;
constexpr int kDsStoredBarrier = 3;

// The K/V buffer of a CTA's key block: its `fill`-th block with any item uses buffer fill % kKvBuffers, that
// buffer's (fill / kKvBuffers)-th load; from the second use on, the producer first waits for the consumers'
// epilogue of the block before (kv_empty).
struct KvBuffer {
  int buffer;
  int full_phase;   // parity of kv_full[buffer] the consumers wait for
  bool reuse;
  int empty_phase;  // parity of kv_empty[buffer] the producer waits for when reuse
};
template <class Traits>
__device__ __forceinline__ KvBuffer kv_buffer_of(int fill) {
  const int use = fill / Traits::kKvBuffers;
  return {fill % Traits::kKvBuffers, use & 1, use > 0, (use - 1) & 1};
}
template <class Traits, class Array>
__device__ __forceinline__ auto* kv_buffer_data(Array& buffers, int buffer) {
  return buffers.data() + buffer * cute::cosize_v<typename Traits::SmemLayoutKV>;
}

// Producer thread, per key block: K and V into buffer kv.buffer (on the persistent grid, once the consumers have
// released it), then Q and dO of every item (`write` runs on across the CTA's key blocks).
template <class Traits, BackwardForm kForm>
__device__ void produce_dkdv_tiles(const BackwardArgs<Traits>& args, const KeyBlock& kb,
                                   typename Traits::SharedStorage& smem, typename Traits::Pipeline& pipeline,
                                   typename Traits::PipelineState& write, const KvBuffer& kv) {
  using namespace cute;
  const AttentionBackwardParams& p = args.p;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  Tensor sK = make_tensor(make_smem_ptr(kv_buffer_data<Traits>(smem.k, kv.buffer)), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(kv_buffer_data<Traits>(smem.v, kv.buffer)), typename Traits::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), typename Traits::SmemLayoutQ{});
  const auto q_shape = query_tma_shape(p);
  const auto kv_shape = key_tma_shape(p);
  const int n_block = static_cast<int>(kb.n0 / kBlockN);
  Tensor gK = local_tile(args.tma_k.get_tma_tensor(kv_shape)(_, _, kb.head_kv, kb.batch),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gV = local_tile(args.tma_v.get_tma_tensor(kv_shape)(_, _, kb.head_kv, kb.batch),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  auto tma_q = args.tma_q.get_slice(0);
  auto tma_do = args.tma_do.get_slice(0);
  auto tma_k = args.tma_k.get_slice(0);
  auto tma_v = args.tma_v.get_slice(0);

  if (kv.reuse) cutlass::arch::ClusterBarrier::wait(&smem.kv_empty[kv.buffer], kv.empty_phase);
  uint64_t& kv_full = smem.kv_full[kv.buffer];
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&kv_full, 2 * Traits::kKVBytes);
  copy(args.tma_k.with(kv_full), tma_k.partition_S(gK), tma_k.partition_D(sK));
  copy(args.tma_v.with(kv_full), tma_v.partition_S(gV), tma_v.partition_D(sV));
  // Operands in parts (split TF32, float16 parts): the lo parts of K and V on the same barrier (kKVBytes counts both
  // parts), and below of each Q / dO tile on its stage's.
  if constexpr (Traits::kLowParts) {
    for (auto [tma, buffer] : {std::make_pair(&args.tma_lo.tma_k, smem.low.k.data()),
                               std::make_pair(&args.tma_lo.tma_v, smem.low.v.data())}) {
      auto [src, dst] = tma_load_pair(*tma, kv_shape, kb.head_kv, kb.batch, Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                      make_coord(n_block, 0), buffer, typename Traits::SmemLayoutKV{});
      copy(tma->with(kv_full), src, dst);
    }
  }

  Tensor mQ = args.tma_q.get_tma_tensor(q_shape);
  Tensor mdO = args.tma_do.get_tma_tensor(q_shape);
  Tensor tQsQ = tma_q.partition_D(sQ);     // (TMA, TMA_M, TMA_D, stage)
  Tensor tdOsdO = tma_do.partition_D(sdO);
  // Items in order: query heads of the group, then query tiles (KeyBlock::tile_of / next_tile).
  auto q_tiles = [&](int64_t head) {  // (TMA, TMA_M, TMA_D, m)
    return tma_q.partition_S(local_tile(mQ(_, _, head, kb.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                                        make_coord(_, 0)));
  };
  auto do_tiles = [&](int64_t head) {
    return tma_do.partition_S(local_tile(mdO(_, _, head, kb.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                                         make_coord(_, 0)));
  };
  auto load = [&](auto const& tQgQ, auto const& tdOgdO, int64_t head, int m_block) {
    pipeline.producer_acquire(write);
    auto* full = pipeline.producer_get_barrier(write);
    copy(args.tma_q.with(*full), tQgQ(_, _, _, m_block), tQsQ(_, _, _, write.index()));
    copy(args.tma_do.with(*full), tdOgdO(_, _, _, m_block), tdOsdO(_, _, _, write.index()));
    if constexpr (Traits::kLowParts) {
      for (auto [tma, buffer] : {std::make_pair(&args.tma_lo.tma_q, smem.low.q.data()),
                                 std::make_pair(&args.tma_lo.tma_do, smem.low.d_o.data())}) {
        auto [src, dst] = tma_load_pair(*tma, q_shape, head, kb.batch, Shape<Int<kBlockM>, Int<kHeadDim>>{},
                                        make_coord(m_block, 0), buffer, typename Traits::SmemLayoutQ{});
        copy(tma->with(*full), src, dst(_, _, _, write.index()));
      }
    }
    ++write;
  };
  if constexpr (reads_boolean_mask(kForm)) {
    // The items the mask summary leaves anything visible in (backward_mask_walk.h).
    const ItemMaskBlocks blocks = item_mask_blocks<Traits, kForm>(p, kb);
    for (int item = next_item<Traits, kForm>(kb, blocks, 0); item < kb.items;
         item = next_item<Traits, kForm>(kb, blocks, item + 1)) {
      const ItemTile t = kb.tile_of(item);
      load(q_tiles(t.head), do_tiles(t.head), t.head, t.m_block);
    }
  } else {
    // Every item, the tensors of a query head made once (a walk by item cost the d=256 kernel 28 bytes of spills).
    for (int64_t head = kb.head_kv * kb.group; head < (kb.head_kv + 1) * kb.group; ++head) {
      const auto tQgQ = q_tiles(head);
      const auto tdOgdO = do_tiles(head);
      for (int tile = 0; tile < kb.query_tiles.size(); ++tile) load(tQgQ, tdOgdO, head, kb.query_tiles.begin + tile);
    }
  }
}

// Producer warp 1, per key block (`write` runs on across them): lse (as log2, +inf for rows without a visible key)
// and softmax_d of every item's rows; in the masked form also the item itself and its mask tile, and after the last
// item one more stage whose item is -1 (the end), so that the consumers need not walk the mask summary (see
// consume_query_tiles).
template <class Traits, BackwardForm kForm>
__device__ void produce_row_stats(const AttentionBackwardParams& p, const KeyBlock& kb,
                                  typename Traits::SharedStorage& smem, typename Traits::StatsPipeline& pipeline,
                                  typename Traits::PipelineState& write) {
  const int lane = threadIdx.x % 32;
  // Lean on registers: this warp runs under the producer's setmaxnreg budget.
  // Fills a stage with the rows of query tile m_block (head's lse and softmax_d); `also` writes more into it.
  auto fill = [&](const float* lse, const float* row_d, int m_block, auto also) {
    const int m0 = m_block * Traits::kBlockM;
    const int rows = min(Traits::kBlockM, static_cast<int>(p.seqlen_q) - m0);
    pipeline.producer_acquire(write);
    float* lse_log2 = smem.lse_log2[write.index()];
    float* softmax_d = smem.softmax_d[write.index()];
#pragma unroll 1
    for (int i = lane; i < Traits::kBlockM; i += 32) {
      const float row_lse = i < rows ? lse[m0 + i] : -INFINITY;
      lse_log2[i] = row_lse == -INFINITY ? INFINITY : row_lse * sm80::kLog2e;
      softmax_d[i] = i < rows ? row_d[m0 + i] : 0.0f;
    }
    also(write.index(), m0);
    pipeline.producer_commit(write);
    ++write;
  };
  if constexpr (reads_boolean_mask(kForm)) {
    const ItemMaskBlocks blocks = item_mask_blocks<Traits, kForm>(p, kb);
    for (int item = next_item<Traits, kForm>(kb, blocks, 0); item < kb.items;
         item = next_item<Traits, kForm>(kb, blocks, item + 1)) {
      const ItemTile t = kb.tile_of(item);
      const int64_t head = t.head;
      fill(p.lse + sm80::row_stat_offset(p, kb.batch, head, 0),
           p.softmax_d + sm80::row_stat_offset(p, kb.batch, head, 0), t.m_block, [&](int stage, int m0) {
             if (lane == 0) {
               smem.stage_item[stage] = item;
               smem.stage_mask_tile[stage] = blocks.template cover<Traits>(kb, item) == MaskCover::kVisible
                                                 ? nullptr
                                                 : tile_mask_origin(p, kb.batch, head, m0, kb.n0);
             }
           });
    }
    // The end mark.
    pipeline.producer_acquire(write);
    if (lane == 0) {
      smem.stage_item[write.index()] = -1;
      smem.stage_mask_tile[write.index()] = nullptr;
    }
    pipeline.producer_commit(write);
  } else {
    for (int64_t head = kb.head_kv * kb.group; head < (kb.head_kv + 1) * kb.group; ++head) {
      const float* lse = p.lse + sm80::row_stat_offset(p, kb.batch, head, 0);
      const float* row_d = p.softmax_d + sm80::row_stat_offset(p, kb.batch, head, 0);
      for (int tile = 0; tile < kb.query_tiles.size(); ++tile) {
        fill(lse, row_d, kb.query_tiles.begin + tile, [](int, int) {});
      }
    }
  }
}

// Producer warp 2 (fused dQ), lane 0 issuing: each item's staged dQ tile into its dq_accum chunk (one bulk
// reduction), then the tile back to the consumers once the reduction has read it. `visit` counts the items walked
// (the barrier phases) over the CTA's key blocks, `item` names the tile.
template <class Traits, BackwardForm kForm>
__device__ void write_dq_tiles(const AttentionBackwardParams& p, const KeyBlock& kb,
                               typename Traits::SharedStorage& smem, int& visit) {
  const int lane = threadIdx.x % 32;
  const ItemMaskBlocks blocks = item_mask_blocks<Traits, kForm>(p, kb);
  for (int item = next_item<Traits, kForm>(kb, blocks, 0); item < kb.items;
       item = next_item<Traits, kForm>(kb, blocks, item + 1), ++visit) {
    const ItemTile t = kb.tile_of(item);  // before the wait, which hides its division
    cutlass::arch::ClusterBarrier::wait(&smem.dq_full, visit & 1);
    if (lane == 0) {
      reduce_dq_tile(p, smem.dq, kb.batch, t.head, t.m_block);
      bulk_wait_read();
      cutlass::arch::ClusterBarrier::arrive(&smem.dq_empty);
    }
    __syncwarp();
  }
}

// Consumer warpgroup `group`, per key block: dK and dV of its 64 keys over every item (and with kFusedDq, its slice
// of every item's dQ), then the epilogue, after which it releases the block's K/V buffer. `read` (the Q/dO and
// row-stats stages) and `visit` (the items walked: dS buffers and dQ barrier phases) run on across the CTA's blocks.
// Force-inlined: as a called function, ptxas may serialise its WGMMAs (C7510; see forward_kernel.h).
template <class Traits, BackwardForm kForm, bool kFusedDq>
__device__ __forceinline__ void consume_query_tiles(const AttentionBackwardParams& p, const KeyBlock& kb,
                                                   typename Traits::SharedStorage& smem,
                                                   typename Traits::Pipeline& pipeline_qdo,
                                                   typename Traits::StatsPipeline& pipeline_stats, int group,
                                                   typename Traits::PipelineState& read, int& visit,
                                                   const KvBuffer& kv) {
  using namespace cute;
  using T = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const int thread = threadIdx.x - 128;  // among all consumer threads
  // The smem descriptors are the same for every thread of a warpgroup: sliced with its first thread and built from
  // warp-uniform buffer and stage indices (fragments.h warp_uniform). The accumulators use `thread`.
  const int descriptor_thread = warp_uniform(group * 128);
  const int kv_buffer = warp_uniform(kv.buffer);

  Tensor sK = make_tensor(make_smem_ptr(kv_buffer_data<Traits>(smem.k, kv_buffer)), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(kv_buffer_data<Traits>(smem.v, kv_buffer)), typename Traits::SmemLayoutKV{});
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.d_o.data()), typename Traits::SmemLayoutQt{});

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaDkv mma_dkv;
  auto thr_sdp = mma_sdp.get_thread_slice(thread);
  auto desc_sdp = mma_sdp.get_thread_slice(descriptor_thread);
  auto desc_dkv = mma_dkv.get_thread_slice(descriptor_thread);
  Tensor frag_k = desc_sdp.partition_fragment_A(sK);     // smem descriptors
  Tensor frag_v = desc_sdp.partition_fragment_A(sV);
  Tensor frag_q = desc_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stage)
  Tensor frag_do = desc_sdp.partition_fragment_B(sdO);
  Tensor frag_qt = desc_dkv.partition_fragment_B(sQt);   // (MMA, MMA_N, MMA_K, stage)
  Tensor frag_dot = desc_dkv.partition_fragment_B(sdOt);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);
  // (key, query) of each score element, as rows x cols of this thread.
  Tensor coords = sm80::as_rows_cols(
      sm80_view(thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}))));
  const float scale_log2 = p.softmax_scale * sm80::kLog2e;

  // Fused dQ: dS (query, key, buffer) written through its transposed view from the S^T-shaped accumulators;
  // this consumer's column slice of K^T as the B operand.
  Tensor sDs = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDs{});
  Tensor sDsT = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDsT{});
  Tensor sKt = make_tensor(make_smem_ptr(kv_buffer_data<Traits>(smem.k, kv_buffer)), typename Traits::SmemLayoutKt{});
  constexpr int kDqCols = Traits::kDqCols;
  typename Traits::TiledMmaDq mma_dq;
  static_assert(!kFusedDq ||
                dq_fragments_are_column_grouped<typename Traits::TiledMmaDq, kBlockM, kDqCols>());  // staged order
  auto desc_dq = mma_dq.get_thread_slice(descriptor_thread % 128);
  Tensor frag_ds = desc_dq.partition_fragment_A(sDs);  // (MMA, MMA_M, MMA_K, buffer)
  // This consumer's column slice of K^T (all of it where the consumers alternate over items).
  const int dq_slice = Traits::kDqAlternating ? 0 : group;
  Tensor frag_kt = desc_dq.partition_fragment_B(
      local_tile(sKt, Shape<Int<kDqCols>, Int<kBlockN>>{}, make_coord(dq_slice, 0)));

  // The query tiles that can see this consumer's 64 keys by position. In the others (above a causal diagonal: the
  // first item of a causal key block, for the upper consumer) its S^T, dP^T, dV and dK terms are all zero: it skips
  // their GEMMs and score arithmetic and hands the fused dQ a zero dS (the hidden-item path below). Only at d=64:
  // at d=128 the two registers of the span alone took the transforms form from 12 to 60 bytes of spills (ptxas).
  constexpr bool kSkipHiddenKeys = kHeadDim == 64;
  const TileSpan seen_by =
      kSkipHiddenKeys ? query_tiles_for_keys(kb.mask, kb.n0 + group * 64, 64, kBlockM) : TileSpan{0, INT_MAX};
  // The query tiles in which every row sees all the block's keys: no per-element mask (decided per tile, the
  // position bounds cost the d=64 consumers 39 instructions per item, 64-bit, and 7% of the stall samples).
  const TileSpan unmasked = fully_visible_query_tiles(kb.mask, kb.n0, kBlockN, kBlockM);
  // Both consumers' dS of an item stored. The hidden-item path meets the other consumer's main path here from an
  // instruction of its own, which PTX allows only for the non-aligned barrier (named_barrier.h).
  auto meet_at_ds_barrier = [] {
    if constexpr (kSkipHiddenKeys) {
      named_barrier_sync_unaligned(kDsStoredBarrier, Traits::kConsumerThreads);
    } else {
      named_barrier_sync(kDsStoredBarrier, Traits::kConsumerThreads);
    }
  };
  // Fused dQ: whether this consumer computes item `visit`'s dQ (its column slice, or at d=64 all of it in turn),
  // issuing its GEMM from dS buffer `buffer`.
  auto dq_turn = [&](int visit) { return !Traits::kDqAlternating || (visit & 1) == group; };
  auto issue_dq = [&](int buffer) {
    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kDqCols>>{});
    Tensor frag_ds_item = frag_ds(_, _, _, buffer);
    issue_wgmma<true>(mma_dq, frag_ds_item, frag_kt, acc_dq);
    return acc_dq;
  };
  // Fused dQ: stage an item's dQ tile once the writer's reduction of the previous item has read the last one.
  // (Alternating: the previous item's consumer waited for the one before at that item's barrier, which this one
  // passed, so the barrier is never two phases behind the parity waited for.)
  auto stage_dq = [&](int at_visit, auto const& acc_dq) {
    if (at_visit > 0) cutlass::arch::ClusterBarrier::wait(&smem.dq_empty, (at_visit - 1) & 1);
    stage_dq_tile<Traits::kDqGroupsPerConsumer>(smem.dq, acc_dq, dq_slice, thread % 128);
    fence_stores_for_async_proxy();  // generic-proxy stores before the bulk copies (async proxy) read
    cutlass::arch::ClusterBarrier::arrive(&smem.dq_full);
  };

  cutlass::arch::ClusterBarrier::wait(&smem.kv_full[kv.buffer], kv.full_phase);
  // Q/dO and their row stats advance in lock step (`read`). `visit` counts the items walked over the CTA's key
  // blocks (dS buffers and dQ barrier phases alternate with it); `walked` those of this block; `tile` names the item.
  // Masked form: the consumers take each item's index, and its mask tile where it reads mask elements, from its
  // row-stats stage, until the stage that marks the end (produce_row_stats walks the mask summary). Walking it here,
  // in the loop beside dK and dV, spilled (ptxas, d=128: 444 bytes per thread), and counting the items up front
  // would cost one dependent summary load per item before the first GEMM. The other forms visit every item in order.
  const int visits = reads_boolean_mask(kForm) ? INT_MAX : kb.items;
  ItemTile next = kb.first_tile();
  for (int walked = 0; walked < visits; ++walked, ++visit) {
    const int stage = warp_uniform(read.index());
    ItemTile tile = next;
    next = kb.next_tile(next);
    [[maybe_unused]] const bool* mask_tile = nullptr;
    if constexpr (reads_boolean_mask(kForm)) {
      pipeline_stats.consumer_wait(read);
      const int item = smem.stage_item[stage];
      mask_tile = smem.stage_mask_tile[stage];
      if (item < 0) break;  // the end mark: no Q/dO stage goes with it
      tile = kb.tile_of(item);
    }
    [[maybe_unused]] const bool read_mask_elements = mask_tile != nullptr;
    const int64_t m0 = int64_t(tile.m_block) * kBlockM;
    if (kSkipHiddenKeys && !seen_by.contains(tile.m_block)) {
      // The stages are waited for before they go back, so that the releases land in their phases.
      pipeline_qdo.consumer_wait(read);
      if constexpr (!reads_boolean_mask(kForm)) pipeline_stats.consumer_wait(read);
      if constexpr (kFusedDq) {
        const int buffer = warp_uniform(visit & 1);
        Tensor zeros = make_tensor<T>(partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{}).layout());
        fill(zeros, T(0));
        store_accumulators(mma_sdp, thread, zeros, sDsT(_, _, buffer));
        fence_stores_for_async_proxy();
        meet_at_ds_barrier();
        if (dq_turn(visit)) {
          auto acc_dq = issue_dq(buffer);
          warpgroup_wait<0>();
          stage_dq(visit, acc_dq);
        }
      }
      pipeline_stats.consumer_release(read);
      pipeline_qdo.consumer_release(read);
      ++read;
      continue;
    }
    // Transforms and masked forms: ALiBi's slope is the item's query head's (it changes along a GQA group); loaded
    // before the GEMMs so that they hide its latency.
    float alibi_slope = 0.0f;
    if constexpr (transforms_scores(kForm)) {
      if (p.alibi_slopes != nullptr) alibi_slope = p.alibi_slopes[kb.batch * p.heads_q + tile.head];
    }
    // Masked form: the mask bits of an item that reads mask elements (its blocks are not all visible), gathered
    // before the GEMMs (MaskBits says why); the mask of the item's own query head (it may differ along the GQA
    // group, the position masks do not).
    [[maybe_unused]] MaskBitsFor<decltype(coords)> mask_bits;
    if constexpr (reads_boolean_mask(kForm)) {
      if (read_mask_elements) {
        mask_bits = MaskBitsFor<decltype(coords)>::template gather</*kTransposed=*/true>(
            mask_tile, p.mask_strides, coords, static_cast<int>(p.seqlen_q - m0), kb.keys_in_bounds);
      }
    }
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    pipeline_qdo.consumer_wait(read);
    issue_wgmma<true>(mma_sdp, frag_k, frag_q(_, _, _, stage), acc_s);
    issue_wgmma<true>(mma_sdp, frag_v, frag_do(_, _, _, stage), acc_dp);
    if constexpr (!reads_boolean_mask(kForm)) pipeline_stats.consumer_wait(read);
    auto scores = sm80::as_rows_cols(sm80_view(acc_s));
    auto dp = sm80::as_rows_cols(sm80_view(acc_dp));
    warpgroup_wait<1>();  // S^T is ready; dP^T may still run
    if constexpr (transforms_scores(kForm)) {
      // The tanh (the costly part) and the masks while dP^T runs; the rest needs dP^T for the softcap's factor.
      cap_scores(scores, p.softmax_scale, p.softcap);
      if (!unmasked.contains(tile.m_block)) {
        mask_transposed_scores(kb.mask, scores, coords, kb.n0, m0);
      }
      if constexpr (reads_boolean_mask(kForm)) {
        if (read_mask_elements) mask_bits.hide_masked(scores);
      }
      warpgroup_wait<0>();
      transposed_capped_step(CappedScoreStep::make(p.softcap, alibi_slope), scores, dp, coords,
                             first_alibi_distance(kb.mask, coords, m0, kb.n0, /*transposed=*/true),
                             smem.lse_log2[stage], smem.softmax_d[stage]);
    } else {
      if (!unmasked.contains(tile.m_block)) {
        mask_transposed_scores(kb.mask, scores, coords, kb.n0, m0);
      }
      transposed_probabilities(scores, coords, smem.lse_log2[stage], scale_log2);
      warpgroup_wait<0>();
      transposed_score_grads(scores, dp, coords, smem.softmax_d[stage]);
    }

    Tensor probs = sm80::converted<T>(acc_s);
    Tensor score_grads = sm80::converted<T>(acc_dp);
    Tensor probs_operand = make_tensor(probs.data(), accumulator_as_operand_a(probs.layout()));
    Tensor score_grads_operand = make_tensor(score_grads.data(), accumulator_as_operand_a(score_grads.layout()));
    if constexpr (kFusedDq) {
      // Buffer visit & 1 is free: both consumers retired its item - 2 dQ GEMM before arriving at item - 1's
      // barrier, which this consumer has passed.
      const int buffer = warp_uniform(visit & 1);
      store_accumulators(mma_sdp, thread, score_grads, sDsT(_, _, buffer));  // stmatrix (fragments.h)
      fence_stores_for_async_proxy();  // these generic-proxy stores before the WGMMA (async proxy) reads
      // dV first, so that it runs while the consumers meet; then dQ before dK, so that dQ retires first and its
      // staging overlaps dK. On the H200 this order ran the backward 3-9% faster (median 5.5%) than barrier, dV, dK,
      // dQ with the staging after all three (d=64/128, 1k-16k, causal and not; benchmarks/NOTES.md, 23rd session).
      issue_wgmma<false>(mma_dkv, probs_operand, frag_dot(_, _, _, stage), acc_dv);
      meet_at_ds_barrier();
      if (dq_turn(visit)) {
        auto acc_dq = issue_dq(buffer);
        issue_wgmma<false>(mma_dkv, score_grads_operand, frag_qt(_, _, _, stage), acc_dk);
        // The row-stats stage goes back only now: P^T and dS^T (which every lse / softmax_d value loaded from it
        // feeds) are register operands of the WGMMAs just issued, so their issue waited for those loads.
        pipeline_stats.consumer_release(read);
        warpgroup_wait<1>();  // dV and dQ retired; dK runs on under the staging
        stage_dq(visit, acc_dq);
      } else {  // the other consumer computes this item's dQ
        issue_wgmma<false>(mma_dkv, score_grads_operand, frag_qt(_, _, _, stage), acc_dk);
        pipeline_stats.consumer_release(read);
      }
      warpgroup_wait<0>();  // dK retired: Q (and dO) may go back
      pipeline_qdo.consumer_release(read);
    } else {
      issue_wgmma<false>(mma_dkv, probs_operand, frag_dot(_, _, _, stage), acc_dv);
      issue_wgmma<false>(mma_dkv, score_grads_operand, frag_qt(_, _, _, stage), acc_dk);
      pipeline_stats.consumer_release(read);  // after the issue of its loads' register operands, as above
      // Retire both before the registers of P^T and dS^T go out of scope and before the stage is handed back.
      warpgroup_wait<0>();
      pipeline_qdo.consumer_release(read);
    }
    ++read;
  }

  // Epilogue: dK carries the softmax scale of S = scale * Q K^T (transforms form: of the scaled dot inside the
  // transform, dS^T being d loss / d(scaled dot)). This warpgroup's GEMMs read only its own 64 rows of V, and of
  // K too except the fused dQ's, which read all of K: dV and dK are staged in this warpgroup's rows of V and K for
  // 16-byte row stores, dK only once both consumers' last dQ GEMMs have retired.
  // One tensor at a time, so that the other's float accumulators are not live during the swizzled stores.
  // Float32 gradients (of float16 operands) go straight from the accumulators to global memory instead.
  constexpr bool kFloatOut = !std::is_same_v<typename Traits::OutElement, T>;
  if constexpr (kFloatOut) {
    store_float_key_rows<kBlockN, kHeadDim>(p, kb, p.dv, mma_dkv, thread, acc_dv);
  } else {
    Tensor dv_out = sm80::converted<T>(acc_dv);
    store_accumulators(mma_dkv, thread, dv_out, sV);
  }
  if constexpr (kFusedDq) named_barrier_sync(kDsStoredBarrier, Traits::kConsumerThreads);
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
  if constexpr (kFloatOut) {
    store_float_key_rows<kBlockN, kHeadDim>(p, kb, p.dk, mma_dkv, thread, acc_dk);
  } else {
    Tensor dk_out = sm80::converted<T>(acc_dk);
    store_accumulators(mma_dkv, thread, dk_out, sK);
    named_barrier_sync(kDkdvEpilogueBarrier + group, 128);
    const int rows_begin = group * 64;
    store_key_rows<Traits>(p, kb, p.dk, &sK, rows_begin, rows_begin + 64, thread % 128, 128);
    store_key_rows<Traits>(p, kb, p.dv, &sV, rows_begin, rows_begin + 64, thread % 128, 128);
  }
  // This thread's accesses to the buffer are done; its generic-proxy stores (the dK/dV staging) are ordered before
  // the TMA (async proxy) writes of the block that reuses it.
  fence_stores_for_async_proxy();
  cutlass::arch::ClusterBarrier::arrive(&smem.kv_empty[kv.buffer]);
}

// Whether a form's CTAs may take several key blocks (the persistent grid): every role then carries its pipeline
// state and item count from one block to the next, and the next block's K and V load into the second K/V buffer
// while the current one runs (so only where two fit: d=64, d=96). Not the masked form (its consumers stop at an
// end-mark stage of the row-stats pipeline that has no Q/dO stage, which would put the two pipelines out of step for
// the next block), nor the split-head-dim and TF32 consumers (written for one block per CTA).
template <class Traits, BackwardForm kForm>
constexpr bool dkdv_runs_persistent() {
  return !Traits::kSplitHeadDim && !Traits::kTf32 && !reads_boolean_mask(kForm) && Traits::kKvBuffers == 2;
}

// CTA blockIdx.x takes key blocks of args.key_blocks pass by pass (pass_tile; the launch gives one CTA per block
// unless dkdv_runs_persistent, then possibly one per SM). Each role walks the same blocks in the same order.
template <class Traits, BackwardForm kForm, bool kFusedDq>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    dkdv_kernel(const __grid_constant__ BackwardArgs<Traits> args) {
  using namespace cute;
  static_assert(!(kFusedDq && Traits::kSplitHeadDim), "the split-head-dim form has no fused dQ");
  static_assert(!(kForm != BackwardForm::kCommon && Traits::kSplitHeadDim),
                "the split-head-dim form has no transforms or masked form");
  static_assert(!Traits::kTf32 || (kForm == BackwardForm::kCommon && !kFusedDq),
                "the TF32 form has no transforms, masked or fused-dQ form");
  static_assert(!Traits::kLowParts || Traits::kKvBuffers == 1, "the lo parts of K and V have one buffer");
  extern __shared__ __align__(1024) char smem_bytes[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bytes);
  const AttentionBackwardParams& p = args.p;
  constexpr bool kPersistent = dkdv_runs_persistent<Traits, kForm>();
  // Off the persistent grid the CTA's one key block is located once, first, and if no query sees its keys (by
  // position, or in the masked form by the mask summary) every thread stores its share of dK = dV = 0 and leaves.
  KeyBlock single{};
  if constexpr (!kPersistent) {
    single = locate_key_block<Traits>(p, args.band_slices, blockIdx.x);
    if (next_item<Traits, kForm>(single, item_mask_blocks<Traits, kForm>(p, single), 0) >= single.items) {
      using NoStage = decltype(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{}));
      store_key_rows<Traits, NoStage>(p, single, p.dk, nullptr, 0, Traits::kBlockN, threadIdx.x, Traits::kThreads);
      store_key_rows<Traits, NoStage>(p, single, p.dv, nullptr, 0, Traits::kBlockN, threadIdx.x, Traits::kThreads);
      return;
    }
  }

  const int warp_group = threadIdx.x / 128;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptors(args.tma_q, args.tma_do, args.tma_k, args.tma_v);
    if constexpr (Traits::kLowParts) {
      prefetch_tma_descriptors(args.tma_lo.tma_q, args.tma_lo.tma_do, args.tma_lo.tma_k, args.tma_lo.tma_v);
    }
    for (int buffer = 0; buffer < Traits::kKvBuffers; ++buffer) {
      cutlass::arch::ClusterTransactionBarrier::init(&smem.kv_full[buffer], 1);
      cutlass::arch::ClusterBarrier::init(&smem.kv_empty[buffer], Traits::kConsumerThreads);
    }
    if constexpr (kFusedDq) {
      cutlass::arch::ClusterBarrier::init(&smem.dq_full, Traits::kDqStagers);
      cutlass::arch::ClusterBarrier::init(&smem.dq_empty, 1);
    }
  }
  using Pipeline = typename Traits::Pipeline;
  const auto params = tma_pipeline_params<Pipeline>(Traits::kConsumerThreads, 2 * Traits::kQBytes);
  Pipeline pipeline_qdo(smem.pipeline_qdo, params, Shape<_1, _1, _1>{});
  using StatsPipeline = typename Traits::StatsPipeline;
  typename StatsPipeline::Params stats_params;
  stats_params.role = warp == 1          ? StatsPipeline::ThreadCategory::Producer
                      : warp_group > 0   ? StatsPipeline::ThreadCategory::Consumer
                                         : StatsPipeline::ThreadCategory::NonParticipant;
  stats_params.producer_arv_count = 32;
  stats_params.consumer_arv_count = Traits::kConsumerThreads;
  StatsPipeline pipeline_stats(smem.pipeline_stats, stats_params);
  __syncthreads();  // barrier initialisation visible to every thread before any use

  // The CTA's key blocks, each role walking them in the same order, pass by pass as the persistent forward
  // (persistent_pass.h pass_tile: mirrored on odd passes, so that a CTA that drew a long causal block draws a short
  // one next; a plain stride would hand the same CTAs the longest blocks pass after pass whenever the blocks per
  // slice divide the grid). On the persistent grid an empty block gets dK = dV = 0 from the consumers and takes no
  // K/V buffer (`fill` counts the others). Elsewhere the loops below run once (the bounds make that visible to the
  // compiler), for the block located above.
  const int64_t ctas = kPersistent ? int64_t(gridDim.x) : 1;
  const int64_t blocks = kPersistent ? args.key_blocks : int64_t(blockIdx.x) + 1;
  auto block_of_pass = [&](int64_t pass) -> int64_t {
    return kPersistent ? pass_tile(uint32_t(pass), blockIdx.x, gridDim.x, uint32_t(blocks)) : int64_t(blockIdx.x);
  };
  auto key_block = [&](int64_t linear, bool* empty) -> KeyBlock {
    if constexpr (!kPersistent) {
      *empty = false;
      return single;
    } else {
      const KeyBlock kb = locate_key_block<Traits>(p, args.band_slices, linear);
      *empty = next_item<Traits, kForm>(kb, item_mask_blocks<Traits, kForm>(p, kb), 0) >= kb.items;
      return kb;
    }
  };
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x == 0) {
      typename Traits::PipelineState write = cutlass::make_producer_start_state<Pipeline>();
      int fill = 0;
      for (int64_t pass = 0; pass * ctas + blockIdx.x < blocks; ++pass) {
        bool empty;
        const KeyBlock kb = key_block(block_of_pass(pass), &empty);
        if (empty) continue;
        produce_dkdv_tiles<Traits, kForm>(args, kb, smem, pipeline_qdo, write, kv_buffer_of<Traits>(fill++));
      }
    } else if (warp == 1) {
      typename Traits::PipelineState write = cutlass::make_producer_start_state<StatsPipeline>();
      for (int64_t pass = 0; pass * ctas + blockIdx.x < blocks; ++pass) {
        bool empty;
        const KeyBlock kb = key_block(block_of_pass(pass), &empty);
        if (!empty) produce_row_stats<Traits, kForm>(p, kb, smem, pipeline_stats, write);
      }
    } else if constexpr (kFusedDq) {
      if (warp == 2) {
        int visit = 0;
        for (int64_t pass = 0; pass * ctas + blockIdx.x < blocks; ++pass) {
          bool empty;
          const KeyBlock kb = key_block(block_of_pass(pass), &empty);
          if (!empty) write_dq_tiles<Traits, kForm>(p, kb, smem, visit);
        }
        // The reductions land before the CTA (and its shared memory) goes away.
        if (threadIdx.x % 32 == 0) bulk_wait_all();
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    typename Traits::PipelineState read;
    int visit = 0, fill = 0;
    for (int64_t pass = 0; pass * ctas + blockIdx.x < blocks; ++pass) {
      bool empty;
      const KeyBlock kb = key_block(block_of_pass(pass), &empty);
      if (empty) {
        using NoStage = decltype(make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{}));
        const int thread = threadIdx.x - 128;
        store_key_rows<Traits, NoStage>(p, kb, p.dk, nullptr, 0, Traits::kBlockN, thread, Traits::kConsumerThreads);
        store_key_rows<Traits, NoStage>(p, kb, p.dv, nullptr, 0, Traits::kBlockN, thread, Traits::kConsumerThreads);
        continue;
      }
      if constexpr (Traits::kSplitHeadDim) {
        consume_query_tiles_split_head_dim<Traits>(p, kb, smem, pipeline_qdo, pipeline_stats, warp_group - 1);
      } else if constexpr (Traits::kTf32) {
        consume_query_tiles_tf32<Traits>(p, kb, smem, pipeline_qdo, pipeline_stats, warp_group - 1);
      } else {
        consume_query_tiles<Traits, kForm, kFusedDq>(p, kb, smem, pipeline_qdo, pipeline_stats, warp_group - 1, read,
                                                     visit, kv_buffer_of<Traits>(fill++));
      }
    }
  }
}

}  // namespace jax_flash::cuda::sm90
