// TF32 tensor-core backward (head dims up to 128), the same passes as the exact one (softmax_d pre-pass, dK/dV,
// dQ; no atomics, deterministic), each warp owning 16 resident rows and every product an m16n8k8 TF32 MMA with
// float32 accumulation:
//   dK/dV: one CTA per 64 keys (4 warps x 16) and KV head, over the GQA group's heads and visible 32-query tiles:
//          Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, then dV += Pᵀ dO and dK += dSᵀ Q straight from the accumulators.
//   dQ:    one CTA per 64 queries and head, over the visible 32-key tiles: S = Q Kᵀ, dP = dO Vᵀ, dQ += dS K; the
//          general variant also hands each dS to dbias (stores or atomics, common/dbias_plan.h).
// Dropout (general variant): dV = dropout(P)ᵀ dO, dS = P (dropout(dP) - D) (score_element.h).
// The resident tiles (K, V of dK/dV; Q, dO of dQ) are only ever A operands, so each warp keeps its rows as TF32
// A fragments (load_a_fragments); the streamed tiles arrive by cp.async and are rounded in place.
#pragma once

#include <cmath>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../sm80/tensor_offsets.h"
#include "backward_kernels.h"
#include "../common/dbias_plan.h"
#include "score_element.h"
#include "tf32_mma.h"

