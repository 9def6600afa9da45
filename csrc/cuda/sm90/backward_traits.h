// Every compile-time choice of the Hopper (sm_90a) backward, from one tile table keyed by head dim. Both kernels
// are a producer warpgroup (TMA) plus consumer warpgroups of 64 rows each along the M of every GEMM:
//   dK/dV kernel: M = keys (resident), streams (Q, dO) tiles of block_m query rows;
//   dQ kernel:    M = query rows (resident), streams (K, V) tiles of block_n keys.
// Except at d=256 (DkdvSplitTraits): there dK and dV of 64 keys would be 256 floats per thread, so the dK/dV
// kernel's two consumer warpgroups share 64 keys and split the head dim instead.
// Three kernel forms share these traits (backward_form.h): common, transforms (softcap/ALiBi) and masked (boolean
// mask), the last two not at d=256; bias, dbias and dropout calls run the sm80 backward.
#pragma once

#include <type_traits>

#include "../../common/dq_workspace.h"
#include "backward_form.h"
#include "kernel_traits.h"

namespace jax_flash::cuda::sm90 {

struct BackwardTile {
  int block_m;  // dK/dV: query rows per pipeline stage; dQ: query rows per CTA (64 per consumer warpgroup)
  int block_n;  // dK/dV: keys per CTA (64 per consumer warpgroup); dQ: keys per pipeline stage
  int stages;   // streamed tile buffers
  // dK/dV only: the two consumer warpgroups share the CTA's 64 keys and each owns half of the head dim's columns
  // of dK and dV (DkdvSplitTraits); no fused dQ.
  bool split_head_dim = false;
};

// Registers per consumer thread (232/240 after setmaxnreg), floats: dK/dV kernel S^T and dP^T block_m / 2 each,
// dK and dV head_dim / 2 each; dQ kernel S and dP block_n / 2 each, dQ head_dim / 2.
// smem bytes: dK/dV 2 * block_n * d * 2 + stages * 2 * block_m * d * 2 + 2 * block_m * block_n * 2 (dS);
//             dQ    2 * block_m * d * 2 + stages * 2 * block_n * d * 2.
// Split head dim (d=256): S^T and dP^T block_m / 4 floats each (each warpgroup computes half of the queries),
// dK and dV head_dim / 4 each; smem 2 * block_n * d * 2 + stages * 2 * block_m * d * 2 + 2 buffers of P^T and
// dS^T (2 * 2 * block_m * block_n * 2).
// The fused dQ does not fit at d=256: it would add a 64 x 264 float dQ staging tile (66 KiB) to K and V (64 KiB),
// one Q/dO stage (64 KiB) and P^T/dS^T (16 KiB): 210 KiB with a single stage, i.e. no load overlap at all.
constexpr BackwardTile dkdv_tile(int head_dim) {
  // d=64 with 128-row query tiles (64 + 64 + 32 + 32 floats) spilled; 64 rows and a third stage instead.
  // Fused dQ adds head_dim / 4 floats (the dQ slice; at d=64, where one consumer computes an item's whole dQ,
  // head_dim / 2 on its turn) while S^T and dP^T are already converted.
  switch (head_dim) {
    case 64: return {64, 128, 3};         // 32 + 48 + 32 KiB; 32 + 32 + 32 + 32 floats
    case 96: return {64, 128, 2};         // 48 + 48 + 32 KiB; 32 + 32 + 48 + 48 floats
    case 128: return {64, 128, 2};        // 64 + 64 + 32 KiB; 32 + 32 + 64 + 64 floats
    case 192: return {64, 64, 2, true};   // 48 + 96 + 32 = 176 KiB; 16 + 16 + 48 + 48 floats
    default: return {64, 64, 2, true};    // 256: 64 + 128 + 32 = 224 KiB; 16 + 16 + 64 + 64 floats
  }
}
constexpr BackwardTile dq_tile(int head_dim) {
  switch (head_dim) {
    case 64: return {128, 128, 2};   // 32 + 64 KiB; 64 + 64 + 32 floats
    case 96: return {128, 128, 2};   // 48 + 96 KiB; 64 + 64 + 48 floats
    case 128: return {128, 64, 2};   // 64 + 64 KiB; 32 + 32 + 64 floats
    case 192: return {128, 64, 2};   // 96 + 96 KiB; 32 + 32 + 96 floats
    // 256: Q and dO alone are 128 KiB, so key tiles of 32 (three stages of K and V: 96 KiB, 225 KiB in all);
    // 16 + 16 + 128 floats.
    default: return {128, 32, 3};
  }
}

// The float16-parts kernels (float32_precision="highest" of float32 calls on scaled float16 hi and lo parts,
// float16_parts_backward_launch.h): every shared operand twice, so at d=128 the dK/dV pass takes the split-head-dim
// form (two consumers share 64 keys, each owns 64 of dK's and dV's columns and a float32 partial of each,
// split_tf32_mma.h gemm_target) over 32-query stages: K, V hi + lo 64 KiB, three Q / dO stages hi + lo 96 KiB, P^T
// and dS^T hi + lo, two buffers, 32 KiB (192 KiB); S^T, dP^T 8 floats each, dK, dV 32 and their partials 32 each.
// The dQ pass: 128 query rows, Q and dO hi + lo 128 KiB, two 32-key K / V stages hi + lo 64 KiB (192 KiB); S, dP 16
// floats each, dQ 64 and its partial 64, dS hi and lo as register operands 8 + 8.
constexpr BackwardTile float16_parts_dkdv_tile(int head_dim) {
  (void)head_dim;  // 128 only (DkdvSplitTraits' static_asserts)
  return {32, 64, 3, true};
}
constexpr BackwardTile float16_parts_dq_tile(int head_dim) {
  (void)head_dim;
  return {128, 32, 2};
}

// The same bytes as an [cols, rows, stages] MN-major operand: the transposed B of dV += P^T dO, dK += dS^T Q and
// dQ += dS K.
template <class SmemLayout>
constexpr auto transposed_stages(SmemLayout layout) {
  constexpr int kRows = size<0>(SmemLayout{});
  constexpr int kCols = size<1>(SmemLayout{});
  constexpr int kStages = size<2>(SmemLayout{});
  return composition(layout, make_ordered_layout(Shape<Int<kCols>, Int<kRows>, Int<kStages>>{}, Step<_2, _1, _3>{}));
}

// OutElement: dK's, dV's and the fused dQ's type, Element's or float32 (of float16 operands: AttentionBackwardParams::
// float32_gradients, backward_dispatch.h launch_backward).
template <int kHeadDim_, class Element_, class OutElement_ = Element_>
struct DkdvTraits {
  using Element = Element_;
  using OutElement = OutElement_;
  static_assert(std::is_same_v<OutElement, Element> || std::is_same_v<OutElement, float>);
  static constexpr bool kTf32 = false;
  static constexpr bool kLowParts = false;  // operands as hi and lo parts (split TF32, float16 parts)
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BackwardTile kTile = dkdv_tile(kHeadDim);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr bool kSplitHeadDim = false;  // consumer warpgroups stacked along keys
  static_assert(!kTile.split_head_dim, "use DkdvSplitTraits");
  static constexpr int kConsumerGroups = kBlockN / 64;
  static constexpr int kConsumerThreads = kConsumerGroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kConsumerRegisters = kConsumerGroups == 2 ? 232 : 160;
  static_assert(kBlockN % 64 == 0 && kBlockM % 64 == 0 && kHeadDim % 16 == 0);

