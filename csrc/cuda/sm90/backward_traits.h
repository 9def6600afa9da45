// Every compile-time choice of the Hopper (sm_90a) backward, from one tile table keyed by head dim. Both kernels
// are a producer warpgroup (TMA) plus consumer warpgroups of 64 rows each along the M of every GEMM:
//   dK/dV kernel: M = keys (resident), streams (Q, dO) tiles of block_m query rows;
//   dQ kernel:    M = query rows (resident), streams (K, V) tiles of block_n keys.
// Two kernel forms share these traits (backward_form.h): common, and transforms (softcap/ALiBi); bias, mask and
// dropout calls run the sm80 backward.
#pragma once

#include "backward_form.h"
#include "kernel_traits.h"

namespace jax_flash::cuda::sm90 {

struct BackwardTile {
  int block_m;  // dK/dV: query rows per pipeline stage; dQ: query rows per CTA (64 per consumer warpgroup)
  int block_n;  // dK/dV: keys per CTA (64 per consumer warpgroup); dQ: keys per pipeline stage
  int stages;   // streamed tile buffers
};

// Registers per consumer thread (240 after setmaxnreg), floats: dK/dV kernel S^T and dP^T block_m / 2 each,
// dK and dV head_dim / 2 each; dQ kernel S and dP block_n / 2 each, dQ head_dim / 2.
// smem bytes: dK/dV 2 * block_n * d * 2 + stages * 2 * block_m * d * 2 + 2 * block_m * block_n * 2 (dS);
//             dQ    2 * block_m * d * 2 + stages * 2 * block_n * d * 2.
constexpr BackwardTile dkdv_tile(int head_dim) {
  // d=64 with 128-row query tiles (64 + 64 + 32 + 32 floats) spilled; 64 rows and a third stage instead.
  // Fused dQ adds head_dim / 4 floats (the dQ slice) while S^T and dP^T are already converted.
  return head_dim <= 64 ? BackwardTile{64, 128, 3}     // d=64:  32 + 48 + 32 KiB; 32 + 32 + 32 + 32 floats
                        : BackwardTile{64, 128, 2};    // d=128: 64 + 64 + 32 KiB; 32 + 32 + 64 + 64 floats
}
constexpr BackwardTile dq_tile(int head_dim) {
  return head_dim <= 64 ? BackwardTile{128, 128, 2}    // d=64:  32 + 64 KiB; 64 + 64 + 32 floats
                        : BackwardTile{128, 64, 2};    // d=128: 64 + 64 KiB; 32 + 32 + 64 floats
}

// setmaxnreg moves registers only within what the CTA was launched with (65536 / threads, rounded down to a
// multiple of 8, per thread): the consumers' increase must be covered by the producer's decrease.
constexpr bool registers_fit(int threads, int consumer_threads, int producer_registers, int consumer_registers) {
  const int launched = (65536 / threads) / 8 * 8;
  return (launched - producer_registers) * 128 >= (consumer_registers - launched) * consumer_threads;
}

constexpr bool has_sm90_backward_tile(int head_dim) { return head_dim == 64 || head_dim == 128; }

// (seqlen, head_dim, heads, batch) global tensors as the TMA descriptors see them (forward's convention).
template <class Element>
struct BshdGmem {
  using Shape_ = Shape<int32_t, int32_t, int32_t, int32_t>;
  using Stride_ = Stride<int64_t, _1, int64_t, int64_t>;
  using Tensor_ = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), Shape_{}, Stride_{}));
};

// The same bytes as an [cols, rows, stages] MN-major operand: the transposed B of dV += P^T dO, dK += dS^T Q and
// dQ += dS K.
template <class SmemLayout>
constexpr auto transposed_stages(SmemLayout layout) {
  constexpr int kRows = size<0>(SmemLayout{});
  constexpr int kCols = size<1>(SmemLayout{});
  constexpr int kStages = size<2>(SmemLayout{});
  return composition(layout, make_ordered_layout(Shape<Int<kCols>, Int<kRows>, Int<kStages>>{}, Step<_2, _1, _3>{}));
}

template <int kHeadDim_, class Element_>
struct DkdvTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BackwardTile kTile = dkdv_tile(kHeadDim);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kConsumerGroups = kBlockN / 64;
  static constexpr int kConsumerThreads = kConsumerGroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  // The producer keeps 32 registers, not the forward's 24: its second warp copies row statistics and spilled at 24.
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = kConsumerGroups == 2 ? 232 : 160;
  static_assert(kBlockN % 64 == 0 && kBlockM % 64 == 0 && kHeadDim % 16 == 0);
  static_assert(registers_fit(kThreads, kConsumerThreads, kProducerRegisters, kConsumerRegisters));

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

  // Fused dQ (backward_dkdv_kernel.h, when the call gives a dq_accum workspace): dQ = dS K per query tile,
  // consumer g computing head-dim columns [g * kDqCols, (g + 1) * kDqCols) over all kBlockN keys. dS (both
  // consumers' keys) goes through shared memory, double-buffered by item parity.
  static constexpr int kDqCols = kHeadDim / kConsumerGroups;
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
  // The dQ tile staged for the bulk reductions (dq_staging.h): rows of head_dim floats, padded by 8 (32 bytes) so the
  // consumers' fragment stores meet no bank conflicts and every row starts 16-byte aligned.
  static constexpr int kDqRowFloats = kHeadDim + 8;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;   // Q and dO tiles, one barrier per stage for both
  using StatsPipeline = cutlass::PipelineAsync<kStages>;  // lse / softmax_d of the same tiles, filled by a warp
  using PipelineState = typename Pipeline::PipelineState;
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> d_o;
    cute::array_aligned<Element, cosize_v<SmemLayoutDs>, 1024> ds;  // fused dQ only
    alignas(128) float dq[kBlockM * kDqRowFloats];                  // fused dQ only
    float lse_log2[kStages][kBlockM];   // +inf for rows without a visible key (and rows past seqlen_q)
    float softmax_d[kStages][kBlockM];  // 0 past seqlen_q
    typename Pipeline::SharedStorage pipeline_qdo;
    typename StatsPipeline::SharedStorage pipeline_stats;
    alignas(8) uint64_t kv_full;  // transaction barrier of the one K and V load
    alignas(8) uint64_t dq_full;   // fused dQ: every consumer thread staged its part of an item's dQ tile
    alignas(8) uint64_t dq_empty;  // fused dQ: the writer warp's bulk reductions have read the staged tile
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024);

  using GmemTensor = typename BshdGmem<Element>::Tensor_;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKV{},
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
};

template <int kHeadDim_, class Element_>
struct DqTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BackwardTile kTile = dq_tile(kHeadDim);
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
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> d_o;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    typename Pipeline::SharedStorage pipeline_kv;
    alignas(8) uint64_t q_full;  // transaction barrier of the one Q and dO load
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024);

  using GmemTensor = typename BshdGmem<Element>::Tensor_;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutKV{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
};

// Kernel arguments: the plain parameters plus the TMA descriptors (built on the host per call).
template <class Traits>
struct BackwardArgs {
  AttentionBackwardParams p;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
};

}  // namespace jax_flash::cuda::sm90
