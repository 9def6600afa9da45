// Exact-float32 backward, the same three passes as the sm80 kernels and no atomics (deterministic):
//   1. softmax_d = rowsum(dO * O) - dlse (sm80's row kernel, instantiated for float)
//   2. dK, dV: one CTA per 64-key tile and KV head, looping over the query heads of its GQA group and their
//      visible query tiles: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, then Pᵀ and dSᵀ take turns in one shared score tile for
//      dV += Pᵀ dO and dK += dSᵀ Q.
//   3. dQ: one CTA per 64-query tile and head: dP = dO Vᵀ, S = Q Kᵀ, dS staged, dQ += dS K; the general
//      variant also hands each dS to dbias (stores or atomics, common/dbias_plan.h).
// With dropout (general variant), dV = dropout(P)ᵀ dO and dS = P (dropout(dP) - D) (score_element.h).
#pragma once

#include <cmath>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../sm80/tensor_offsets.h"
#include "../common/dbias_plan.h"
#include "score_element.h"
#include "simt_tile.h"

namespace jax_flash::cuda::f32 {

// Query tiles of the dK/dV pass hold 64 rows up to head dim 128 and 32 above, so that K, V, Q, dO and the
// score tile fit in shared memory (A100's 163 KiB at head dim 128).
template <int kHeadDim>
struct DkdvGeometry {
  static constexpr int kQueryRows = kHeadDim <= 128 ? 64 : 32;
  static constexpr int kCols = kQueryRows / kGroupLanes;
  static constexpr int kKeyElems = kTileRows * padded_stride<kHeadDim>();
  static constexpr int kQueryElems = kQueryRows * padded_stride<kHeadDim>();
  static constexpr int kScoreElems = kTileRows * (kQueryRows + 4);
  static constexpr int kBytes = (2 * kKeyElems + 2 * kQueryElems + kScoreElems + 2 * kQueryRows) * 4;
};

template <int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(const AttentionBackwardParams p, bool vectorized) {
  using G = DkdvGeometry<kHeadDim>;
  constexpr int kQueryRows = G::kQueryRows;
  constexpr int kCols = G::kCols;
  constexpr int kOutCols = kHeadDim / 16;
  extern __shared__ __align__(16) float smem[];
  float* smem_k = smem;
  float* smem_v = smem_k + G::kKeyElems;
  float* smem_q = smem_v + G::kKeyElems;
  float* smem_do = smem_q + G::kQueryElems;
  float* smem_scores = smem_do + G::kQueryElems;  // Pᵀ, then dSᵀ
  float* smem_lse = smem_scores + G::kScoreElems;
  float* smem_d = smem_lse + kQueryRows;

  const int num_n_blocks = static_cast<int>(ceil_div(p.seqlen_k, kTileRows));
  const sm80::BlockCoord cta = sm80::decode_block_coord(num_n_blocks, p.heads_kv);
  const int64_t n0 = int64_t(cta.block) * kTileRows;
  const ThreadCoord t = thread_coord();
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  const sm80::BshdShape kv_shape = sm80::key_shape(p);
  const int head_dim = static_cast<int>(p.head_dim);
  const int keys_in_bounds = static_cast<int>(min(int64_t(kTileRows), p.seqlen_k - n0));
  const int64_t kv_offset = kv_shape.offset(cta.batch, n0, cta.head);
  // Keys past valid_k see no query; the batch's valid_k is the same for every head of the group.
  const int64_t valid_k = make_slice_mask(p, cta.batch, cta.head * (p.heads_q / p.heads_kv)).valid_k;
  const int valid_keys = static_cast<int>(max(int64_t(0), min(int64_t(kTileRows), valid_k - n0)));
  load_tile<kTileRows, kHeadDim>(smem_k, static_cast<const float*>(p.k) + kv_offset, kv_shape.row_stride(),
                                 valid_keys, head_dim, vectorized);
  load_tile<kTileRows, kHeadDim>(smem_v, static_cast<const float*>(p.v) + kv_offset, kv_shape.row_stride(),
                                 valid_keys, head_dim, vectorized);

  float dk[kRowsPerThread][kOutCols], dv[kRowsPerThread][kOutCols];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
    for (int c = 0; c < kOutCols; ++c) dk[r][c] = dv[r][c] = 0.0f;

  const int64_t group = p.heads_q / p.heads_kv;
  for (int64_t h = cta.head * group; h < (cta.head + 1) * group; ++h) {
    const SliceMask mask = make_slice_mask(p, cta.batch, h);
    SliceDropout dropout;
    if constexpr (kGeneral) dropout = SliceDropout::make(p, cta.batch, h);
    const TileSpan query_tiles = query_tiles_for_keys(mask, n0, kTileRows, kQueryRows);
    const float* stats_lse = p.lse + sm80::row_stat_offset(p, cta.batch, h, 0);
    const float* stats_d = p.softmax_d + sm80::row_stat_offset(p, cta.batch, h, 0);
    for (int m_block = query_tiles.begin; m_block < query_tiles.end; ++m_block) {
      const int64_t m0 = int64_t(m_block) * kQueryRows;
      const int valid_rows = static_cast<int>(min(int64_t(kQueryRows), mask.valid_q - m0));
      const int64_t q_offset = q_shape.offset(cta.batch, m0, h);
      __syncthreads();  // the previous tile's products are done with smem_q / smem_do / the score tiles
      load_tile<kQueryRows, kHeadDim>(smem_q, static_cast<const float*>(p.q) + q_offset, q_shape.row_stride(),
                                      valid_rows, head_dim, vectorized);
      load_tile<kQueryRows, kHeadDim>(smem_do, static_cast<const float*>(p.d_o) + q_offset, q_shape.row_stride(),
                                      valid_rows, head_dim, vectorized);
      for (int r = threadIdx.x; r < kQueryRows; r += kThreads) {
        smem_lse[r] = r < valid_rows ? stats_lse[m0 + r] : INFINITY;  // masked anyway; INFINITY keeps exp at 0
        if constexpr (kGeneral) smem_lse[r] = backward_lse(smem_lse[r]);
        smem_d[r] = r < valid_rows ? stats_d[m0 + r] : 0.0f;
      }
      __syncthreads();
      [[maybe_unused]] uint32_t keep = 0;  // element e: key t.ty + 16 (e / kCols), query t.tx + 16 (e % kCols)
      if constexpr (kGeneral) {
        keep = dropout.keep_bits<kRowsPerThread * kCols>([&](int e, int64_t* i, int64_t* j) {
          *i = m0 + t.tx + 16 * (e % kCols);
          *j = n0 + t.ty + 16 * (e / kCols);
        });
      }
      float st[kRowsPerThread][kCols], dpt[kRowsPerThread][kCols];
      tile_abt<kHeadDim, kCols>(smem_k, smem_q, t, st);
      tile_abt<kHeadDim, kCols>(smem_v, smem_do, t, dpt);
      const bool check_mask = tile_needs_mask<kGeneral>(mask, m0, kQueryRows, n0, kTileRows);
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
        const int key = t.ty + 16 * r;
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int row = t.tx + 16 * c;
          float prob, dscore;
          if constexpr (kGeneral) {
            const ElementGrad g = general_grad(p, mask, check_mask, m0 + row, n0 + key, st[r][c], dpt[r][c],
                                               smem_lse[row], smem_d[row], dropout.factor(keep, r * kCols + c));
            prob = g.prob_for_dv;
            dscore = g.dscore;
          } else {
            common_probability_and_grad(p, mask, check_mask, m0 + row, n0 + key, st[r][c], dpt[r][c],
                                        smem_lse[row], smem_d[row], &prob, &dscore);
          }
          smem_scores[key * (kQueryRows + 4) + row] = prob;
          dpt[r][c] = dscore;  // kept for the second half
        }
      }
      __syncthreads();
      tile_ab_accumulate<kHeadDim, kQueryRows>(smem_scores, smem_do, t, dv);
      __syncthreads();
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) smem_scores[(t.ty + 16 * r) * (kQueryRows + 4) + t.tx + 16 * c] = dpt[r][c];
      __syncthreads();
      tile_ab_accumulate<kHeadDim, kQueryRows>(smem_scores, smem_q, t, dk);
    }
  }
  float scale[kRowsPerThread], one[kRowsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    scale[r] = p.softmax_scale;
    one[r] = 1.0f;
  }
  store_rows<kHeadDim>(static_cast<float*>(p.dk) + kv_offset, kv_shape.row_stride(), keys_in_bounds, head_dim, t,
                       dk, scale);
  store_rows<kHeadDim>(static_cast<float*>(p.dv) + kv_offset, kv_shape.row_stride(), keys_in_bounds, head_dim, t,
                       dv, one);
}