  using GroupLayout = Layout<Shape<Int<kConsumerGroups>, _1, _1>>;  // consumer warpgroups stacked along keys
  // S^T = K Q^T and dP^T = V dO^T: both operands K-major in smem. Transposed so that P^T and dS^T come out of the
  // accumulators already as the register A operand (M = keys, K = queries) of dV += P^T dO and dK += dS^T Q.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
      GroupLayout{}));
  using TiledMmaDkv = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      GroupLayout{}));

  // Fused dQ (backward_dkdv_kernel.h, when the call gives a dq_accum workspace): dQ = dS K per query tile over all
  // kBlockN keys, dS (both consumers' keys) through shared memory, double-buffered by item parity. Either consumer g
  // computes head-dim columns [g * kDqCols, (g + 1) * kDqCols) of every item, or (kDqAlternating) one consumer
  // computes all columns of an item, consumer (item visit % 2) in turn. The latter at d=64: split, each consumer's
  // WGMMA is 64 x 32 with both operands from shared memory, 3 KiB of operand reads per 16 tensor-core cycles, more
  // than the SM's 128 bytes per cycle; whole, 64 x 64 reads 4 KiB per 32 cycles. On the H200 the d=64 backward ran
  // 2-4% faster so (every cell of 512-16k, causal and not; benchmarks/NOTES.md, 24th session). d=128 keeps the
  // split (64 x 64 each already; whole, the dQ accumulator would add 32 floats to a consumer that has none spare).
  // Not a gain, measured the same way: K and V as register A operands of S^T and dP^T (then those two GEMMs read
  // only Q and dO from shared memory): -1% to +1%.
  static constexpr bool kDqAlternating = kHeadDim == 64 && kConsumerGroups == 2;
  static constexpr int kDqCols = kDqAlternating ? kHeadDim : kHeadDim / kConsumerGroups;
  static constexpr int kDqSlices = kHeadDim / kDqCols;  // consumers whose column slices make up one item's dQ
  static constexpr int kDqStagers = kDqSlices * 128;  // consumer threads that stage each item's dQ
  using TiledMmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kDqCols>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>()));

  // K's swizzle atom is at most kDqCols wide, so that a consumer's column slice of K^T is whole atoms (one
  // descriptor per slice); at d=128 that is the widest atom anyway.
  using SmemLayoutKV = decltype(tile_to_shape(k_major_smem_atom<Element, kDqCols>(),
                                              Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // also stages dK, dV
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));  // (d, key)
  using SmemLayoutQ = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // also dO
  using SmemLayoutQt = decltype(transposed_stages(SmemLayoutQ{}));
  // dS as the MN-major A operand of dQ = dS K: (query, key, buffer), queries contiguous, which is also the
  // order in which the S^T accumulators hold adjacent elements (two queries of one key).
  using SmemLayoutDs = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  using SmemLayoutDsT = decltype(transposed_stages(SmemLayoutDs{}));  // (key, query, buffer)
  // The dQ tile staged for its one bulk reduction, in fragment order (dq_staging.h): kBlockM x kHeadDim floats, no
  // padding; its rows are the workspace's tile rows.
  static constexpr int kDqGroupsPerConsumer = kDqCols / 8;
  static_assert(kBlockM == kDqWorkspaceTileRows && kDqCols % 8 == 0);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;   // Q and dO tiles, one barrier per stage for both
  using StatsPipeline = cutlass::PipelineAsync<kStages>;  // lse / softmax_d of the same tiles, filled by a warp
  using PipelineState = typename Pipeline::PipelineState;
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  // K and V buffers (kKvBuffers of each): two where shared memory allows (d=64, d=96), so that a CTA of the
  // persistent grid loads its next key block's K and V while it still works on the current one, whose buffers then
  // stage its dK and dV; one at d=128, which runs one key block per CTA (backward_dkdv_kernel.h
  // dkdv_runs_persistent).
  template <int kBuffers>
  struct Storage {
    cute::array_aligned<Element, kBuffers * cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, kBuffers * cosize_v<SmemLayoutKV>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> d_o;
    cute::array_aligned<Element, cosize_v<SmemLayoutDs>, 1024> ds;  // fused dQ only
    alignas(128) float dq[kBlockM * kHeadDim];                      // fused dQ only
    float lse_log2[kStages][kBlockM];   // +inf for rows without a visible key (and rows past seqlen_q)
    float softmax_d[kStages][kBlockM];  // 0 past seqlen_q
    // Masked form: the item whose row stats the stage holds, its mask tile's origin element where the item reads
    // mask elements, else null (backward_dkdv_kernel.h).
    int stage_item[kStages];
    const bool* stage_mask_tile[kStages];
    typename Pipeline::SharedStorage pipeline_qdo;
    typename StatsPipeline::SharedStorage pipeline_stats;
    alignas(8) uint64_t kv_full[kBuffers];   // transaction barrier of a buffer's K and V load
    alignas(8) uint64_t kv_empty[kBuffers];  // persistent grid: the consumers' epilogue has read the buffer
    alignas(8) uint64_t dq_full;   // fused dQ: the item's kDqStagers threads staged their parts of its dQ tile
    alignas(8) uint64_t dq_empty;  // fused dQ: the writer's bulk reduction has read the staged tile
  };
  static constexpr int kKvBuffers = sizeof(Storage<2>) <= 227 * 1024 ? 2 : 1;
  using SharedStorage = Storage<kKvBuffers>;
  // The producer keeps 32 registers, not the forward's 24: its second warp copies row statistics and spilled at 24;
  // 40 where the kernel may run persistent (two K/V buffers), its threads carrying their pipeline state across key
  // blocks (108 bytes of spills at 32, 40 at 40; compile of d=64).
  static constexpr int kProducerRegisters = kKvBuffers == 2 ? 40 : 32;
  static_assert(registers_fit(kThreads, kConsumerThreads, kProducerRegisters, kConsumerRegisters));
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024);

  using TmaQ = BshdTma<SM90_TMA_LOAD, Element, decltype(take<0, 2>(SmemLayoutQ{})), kBlockM, kHeadDim>;
  using TmaKV = BshdTma<SM90_TMA_LOAD, Element, SmemLayoutKV, kBlockN, kHeadDim>;
};

