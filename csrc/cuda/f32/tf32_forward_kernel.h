// TF32 tensor-core forward (float32 in and out, float32 accumulation): FlashAttention-2's split, 4 warps per CTA
// each owning 16 of its 64 query rows, mma.m16n8k8 TF32 for S = Q Kᵀ and O += P V (P dropped out in the general
// variant; the lse is of the undropped probabilities). Each warp keeps its Q rows as TF32 A fragments in shared
// memory (load_a_fragments); K and V tiles arrive by cp.async and are rounded to TF32 in place once they land
// (round_loaded_tile). The softmax runs in float32 on the accumulators, with exp2. V of a tile loads while S is
// computed, K of the next tile while P V is.
#pragma once

#include <cmath>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../sm80/tensor_offsets.h"
#include "score_element.h"
#include "tf32_mma.h"

namespace jax_flash::cuda::f32 {

template <int kHeadDim>
struct Tf32ForwardGeometry {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kBlockN = 64;
  // Row stride of the K and V tiles in floats: 8 mod 32 words makes both read patterns conflict-free
  // (tf32_mma.h, the key order π).
  static constexpr int kStrideK = kHeadDim + 8;
  static constexpr int kStrideV = kHeadDim + 8;
  static constexpr int kQElems = kBlockM * kHeadDim;  // A fragments, no padding
  static constexpr int kKElems = kBlockN * kStrideK;
  static constexpr int kVElems = kBlockN * kStrideV;
  static constexpr int kBytes = (kQElems + kKElems + kVElems) * int(sizeof(float));
};

template <int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(Tf32ForwardGeometry<kHeadDim>::kThreads)
    tf32_forward_kernel(const AttentionParams p, bool vectorized) {
  using G = Tf32ForwardGeometry<kHeadDim>;
  constexpr int kBlockM = G::kBlockM;
  constexpr int kBlockN = G::kBlockN;
  constexpr int kKSteps = kHeadDim / 8;   // k-steps of S = Q Kᵀ, n-tiles of O
  constexpr int kNTiles = kBlockN / 8;    // n-tiles of S, k-steps of P V
  extern __shared__ __align__(16) float smem[];
  float4* smem_q = reinterpret_cast<float4*>(smem);
  float* smem_k = smem + G::kQElems;
  float* smem_v = smem_k + G::kKElems;

  const int num_m_blocks = static_cast<int>(ceil_div(p.seqlen_q, kBlockM));
  const sm80::BlockCoord cta = sm80::decode_block_coord(num_m_blocks, p.heads_q);
  const int m_block = num_m_blocks - 1 - cta.block;  // longest causal rows first
  const int64_t head_kv = cta.head / (p.heads_q / p.heads_kv);
  const SliceMask mask = make_slice_mask(p, cta.batch, cta.head);
  SliceDropout dropout;
  if constexpr (kGeneral) dropout = SliceDropout::make(p, cta.batch, cta.head);
  const LaneCoord lane = lane_coord();
  const int warp_row = 16 * (int(threadIdx.x) / 32);

  const int64_t m0 = int64_t(m_block) * kBlockM;
  const int rows_in_bounds = static_cast<int>(min(int64_t(kBlockM), p.seqlen_q - m0));
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  const sm80::BshdShape kv_shape = sm80::key_shape(p);
  const int64_t q_offset = q_shape.offset(cta.batch, m0, cta.head);
  const int head_dim = static_cast<int>(p.head_dim);
  const float* k_head = static_cast<const float*>(p.k) + kv_shape.offset(cta.batch, 0, head_kv);
  const float* v_head = static_cast<const float*>(p.v) + kv_shape.offset(cta.batch, 0, head_kv);
  const int64_t kv_ld = kv_shape.row_stride();
  auto keys_of = [&](int n_block) {
    return static_cast<int>(min(int64_t(kBlockN), mask.valid_k - int64_t(n_block) * kBlockN));
  };

  const TileSpan key_tiles = key_tiles_for_rows(mask, m0, kBlockM, kBlockN);
  const int q_valid_rows = static_cast<int>(max(int64_t(0), min(int64_t(kBlockM), mask.valid_q - m0)));
  // The warp's 16 rows (32 float4 per k-step); a thread reads only the fragments it wrote.
  float4* q_frags = smem_q + (warp_row / 16) * 32 * kKSteps;
  if (!key_tiles.empty()) {
    const int n_block = key_tiles.begin;
    load_tile_async<kBlockN, kHeadDim, G::kStrideK, G::kThreads>(
        smem_k, k_head + int64_t(n_block) * kBlockN * kv_ld, kv_ld, keys_of(n_block), head_dim, vectorized);
  }
  cp_async_commit();
  load_a_fragments<kHeadDim>(q_frags, static_cast<const float*>(p.q) + q_offset + warp_row * q_shape.row_stride(),
                             q_shape.row_stride(), q_valid_rows - warp_row, head_dim, vectorized, lane);
  cp_async_wait<0>();
  if (!key_tiles.empty()) round_loaded_tile<kBlockN, kHeadDim, G::kStrideK, G::kThreads>(smem_k, vectorized);
  __syncthreads();

  // Rows warp_row + g (index 0) and warp_row + g + 8 (index 1) of the CTA's tile.
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's columns only; summed over the quad at the end
  float acc[kKSteps][4];
  zero(acc);
  for (int n_block = key_tiles.begin; n_block < key_tiles.end; ++n_block) {
    const int64_t n0 = int64_t(n_block) * kBlockN;
    // K of this tile is in smem. V loads while S is computed.
    load_tile_async<kBlockN, kHeadDim, G::kStrideV, G::kThreads>(smem_v, v_head + n0 * kv_ld, kv_ld,
                                                                  keys_of(n_block), head_dim, vectorized);
    cp_async_commit();

    [[maybe_unused]] uint32_t keep = 0;
    if constexpr (kGeneral) {
      keep = dropout.keep_bits<kNTiles * 4>([&](int e, int64_t* i, int64_t* j) {
        *i = m0 + warp_row + lane.g + 8 * ((e % 4) / 2);
        *j = n0 + 8 * (e / 4) + lane.c_rows[e % 2];
      });
    }
    float s[kNTiles][4];
    zero(s);
    warp_abt<kHeadDim, kNTiles, G::kStrideK>(q_frags, smem_k, lane, s);
    __syncthreads();  // every warp is done with K
    if (n_block + 1 < key_tiles.end) {
      load_tile_async<kBlockN, kHeadDim, G::kStrideK, G::kThreads>(
          smem_k, k_head + (n0 + kBlockN) * kv_ld, kv_ld, keys_of(n_block + 1), head_dim, vectorized);
    }
    cp_async_commit();  // possibly empty, so that "all but the newest group" below is always V

    // Score pipeline and online softmax; element e of tile t is row (e / 2 ? g + 8 : g), key 8 t + π(2 q + e % 2).
    const bool check_mask = tile_needs_mask<kGeneral>(mask, m0, kBlockM, n0, kBlockN);
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int t = 0; t < kNTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t i = m0 + warp_row + lane.g + 8 * (e / 2);
        const int64_t j = n0 + 8 * t + lane.c_rows[e % 2];
        const float score = forward_score<kGeneral>(p, mask, check_mask, i, j, s[t][e]);
        s[t][e] = score;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], score);
      }
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = tile_max[h];
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 2));
      const float new_max = fmaxf(row_max[h], m);
      base[h] = new_max == -INFINITY ? 0.0f : new_max;  // all masked so far: every p is 0
      const float correction = exp2_approx((row_max[h] - base[h]) * kLog2e);
      row_max[h] = new_max;
      row_sum[h] *= correction;