namespace jax_flash::cuda::f32 {

template <int kHeadDim>
struct Tf32BackwardGeometry {
  static_assert(kHeadDim <= 128, "the TF32 backward keeps two 16 x head_dim accumulators per warp in registers");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlock = 16 * kWarps;  // resident rows per CTA: keys of dK/dV, queries of dQ
  // Rows of a streamed tile (queries of dK/dV, keys of dQ). 32 rather than 64 halves the Sᵀ / dPᵀ accumulators
  // (so dK/dV does not spill) and the streamed tiles' shared memory, so that two CTAs fit an SM (sm_90: about
  // 100 KiB each at head dim 128): one CTA's loads then overlap the other's MMAs.
  static constexpr int kStreamRows = 32;
  // Row stride of a streamed tile in floats: 8 mod 32 words makes both its read patterns (B of A Bᵀ and of
  // P V) conflict-free (tf32_mma.h, the row order π).
  static constexpr int kStride = kHeadDim + 8;
  static constexpr int kFragElems = kBlock * kHeadDim;  // one resident tile as A fragments
  static constexpr int kStreamElems = kStreamRows * kStride;
  static constexpr int kBytes = (2 * kFragElems + 2 * kStreamElems + 2 * kStreamRows) * int(sizeof(float));
};

// Common variant, one score element: P = exp(scale dot - lse) as one FFMA and one MUFU.EX2 in base 2 (lse_log2 =
// lse log2(e)), dS = P (dP - D); 0 where masked. The exact kernels' expf would be eight instructions.
__device__ __forceinline__ void tf32_probability_and_grad(float scale_log2, const SliceMask& mask, bool check_mask,
                                                          int64_t i, int64_t j, float dot, float dp, float lse_log2,
                                                          float softmax_d, float* prob, float* dscore) {
  const bool visible = !check_mask || mask.visible(i, j);
  const float pr = visible ? exp2_approx(fmaf(dot, scale_log2, -lse_log2)) : 0.0f;
  *prob = pr;
  *dscore = pr * (dp - softmax_d);
}

template <int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(Tf32BackwardGeometry<kHeadDim>::kThreads)
    tf32_dkdv_kernel(const AttentionBackwardParams p, bool vectorized) {
  using G = Tf32BackwardGeometry<kHeadDim>;
  constexpr int kBlock = G::kBlock;
  constexpr int kQueries = G::kStreamRows;
  constexpr int kDimTiles = kHeadDim / 8;
  constexpr int kRowTiles = kQueries / 8;
  extern __shared__ __align__(16) float smem[];
  float* smem_q = smem;
  float* smem_do = smem_q + G::kStreamElems;
  float* smem_lse = smem_do + G::kStreamElems;
  float* smem_d = smem_lse + kQueries;
  float4* resident = reinterpret_cast<float4*>(smem_d + kQueries);

  const int num_n_blocks = static_cast<int>(ceil_div(p.seqlen_k, kBlock));
  const sm80::BlockCoord cta = sm80::decode_block_coord(num_n_blocks, p.heads_kv);
  const int64_t n0 = int64_t(cta.block) * kBlock;
  const LaneCoord lane = lane_coord();
  const int warp_row = 16 * (int(threadIdx.x) / 32);
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  const sm80::BshdShape kv_shape = sm80::key_shape(p);
  const int head_dim = static_cast<int>(p.head_dim);
  const int keys_in_bounds = static_cast<int>(min(int64_t(kBlock), p.seqlen_k - n0));
  const int64_t kv_offset = kv_shape.offset(cta.batch, n0, cta.head);
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t valid_k = make_slice_mask(p, cta.batch, cta.head * group).valid_k;
  const int valid_keys = static_cast<int>(max(int64_t(0), min(int64_t(kBlock), valid_k - n0)));
  // The warp's 16 keys of K and V as A fragments (16 kHeadDim floats each); a thread reads only the fragments
  // it wrote, so they need no barrier.
  float4* k_frags = resident + (warp_row / 16) * 4 * kHeadDim;
  float4* v_frags = k_frags + G::kFragElems / 4;
  {
    const int64_t ld = kv_shape.row_stride();
    const int64_t warp_offset = kv_offset + warp_row * ld;
    load_a_fragments<kHeadDim>(k_frags, static_cast<const float*>(p.k) + warp_offset, ld,
                               valid_keys - warp_row, head_dim, vectorized, lane);
    load_a_fragments<kHeadDim>(v_frags, static_cast<const float*>(p.v) + warp_offset, ld,
                               valid_keys - warp_row, head_dim, vectorized, lane);
  }

  float dk[kDimTiles][4], dv[kDimTiles][4];
  zero(dk);
  zero(dv);
  for (int64_t h = cta.head * group; h < (cta.head + 1) * group; ++h) {
    const SliceMask mask = make_slice_mask(p, cta.batch, h);
    SliceDropout dropout;
    if constexpr (kGeneral) dropout = SliceDropout::make(p, cta.batch, h);
    const TileSpan query_tiles = query_tiles_for_keys(mask, n0, kBlock, kQueries);
    const float* stats_lse = p.lse + sm80::row_stat_offset(p, cta.batch, h, 0);
    const float* stats_d = p.softmax_d + sm80::row_stat_offset(p, cta.batch, h, 0);
    for (int m_block = query_tiles.begin; m_block < query_tiles.end; ++m_block) {
      const int64_t m0 = int64_t(m_block) * kQueries;
      const int valid_rows = static_cast<int>(min(int64_t(kQueries), mask.valid_q - m0));
      const int64_t q_offset = q_shape.offset(cta.batch, m0, h);
      __syncthreads();  // every warp is done with the previous Q / dO tiles
      load_tile_async<kQueries, kHeadDim, G::kStride, G::kThreads>(
          smem_q, static_cast<const float*>(p.q) + q_offset, q_shape.row_stride(), valid_rows, head_dim, vectorized);
      load_tile_async<kQueries, kHeadDim, G::kStride, G::kThreads>(
          smem_do, static_cast<const float*>(p.d_o) + q_offset, q_shape.row_stride(), valid_rows, head_dim,
          vectorized);
      cp_async_commit();
      for (int r = threadIdx.x; r < kQueries; r += G::kThreads) {
        smem_lse[r] = r < valid_rows ? stats_lse[m0 + r] : INFINITY;  // masked anyway; INFINITY keeps exp at 0
        smem_lse[r] = kGeneral ? backward_lse(smem_lse[r]) : smem_lse[r] * kLog2e;  // base 2 for the common one
        smem_d[r] = r < valid_rows ? stats_d[m0 + r] : 0.0f;
      }
      cp_async_wait<0>();
      round_loaded_tile<kQueries, kHeadDim, G::kStride, G::kThreads>(smem_q, vectorized);
      round_loaded_tile<kQueries, kHeadDim, G::kStride, G::kThreads>(smem_do, vectorized);
      __syncthreads();

      // Rows are keys (warp_row + g, + 8), columns queries (8 t + π(2 q + e % 2)).
      [[maybe_unused]] uint32_t keep = 0;
      if constexpr (kGeneral) {
        keep = dropout.keep_bits<kRowTiles * 4>([&](int e, int64_t* i, int64_t* j) {
          *i = m0 + 8 * (e / 4) + lane.c_rows[e % 2];
          *j = n0 + warp_row + lane.g + 8 * ((e % 4) / 2);
        });
      }
      float st[kRowTiles][4], dpt[kRowTiles][4];
      zero(st);
      zero(dpt);
      warp_abt<kHeadDim, kRowTiles, G::kStride>(k_frags, smem_q, lane, st);
      warp_abt<kHeadDim, kRowTiles, G::kStride>(v_frags, smem_do, lane, dpt);
      const bool check_mask = tile_needs_mask<kGeneral>(mask, m0, kQueries, n0, kBlock);
#pragma unroll
      for (int t = 0; t < kRowTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = warp_row + lane.g + 8 * (e / 2);
          const int row = 8 * t + lane.c_rows[e % 2];
          if constexpr (kGeneral) {
            const ElementGrad g = general_grad(p, mask, check_mask, m0 + row, n0 + key, st[t][e], dpt[t][e],
                                               smem_lse[row], smem_d[row], dropout.factor(keep, 4 * t + e));
            st[t][e] = g.prob_for_dv;
            dpt[t][e] = g.dscore;
          } else {
            tf32_probability_and_grad(p.softmax_scale * kLog2e, mask, check_mask, m0 + row, n0 + key, st[t][e],
                                      dpt[t][e], smem_lse[row], smem_d[row], &st[t][e], &dpt[t][e]);
          }
        }
      warp_pb<kRowTiles, kDimTiles, G::kStride>(st, smem_do, lane, dv);
      warp_pb<kRowTiles, kDimTiles, G::kStride>(dpt, smem_q, lane, dk);
    }
  }
  float* dk_out = static_cast<float*>(p.dk) + kv_offset;
  float* dv_out = static_cast<float*>(p.dv) + kv_offset;
  const int64_t ld = kv_shape.row_stride();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = warp_row + lane.g + 8 * h;
    if (key >= keys_in_bounds) continue;
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t) {
      const int col = 8 * t + 2 * lane.q;
      if (col < head_dim) {
        dk_out[key * ld + col] = dk[t][2 * h] * p.softmax_scale;
        dv_out[key * ld + col] = dv[t][2 * h];
      }
      if (col + 1 < head_dim) {
        dk_out[key * ld + col + 1] = dk[t][2 * h + 1] * p.softmax_scale;
        dv_out[key * ld + col + 1] = dv[t][2 * h + 1];
      }
    }
  }
}