// Shared memory of the dK/dV kernels whose consumers pass P^T and dS^T through shared memory (the split-head-dim
// and TF32 forms; common form only, so no masked-form fields).
template <class Element, class SmemLayoutKV, class SmemLayoutQ, class SmemLayoutScores, int kStages, int kBlockM>
struct ScoresInSmemStorage {
  cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
  cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
  cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
  cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> d_o;
  cute::array_aligned<Element, cosize_v<SmemLayoutScores>, 1024> probs;        // P^T
  cute::array_aligned<Element, cosize_v<SmemLayoutScores>, 1024> score_grads;  // dS^T
  float lse_log2[kStages][kBlockM];   // +inf for rows without a visible key (and rows past seqlen_q)
  float softmax_d[kStages][kBlockM];  // 0 past seqlen_q
  typename cutlass::PipelineTmaAsync<kStages>::SharedStorage pipeline_qdo;
  typename cutlass::PipelineAsync<kStages>::SharedStorage pipeline_stats;
  alignas(8) uint64_t kv_full[1];   // transaction barrier of the one K and V load
  alignas(8) uint64_t kv_empty[1];  // unused: these kernels run one key block per CTA (backward_dkdv_kernel.h)
};

// Operands in parts (split TF32, float16 parts): the hi parts' storage plus `low`, the lo parts of the same operands
// under the same names (so that split_tf32_mma.h low_parts(smem) is either `low` or, without parts, the storage
// itself).
template <class HiStorage, class LowParts>
struct WithLowParts : HiStorage {
  LowParts low;
};
template <class Element, class SmemLayoutKV, class SmemLayoutQ, class SmemLayoutScoresT>
struct DkdvLowParts {
  cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
  cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
  cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
  cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> d_o;
  cute::array_aligned<Element, cosize_v<SmemLayoutScoresT>, 1024> probs;
  cute::array_aligned<Element, cosize_v<SmemLayoutScoresT>, 1024> score_grads;
};
// The dQ passes' lo parts: Q, dO, K and V (the float16-parts pass keeps dS in registers), and the TF32 pass's dS tile.
template <class Element, class SmemLayoutQ, class SmemLayoutKV>
struct DqOperandLowParts {
  cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
  cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> d_o;
  cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
  cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
};
template <class Element, class SmemLayoutQ, class SmemLayoutKV, class SmemLayoutDs>
struct DqLowParts : DqOperandLowParts<Element, SmemLayoutQ, SmemLayoutKV> {
  cute::array_aligned<Element, cosize_v<SmemLayoutDs>, 1024> score_grads;
};