template <int kHeadDim>
struct DqSmem {
  static constexpr int kTileElems = kTileRows * padded_stride<kHeadDim>();
  static constexpr int kScoreElems = kTileRows * (kTileRows + 4);
  static constexpr int kBytes = (3 * kTileElems + kScoreElems) * int(sizeof(float));
};

// K and V take turns in one buffer: V first for dP = dO Vᵀ, then K for S = Q Kᵀ and dQ += dS K.
template <int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(kThreads) dq_kernel(const AttentionBackwardParams p, bool vectorized, DbiasMode dbias_mode) {
  constexpr int kCols = kTileRows / kGroupLanes;
  constexpr int kOutCols = kHeadDim / 16;
  extern __shared__ __align__(16) float smem[];
  float* smem_q = smem;
  float* smem_do = smem_q + DqSmem<kHeadDim>::kTileElems;
  float* smem_kv = smem_do + DqSmem<kHeadDim>::kTileElems;
  float* smem_ds = smem_kv + DqSmem<kHeadDim>::kTileElems;

  const int num_m_blocks = static_cast<int>(ceil_div(p.seqlen_q, kTileRows));
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
  const ThreadCoord t = thread_coord();
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  const sm80::BshdShape kv_shape = sm80::key_shape(p);
  const int head_dim = static_cast<int>(p.head_dim);
  const int64_t m0 = int64_t(m_block) * kTileRows;
  const int rows_in_bounds = static_cast<int>(min(int64_t(kTileRows), p.seqlen_q - m0));
  const int valid_rows = static_cast<int>(max(int64_t(0), min(int64_t(kTileRows), mask.valid_q - m0)));
  const int64_t q_offset = q_shape.offset(cta.batch, m0, cta.head);
  load_tile<kTileRows, kHeadDim>(smem_q, static_cast<const float*>(p.q) + q_offset, q_shape.row_stride(),
                                 valid_rows, head_dim, vectorized);
  load_tile<kTileRows, kHeadDim>(smem_do, static_cast<const float*>(p.d_o) + q_offset, q_shape.row_stride(),
                                 valid_rows, head_dim, vectorized);
  float lse[kRowsPerThread], softmax_d[kRowsPerThread];
  const int64_t stats = sm80::row_stat_offset(p, cta.batch, cta.head, m0);
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int row = t.ty + 16 * r;
    lse[r] = row < valid_rows ? p.lse[stats + row] : INFINITY;
    if constexpr (kGeneral) lse[r] = backward_lse(lse[r]);
    softmax_d[r] = row < valid_rows ? p.softmax_d[stats + row] : 0.0f;
  }
  const float* k_head = static_cast<const float*>(p.k) + kv_shape.offset(cta.batch, 0, head_kv);
  const float* v_head = static_cast<const float*>(p.v) + kv_shape.offset(cta.batch, 0, head_kv);

  float dq[kRowsPerThread][kOutCols];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
    for (int c = 0; c < kOutCols; ++c) dq[r][c] = 0.0f;

  const TileSpan key_tiles = key_tiles_for_rows(mask, m0, kTileRows, kTileRows);
  for (int n_block = key_tiles.begin; n_block < key_tiles.end; ++n_block) {
    const int64_t n0 = int64_t(n_block) * kTileRows;
    const int valid_keys = static_cast<int>(min(int64_t(kTileRows), mask.valid_k - n0));
    __syncthreads();
    load_tile<kTileRows, kHeadDim>(smem_kv, v_head + n0 * kv_shape.row_stride(), kv_shape.row_stride(),
                                   valid_keys, head_dim, vectorized);
    __syncthreads();
    [[maybe_unused]] uint32_t keep = 0;
    if constexpr (kGeneral) {
      keep = dropout.keep_bits<kRowsPerThread * kCols>([&](int e, int64_t* i, int64_t* j) {
        *i = m0 + t.ty + 16 * (e / kCols);
        *j = n0 + t.tx + 16 * (e % kCols);
      });
    }
    float dp[kRowsPerThread][kCols], s[kRowsPerThread][kCols];
    tile_abt<kHeadDim, kCols>(smem_do, smem_kv, t, dp);
    __syncthreads();
    load_tile<kTileRows, kHeadDim>(smem_kv, k_head + n0 * kv_shape.row_stride(), kv_shape.row_stride(),
                                   valid_keys, head_dim, vectorized);
    __syncthreads();
    tile_abt<kHeadDim, kCols>(smem_q, smem_kv, t, s);
    const bool check_mask = tile_needs_mask<kGeneral>(mask, m0, kTileRows, n0, kTileRows);
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = t.ty + 16 * r;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int key = t.tx + 16 * c;
        if constexpr (kGeneral) {
          const ElementGrad g = general_grad(p, mask, check_mask, m0 + row, n0 + key, s[r][c], dp[r][c], lse[r],
                                             softmax_d[r], dropout.factor(keep, r * kCols + c));
          smem_ds[row * (kTileRows + 4) + key] = g.dscore;
          add_dbias(p, dbias_mode, dbias_slice, m0 + row, n0 + key, g);
        } else {
          float prob, dscore;
          common_probability_and_grad(p, mask, check_mask, m0 + row, n0 + key, s[r][c], dp[r][c], lse[r],
                                      softmax_d[r], &prob, &dscore);
          smem_ds[row * (kTileRows + 4) + key] = dscore;
        }
      }
    }
    __syncthreads();
    tile_ab_accumulate<kHeadDim, kTileRows>(smem_ds, smem_kv, t, dq);
  }
  float scale[kRowsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) scale[r] = p.softmax_scale;
  store_rows<kHeadDim>(static_cast<float*>(p.dq) + q_offset, q_shape.row_stride(), rows_in_bounds, head_dim, t, dq,
                       scale);
}

}  // namespace jax_flash::cuda::f32