template <int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(Tf32BackwardGeometry<kHeadDim>::kThreads)
    tf32_dq_kernel(const AttentionBackwardParams p, bool vectorized, DbiasMode dbias_mode) {
  using G = Tf32BackwardGeometry<kHeadDim>;
  constexpr int kBlock = G::kBlock;
  constexpr int kKeys = G::kStreamRows;
  constexpr int kDimTiles = kHeadDim / 8;
  constexpr int kKeyTiles = kKeys / 8;
  extern __shared__ __align__(16) float smem[];
  float* smem_k = smem;
  float* smem_v = smem_k + G::kStreamElems;
  float4* resident = reinterpret_cast<float4*>(smem_v + G::kStreamElems);

  const int num_m_blocks = static_cast<int>(ceil_div(p.seqlen_q, kBlock));
  const sm80::BlockCoord cta = sm80::decode_block_coord(num_m_blocks, p.heads_q);
  const int m_block = num_m_blocks - 1 - cta.block;
  const int64_t head_kv = cta.head / (p.heads_q / p.heads_kv);
  const SliceMask mask = make_slice_mask(p, cta.batch, cta.head);
  SliceDropout dropout;
  float* dbias_slice = nullptr;
  if constexpr (kGeneral) {
    dropout = SliceDropout::make(p, cta.batch, cta.head);
    if (dbias_mode != DbiasMode::kNone) dbias_slice = dbias_slice_of(p, cta.batch, cta.head);
  }
  const LaneCoord lane = lane_coord();
  const int warp_row = 16 * (int(threadIdx.x) / 32);
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  const sm80::BshdShape kv_shape = sm80::key_shape(p);
  const int head_dim = static_cast<int>(p.head_dim);
  const int64_t m0 = int64_t(m_block) * kBlock;
  const int rows_in_bounds = static_cast<int>(min(int64_t(kBlock), p.seqlen_q - m0));
  const int valid_rows = static_cast<int>(max(int64_t(0), min(int64_t(kBlock), mask.valid_q - m0)));
  const int64_t q_offset = q_shape.offset(cta.batch, m0, cta.head);
  // The warp's 16 rows of Q and dO as A fragments (16 kHeadDim floats each); a thread reads only the fragments
  // it wrote, so they need no barrier.
  float4* q_frags = resident + (warp_row / 16) * 4 * kHeadDim;
  float4* do_frags = q_frags + G::kFragElems / 4;
  {
    const int64_t ld = q_shape.row_stride();
    const int64_t warp_offset = q_offset + warp_row * ld;
    load_a_fragments<kHeadDim>(q_frags, static_cast<const float*>(p.q) + warp_offset, ld,
                               valid_rows - warp_row, head_dim, vectorized, lane);
    load_a_fragments<kHeadDim>(do_frags, static_cast<const float*>(p.d_o) + warp_offset, ld,
                               valid_rows - warp_row, head_dim, vectorized, lane);
  }
  float lse[2], softmax_d[2];
  const int64_t stats = sm80::row_stat_offset(p, cta.batch, cta.head, m0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row + lane.g + 8 * h;
    lse[h] = row < valid_rows ? p.lse[stats + row] : INFINITY;
    lse[h] = kGeneral ? backward_lse(lse[h]) : lse[h] * kLog2e;  // base 2 for the common variant
    softmax_d[h] = row < valid_rows ? p.softmax_d[stats + row] : 0.0f;
  }
  const float* k_head = static_cast<const float*>(p.k) + kv_shape.offset(cta.batch, 0, head_kv);
  const float* v_head = static_cast<const float*>(p.v) + kv_shape.offset(cta.batch, 0, head_kv);
  const int64_t kv_ld = kv_shape.row_stride();

  float dq[kDimTiles][4];
  zero(dq);
  const TileSpan key_tiles = key_tiles_for_rows(mask, m0, kBlock, kKeys);
  for (int n_block = key_tiles.begin; n_block < key_tiles.end; ++n_block) {
    const int64_t n0 = int64_t(n_block) * kKeys;
    const int valid_keys = static_cast<int>(min(int64_t(kKeys), mask.valid_k - n0));
    __syncthreads();  // every warp is done with the previous K / V
    load_tile_async<kKeys, kHeadDim, G::kStride, G::kThreads>(smem_k, k_head + n0 * kv_ld, kv_ld, valid_keys,
                                                              head_dim, vectorized);
    load_tile_async<kKeys, kHeadDim, G::kStride, G::kThreads>(smem_v, v_head + n0 * kv_ld, kv_ld, valid_keys,
                                                              head_dim, vectorized);
    cp_async_commit();
    cp_async_wait<0>();
    round_loaded_tile<kKeys, kHeadDim, G::kStride, G::kThreads>(smem_k, vectorized);
    round_loaded_tile<kKeys, kHeadDim, G::kStride, G::kThreads>(smem_v, vectorized);
    __syncthreads();
    // Rows are queries (warp_row + g, + 8), columns keys (8 t + π(2 q + e % 2)).
    [[maybe_unused]] uint32_t keep = 0;
    if constexpr (kGeneral) {
      keep = dropout.keep_bits<kKeyTiles * 4>([&](int e, int64_t* i, int64_t* j) {
        *i = m0 + warp_row + lane.g + 8 * ((e % 4) / 2);
        *j = n0 + 8 * (e / 4) + lane.c_rows[e % 2];
      });
    }
    float s[kKeyTiles][4], dp[kKeyTiles][4];
    zero(s);
    zero(dp);
    warp_abt<kHeadDim, kKeyTiles, G::kStride>(q_frags, smem_k, lane, s);
    warp_abt<kHeadDim, kKeyTiles, G::kStride>(do_frags, smem_v, lane, dp);
    const bool check_mask = tile_needs_mask<kGeneral>(mask, m0, kBlock, n0, kKeys);
#pragma unroll
    for (int t = 0; t < kKeyTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = warp_row + lane.g + 8 * (e / 2);
        const int key = 8 * t + lane.c_rows[e % 2];
        if constexpr (kGeneral) {
          const ElementGrad g = general_grad(p, mask, check_mask, m0 + row, n0 + key, s[t][e], dp[t][e],
                                             lse[e / 2], softmax_d[e / 2], dropout.factor(keep, 4 * t + e));
          dp[t][e] = g.dscore;
          add_dbias(p, dbias_mode, dbias_slice, m0 + row, n0 + key, g);
        } else {
          float prob;
          tf32_probability_and_grad(p.softmax_scale * kLog2e, mask, check_mask, m0 + row, n0 + key, s[t][e],
                                    dp[t][e], lse[e / 2], softmax_d[e / 2], &prob, &dp[t][e]);
        }
      }
    warp_pb<kKeyTiles, kDimTiles, G::kStride>(dp, smem_k, lane, dq);
  }
  float* dq_out = static_cast<float*>(p.dq) + q_offset;
  const int64_t ld = q_shape.row_stride();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row + lane.g + 8 * h;
    if (row >= rows_in_bounds) continue;
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t) {
      const int col = 8 * t + 2 * lane.q;
      if (col < head_dim) dq_out[row * ld + col] = dq[t][2 * h] * p.softmax_scale;
      if (col + 1 < head_dim) dq_out[row * ld + col + 1] = dq[t][2 * h + 1] * p.softmax_scale;
    }
  }
}

}  // namespace jax_flash::cuda::f32