// The split-head-dim dK/dV kernel (d=256, backward_dkdv_split_consumer.h): both consumer warpgroups share the CTA's
// kBlockN = 64 keys. Per query tile, warpgroup g computes S^T and dP^T for its half of the block_m queries, forms
// P^T and dS^T, and stores them into shared memory; after a barrier both use the whole tiles as SS operands of
//   dV[:, g-th half] += P^T dO[:, g-th half],   dK[:, g-th half] += dS^T Q[:, g-th half].
// Why split S^T along queries rather than give S^T to one warpgroup and dP^T to the other: each query column needs
// its own lse and D only, so the halves stay independent until the store, and both warpgroups run the same
// GEMMs and exps (balanced); the S^T / dP^T split would have to send P through shared memory before dS exists.
// kLowParts: the float16-parts form (float16_parts_dkdv_tile): each shared operand also as a lo part (`low`), each
// GEMM as three (split_tf32_mma.h issue_wgmma_parts), dK and dV summed item by item in float32 partials.
template <int kHeadDim_, class Element_, class OutElement_ = Element_, bool kLowParts_ = false>
struct DkdvSplitTraits {  // OutElement: as DkdvTraits'
  using Element = Element_;
  using OutElement = OutElement_;
  static_assert(std::is_same_v<OutElement, Element> || std::is_same_v<OutElement, float>);
  static constexpr bool kTf32 = false;
  static constexpr bool kLowParts = kLowParts_;
  static_assert(!kLowParts || (std::is_same_v<Element, cutlass::half_t> && std::is_same_v<OutElement, float> &&
                               kHeadDim_ == 128));
  static constexpr int kOperandParts = kLowParts ? 2 : 1;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BackwardTile kTile = kLowParts ? float16_parts_dkdv_tile(kHeadDim) : dkdv_tile(kHeadDim);
  static_assert(kTile.split_head_dim, "use DkdvTraits");
  static constexpr bool kSplitHeadDim = true;
  static constexpr int kKvBuffers = 1;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kConsumerGroups = 2;
  static constexpr int kConsumerThreads = kConsumerGroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  // As DkdvTraits: 32 for the producer's row-statistics warp, so 232 (not 240) is what the consumers can take.
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = 232;
  static constexpr int kQueryCols = kBlockM / kConsumerGroups;  // S^T / dP^T columns of one warpgroup
  static constexpr int kDkvCols = kHeadDim / kConsumerGroups;   // dK / dV columns of one warpgroup
  // 64 keys: one WGMMA M for both warpgroups. Each warpgroup's share of dO^T / Q^T must be whole swizzle atoms
  // (one descriptor per share), so Q, dO, and K and V (which stage each share of dK and dV), take the widest atom
  // that divides kDkvCols: 64 columns at d=256, 32 at d=192 (shares of 96).
  static_assert(kBlockN == 64 && kQueryCols % 16 == 0 && kDkvCols % 32 == 0);
  static_assert(registers_fit(kThreads, kConsumerThreads, kProducerRegisters, kConsumerRegisters));