#pragma unroll
      for (int t = 0; t < kKSteps; ++t) {
        acc[t][2 * h] *= correction;
        acc[t][2 * h + 1] *= correction;
      }
    }
#pragma unroll
    for (int t = 0; t < kNTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[t][e] = exp2_approx(fmaf(s[t][e], kLog2e, -base[e / 2] * kLog2e));
        row_sum[e / 2] += s[t][e];
        if constexpr (kGeneral) {  // dropout after the row sum: only P V sees it
          s[t][e] *= dropout.factor(keep, 4 * t + e);
        }
      }

    cp_async_wait<1>();  // V
    round_loaded_tile<kBlockN, kHeadDim, G::kStrideV, G::kThreads>(smem_v, vectorized);
    __syncthreads();
    warp_pb<kNTiles, kKSteps, G::kStrideV>(s, smem_v, lane, acc);
    cp_async_wait<0>();  // next K
    if (n_block + 1 < key_tiles.end)
      round_loaded_tile<kBlockN, kHeadDim, G::kStrideK, G::kThreads>(smem_k, vectorized);
    __syncthreads();  // every warp is done with V, and the next K is visible
  }

  // Normalise and store; rows that saw no key give o = 0 and lse = -inf.
  float* out = static_cast<float*>(p.o) + q_offset;
  float* lse_out = p.lse + sm80::row_stat_offset(p, cta.batch, cta.head, m0);
  const int64_t ld = q_shape.row_stride();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int row = warp_row + lane.g + 8 * h;
    if (row >= rows_in_bounds) continue;
    if (lane.q == 0) lse_out[row] = sum > 0.0f ? row_max[h] + logf(sum) : -INFINITY;
#pragma unroll
    for (int t = 0; t < kKSteps; ++t) {
      const int col = 8 * t + 2 * lane.q;
      if (col < head_dim) out[row * ld + col] = acc[t][2 * h] * inv;
      if (col + 1 < head_dim) out[row * ld + col + 1] = acc[t][2 * h + 1] * inv;
    }
  }
}

}  // namespace jax_flash::cuda::f32