  // One warpgroup per MMA: each picks its own shared-memory slices (its queries, its head-dim columns).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kQueryCols>, Int<kHeadDim>>>()));
  using TiledMmaDkv = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kDkvCols>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>()));

  using SmemLayoutKV = decltype(tile_to_shape(k_major_smem_atom<Element, kDkvCols>(),
                                              Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // also stages dK, dV
  using SmemLayoutQ = decltype(tile_to_shape(k_major_smem_atom<Element, kDkvCols>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // also dO
  using SmemLayoutQt = decltype(transposed_stages(SmemLayoutQ{}));
  // P^T and dS^T as (key, query, buffer): queries contiguous, i.e. the K-major A operand of the dK/dV GEMMs and the
  // order in which the accumulators hold adjacent elements. Double-buffered by item parity: a warpgroup that
  // writes item i's P^T (dS^T) has passed item i - 1's P^T (dS^T) barrier, which the other warpgroup reached only
  // after retiring item i - 2's GEMMs (the readers of this buffer); so no barrier is needed before the stores.
  using SmemLayoutPdS = decltype(tile_to_shape(k_major_smem_atom<Element, kBlockM>(),
                                               Shape<Int<kBlockN>, Int<kBlockM>, _2>{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;   // Q and dO tiles, one barrier per stage for both
  using StatsPipeline = cutlass::PipelineAsync<kStages>;  // lse / softmax_d of the same tiles, filled by a warp
  using PipelineState = typename Pipeline::PipelineState;
  // Bytes of one load of a Q (dO) tile and of K (V): with kLowParts both parts, on one barrier.
  static constexpr uint32_t kQBytes = kOperandParts * kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kOperandParts * kBlockN * kHeadDim * sizeof(Element);

  using HiStorage = ScoresInSmemStorage<Element, SmemLayoutKV, SmemLayoutQ, SmemLayoutPdS, kStages, kBlockM>;
  // Float16 parts: the lo parts, and each consumer's exponents of its dS^T rows' maxima (row_scaled_parts.h: a
  // key's row spans both consumers' queries, so they agree on its scale).
  struct LowParts : DkdvLowParts<Element, SmemLayoutKV, SmemLayoutQ, SmemLayoutPdS> {
    int score_grad_exponents[kConsumerGroups][kBlockN];
  };
  using SharedStorage = std::conditional_t<kLowParts, WithLowParts<HiStorage, LowParts>, HiStorage>;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024);

  using TmaQ = BshdTma<SM90_TMA_LOAD, Element, decltype(take<0, 2>(SmemLayoutQ{})), kBlockM, kHeadDim>;
  using TmaKV = BshdTma<SM90_TMA_LOAD, Element, SmemLayoutKV, kBlockN, kHeadDim>;
};

// The TF32 dK/dV kernel (float32 inputs, backward_dkdv_tf32_consumer.h; an experiment, JAX_FLASH_CUDA_KERNEL_F32_
// BACKWARD): WGMMA takes 32-bit operands from shared memory only K-major, so the bf16 kernel's dV += P^T dO and
// dK += dS^T Q (B = dO, Q: MN-major) cannot run as they are. Instead each consumer warpgroup (64 keys, as there)
// computes S^T and dP^T as before, stores P^T and dS^T into its half of two [keys, queries] tiles (queries
// contiguous: K-major B operands), and accumulates the transposes
//     dV^T += dO^T P,   dK^T += Q^T dS      (M = head dim, N = its 64 keys, K = queries)
// with the A operands dO^T and Q^T loaded into registers from the ordinary Q / dO stages (a register operand has
// no major-ness). Shared memory at d=128: K, V 128 KiB, two 32-query Q/dO stages 64 KiB, P^T and dS^T 32 KiB.
// Registers per consumer thread: S^T, dP^T block_m / 2 each, dV^T and dK^T head_dim / 2 each, plus one A operand
// (head_dim x block_m / 128) at a time.
// Split TF32 (float32_precision="highest", split_tf32_backward_launch.h): every operand carried as hi and lo
// parts (split_tf32_mma.h), so K, V, each Q / dO stage, P^T and dS^T take twice the shared memory, and each GEMM three
// WGMMAs. One consumer warpgroup of 64 keys over narrower query stages: d=64 K, V 64 KiB, three 32-query Q/dO stages
// 96 KiB, P^T and dS^T 32 KiB (192 KiB); d=128 K, V 128 KiB, two 16-query stages 64 KiB, P^T and dS^T 16 KiB
// (208 KiB). Registers as above plus the A operand's lo part (head_dim x block_m / 128 floats).
constexpr BackwardTile tf32_dkdv_tile(int head_dim, bool split) {
  if (split) return head_dim <= 64 ? BackwardTile{32, 64, 3} : BackwardTile{16, 64, 2};
  return head_dim <= 64 ? BackwardTile{64, 128, 2}    // 64 + 64 + 64 KiB; 32 + 32 + 32 + 32 (+ 32) floats
                        : BackwardTile{32, 128, 2};   // 128 + 64 + 32 KiB; 16 + 16 + 64 + 64 (+ 32) floats
}

template <int kHeadDim_, bool kSplitTf32_ = false>
struct Tf32DkdvTraits {
  using Element = cutlass::tfloat32_t;  // float32 bits; the tensor cores read the TF32 part
  using OutElement = float;
  static constexpr bool kTf32 = true;
  static constexpr bool kSplitTf32 = kSplitTf32_;
  static constexpr bool kLowParts = kSplitTf32;
  static constexpr int kOperandParts = kSplitTf32 ? 2 : 1;
  static constexpr bool kSplitHeadDim = false;
  static constexpr int kKvBuffers = 1;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BackwardTile kTile = tf32_dkdv_tile(kHeadDim, kSplitTf32);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kConsumerGroups = kBlockN / 64;
  static constexpr int kConsumerThreads = kConsumerGroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  // Split TF32: its producer's lo-part loads spilled at 32 (36 bytes with the consumer's, d=64), none at 40; its one
  // consumer warpgroup spilled 44 bytes at 240.
  static constexpr int kProducerRegisters = kSplitTf32 ? 40 : 32;
  static constexpr int kConsumerRegisters = kConsumerGroups == 1 ? 256 : 232;
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 128 && (kBlockN == 128 || (kSplitTf32 && kBlockN == 64)));
  static_assert(registers_fit(kThreads, kConsumerThreads, kProducerRegisters, kConsumerRegisters));

  using GroupLayout = Layout<Shape<Int<kConsumerGroups>, _1, _1>>;  // consumer warpgroups stacked along keys
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
      GroupLayout{}));
  // One warpgroup's dV^T / dK^T: A (head dim x queries) from registers, B its keys' P / dS (keys x queries) K-major.
  using TiledMmaDkvT = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kHeadDim>, _64, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::K>()));

  using SmemLayoutKV = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                              Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // also stages dK, dV
  using SmemLayoutKVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));  // (d, key)
  using SmemLayoutQ = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // also dO
  using SmemLayoutQt = decltype(transposed_stages(SmemLayoutQ{}));  // (d, query, stage): the A operands' source
  // P^T and dS^T as (key, query), queries contiguous: the K-major B operands of dV^T and dK^T.
  using SmemLayoutScoresT = decltype(tile_to_shape(k_major_smem_atom<Element, kBlockM>(),
                                                   Shape<Int<kBlockN>, Int<kBlockM>>{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using StatsPipeline = cutlass::PipelineAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // Bytes of one load of a Q (dO) tile and of K (V): with split TF32 both parts, on one barrier.
  static constexpr uint32_t kQBytes = kOperandParts * kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kOperandParts * kBlockN * kHeadDim * sizeof(Element);

  using HiStorage = ScoresInSmemStorage<Element, SmemLayoutKV, SmemLayoutQ, SmemLayoutScoresT, kStages, kBlockM>;
  using SharedStorage = std::conditional_t<
      kSplitTf32, WithLowParts<HiStorage, DkdvLowParts<Element, SmemLayoutKV, SmemLayoutQ, SmemLayoutScoresT>>,
      HiStorage>;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024);

  using TmaQ = BshdTma<SM90_TMA_LOAD, Element, decltype(take<0, 2>(SmemLayoutQ{})), kBlockM, kHeadDim>;
  using TmaKV = BshdTma<SM90_TMA_LOAD, Element, SmemLayoutKV, kBlockN, kHeadDim>;
};

// The dK/dV traits of a head dim: the tile table's split_head_dim picks the kernel form.
template <int kHeadDim, class Element, class OutElement = Element>
using DkdvTraitsFor = std::conditional_t<dkdv_tile(kHeadDim).split_head_dim,
                                         DkdvSplitTraits<kHeadDim, Element, OutElement>,
                                         DkdvTraits<kHeadDim, Element, OutElement>>;

// OutElement (dQ's): as DkdvTraits'. kLowParts: the float16-parts form (float16_parts_dq_tile), as DkdvSplitTraits'.
template <int kHeadDim_, class Element_, class OutElement_ = Element_, bool kLowParts_ = false>
struct DqTraits {
  using Element = Element_;
  using OutElement = OutElement_;
  static_assert(std::is_same_v<OutElement, Element> || std::is_same_v<OutElement, float>);
  static constexpr bool kTf32 = false;
  static constexpr bool kLowParts = kLowParts_;
  static_assert(!kLowParts || (std::is_same_v<Element, cutlass::half_t> && std::is_same_v<OutElement, float>));
  static constexpr int kOperandParts = kLowParts ? 2 : 1;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BackwardTile kTile = kLowParts ? float16_parts_dq_tile(kHeadDim) : dq_tile(kHeadDim);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kConsumerGroups = kBlockM / 64;
  static constexpr int kConsumerThreads = kConsumerGroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = kConsumerGroups == 2 ? 240 : 160;
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0);
  static_assert(registers_fit(kThreads, kConsumerThreads, kProducerRegisters, kConsumerRegisters));

  using GroupLayout = Layout<Shape<Int<kConsumerGroups>, _1, _1>>;  // consumer warpgroups stacked along rows
  // S = Q K^T and dP = dO V^T from smem; dQ += dS K with dS from registers and K^T (MN-major) from smem.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>>(),
      GroupLayout{}));
  using TiledMmaDq = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      GroupLayout{}));

  using SmemLayoutQ = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // also dO; stages dQ
  using SmemLayoutKV = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                              Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutKt = decltype(transposed_stages(SmemLayoutKV{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;  // K and V tiles, one barrier per stage for both
  using PipelineState = typename Pipeline::PipelineState;
  // Bytes of one load of Q (dO) and of a K (V) tile: with kLowParts both parts, on one barrier.
  static constexpr uint32_t kQBytes = kOperandParts * kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kOperandParts * kBlockN * kHeadDim * sizeof(Element);

  struct HiStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> d_o;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    typename Pipeline::SharedStorage pipeline_kv;
    alignas(8) uint64_t q_full;  // transaction barrier of the one Q and dO load
  };
  using SharedStorage = std::conditional_t<
      kLowParts, WithLowParts<HiStorage, DqOperandLowParts<Element, SmemLayoutQ, SmemLayoutKV>>, HiStorage>;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024);

  using TmaQ = BshdTma<SM90_TMA_LOAD, Element, SmemLayoutQ, kBlockM, kHeadDim>;
  using TmaKV = BshdTma<SM90_TMA_LOAD, Element, decltype(take<0, 2>(SmemLayoutKV{})), kBlockN, kHeadDim>;
};

// The TF32 dQ pass (float32 inputs, backward_dq_tf32_consumer.h; JAX_FLASH_CUDA_KERNEL_F32_BACKWARD with the TF32
// dK/dV pass): dQ += dS K would take K as an MN-major B operand, so, as in Tf32DkdvTraits, each consumer warpgroup
// (64 query rows) stores its dS into a [queries, keys] tile (keys contiguous) and accumulates the transpose
//     dQ^T += K^T dS^T      (M = head dim, N = its 64 queries, K = the tile's keys)
// with A = K^T loaded transposed from the K stage into registers. Q and dO stay resident; K and V stream.
// Shared memory at d=128: Q, dO 128 KiB, two 32-key K/V stages 64 KiB, dS 16 KiB.
// Split TF32: d=64 Q, dO hi and lo 128 KiB, two 32-key K/V stages 64 KiB, dS 32 KiB (224 KiB); d=128 one consumer
// warpgroup of 64 rows: Q, dO 128 KiB, two 16-key stages 64 KiB, dS 8 KiB (200 KiB).
constexpr BackwardTile tf32_dq_tile(int head_dim, bool split) {
  if (split) return head_dim <= 64 ? BackwardTile{128, 32, 2} : BackwardTile{64, 16, 2};
  return head_dim <= 64 ? BackwardTile{128, 64, 2}    // 64 + 64 + 32 KiB; S, dP 32 + 32, dQ^T 32, A 32 floats
                        : BackwardTile{128, 32, 2};   // 128 + 64 + 16 KiB; 16 + 16, 64, A 32 floats
}

template <int kHeadDim_, bool kSplitTf32_ = false>
struct Tf32DqTraits {
  using Element = cutlass::tfloat32_t;
  using OutElement = float;
  static constexpr bool kTf32 = true;
  static constexpr bool kSplitTf32 = kSplitTf32_;
  static constexpr bool kLowParts = kSplitTf32;
  static constexpr int kOperandParts = kSplitTf32 ? 2 : 1;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BackwardTile kTile = tf32_dq_tile(kHeadDim, kSplitTf32);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kConsumerGroups = kBlockM / 64;
  static constexpr int kConsumerThreads = kConsumerGroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 128 && (kBlockM == 128 || (kSplitTf32 && kBlockM == 64)));
  static_assert(registers_fit(kThreads, kConsumerThreads, kProducerRegisters, kConsumerRegisters));

  using GroupLayout = Layout<Shape<Int<kConsumerGroups>, _1, _1>>;  // consumer warpgroups stacked along rows
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>>(),
      GroupLayout{}));
  // One warpgroup's dQ^T: A = K^T (head dim x keys) from registers, B = its rows' dS (queries x keys) K-major.
  using TiledMmaDqT = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kHeadDim>, _64, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::K>()));

  using SmemLayoutQ = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // also dO; stages dQ
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, Step<_2, _1>{})));  // (d, query)
  using SmemLayoutKV = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                              Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutKt = decltype(transposed_stages(SmemLayoutKV{}));  // (d, key, stage): the A operand's source
  using SmemLayoutDs = decltype(tile_to_shape(k_major_smem_atom<Element, kBlockN>(),
                                              Shape<Int<kBlockM>, Int<kBlockN>>{}));  // (query, key)

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;  // K and V tiles, one barrier per stage for both
  using PipelineState = typename Pipeline::PipelineState;
  // Bytes of one load of Q (dO) and of a K (V) tile: with split TF32 both parts, on one barrier.
  static constexpr uint32_t kQBytes = kOperandParts * kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kOperandParts * kBlockN * kHeadDim * sizeof(Element);

  struct HiStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> d_o;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutDs>, 1024> score_grads;  // dS
    typename Pipeline::SharedStorage pipeline_kv;
    alignas(8) uint64_t q_full;
  };
  using SharedStorage = std::conditional_t<
      kSplitTf32, WithLowParts<HiStorage, DqLowParts<Element, SmemLayoutQ, SmemLayoutKV, SmemLayoutDs>>, HiStorage>;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024);

  using TmaQ = BshdTma<SM90_TMA_LOAD, Element, SmemLayoutQ, kBlockM, kHeadDim>;
  using TmaKV = BshdTma<SM90_TMA_LOAD, Element, decltype(take<0, 2>(SmemLayoutKV{})), kBlockN, kHeadDim>;
};

template <class Traits>
struct BackwardLowPartTmas {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
};

// Kernel arguments: the plain parameters plus the TMA descriptors (built on the host per call).
template <class Traits>
struct BackwardArgs {
  AttentionBackwardParams p;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  // Operands in parts: the lo parts' descriptors (the four above then read the hi parts), named like those.
  std::conditional_t<Traits::kLowParts, BackwardLowPartTmas<Traits>, NoLowPartTmas> tma_lo;
  // dK/dV kernel: 0 orders the CTAs slice by slice (every key block of one (batch, KV head) slice, then the next);
  // n > 0 cuts the slices into bands of n and orders each band key block first (backward_key_block.h).
  int64_t band_slices = 0;
  // dK/dV kernel: the key blocks of the call (the grid is either one CTA per block or, persistent, about one per SM
  // taking them pass by pass: backward_dkdv_kernel.h dkdv_kernel).
  int64_t key_blocks = 0;
};

}  // namespace jax_flash::cuda::sm90
