// Exact-float32 forward: one CTA owns 64 query rows of one (batch, head) and streams the visible key tiles
// through shared memory. Per tile: S = Q Kᵀ (float32 FMA), the shared score pipeline, an online-softmax update
// of the running row max and sum (of the undropped probabilities: the lse ignores dropout), then O += P V with P
// (dropped out, in the general variant) staged in shared memory. K and V share one buffer (V's copy starts once S
// is done and runs under the softmax), which keeps two CTAs per SM at head dim 128; the other CTA's math covers
// the rest of the copies' latency.
#pragma once

#include <cmath>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../sm80/tensor_offsets.h"
#include "score_element.h"
#include "simt_tile.h"

namespace jax_flash::cuda::f32 {

template <int kHeadDim>
struct ForwardSmem {
  static constexpr int kTileElems = kTileRows * padded_stride<kHeadDim>();
  static constexpr int kScoreElems = kTileRows * (kTileRows + 4);
  static constexpr int kBytes = (2 * kTileElems + kScoreElems) * int(sizeof(float));
};

template <int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(kThreads, kHeadDim <= 128 ? 2 : 1) forward_kernel(const AttentionParams p, bool vectorized) {
  constexpr int kCols = kTileRows / kGroupLanes;  // score columns per thread
  constexpr int kOutCols = kHeadDim / 16;
  extern __shared__ __align__(16) float smem[];
  float* smem_q = smem;
  float* smem_kv = smem_q + ForwardSmem<kHeadDim>::kTileElems;
  float* smem_p = smem_kv + ForwardSmem<kHeadDim>::kTileElems;

  const int num_m_blocks = static_cast<int>(ceil_div(p.seqlen_q, kTileRows));
  const sm80::BlockCoord cta = sm80::decode_block_coord(num_m_blocks, p.heads_q);
  const int m_block = num_m_blocks - 1 - cta.block;  // longest causal rows first
  const int64_t head_kv = cta.head / (p.heads_q / p.heads_kv);
  const SliceMask mask = make_slice_mask(p, cta.batch, cta.head);
  SliceDropout dropout;
  if constexpr (kGeneral) dropout = SliceDropout::make(p, cta.batch, cta.head);
  const ThreadCoord t = thread_coord();

  const int64_t m0 = int64_t(m_block) * kTileRows;
  const int rows_in_bounds = static_cast<int>(min(int64_t(kTileRows), p.seqlen_q - m0));
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  const sm80::BshdShape kv_shape = sm80::key_shape(p);
  const int64_t q_offset = q_shape.offset(cta.batch, m0, cta.head);
  float* lse_out = p.lse + sm80::row_stat_offset(p, cta.batch, cta.head, m0);

  const int q_valid_rows = static_cast<int>(max(int64_t(0), min(int64_t(kTileRows), mask.valid_q - m0)));
  load_tile<kTileRows, kHeadDim>(smem_q, static_cast<const float*>(p.q) + q_offset, q_shape.row_stride(),
                                 q_valid_rows, static_cast<int>(p.head_dim), vectorized);
  const float* k_head = static_cast<const float*>(p.k) + kv_shape.offset(cta.batch, 0, head_kv);
  const float* v_head = static_cast<const float*>(p.v) + kv_shape.offset(cta.batch, 0, head_kv);

  float row_max[kRowsPerThread], row_sum[kRowsPerThread], acc[kRowsPerThread][kOutCols];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;  // this thread's columns only; summed over the row group at the end
#pragma unroll
    for (int c = 0; c < kOutCols; ++c) acc[r][c] = 0.0f;
  }

  const TileSpan key_tiles = key_tiles_for_rows(mask, m0, kTileRows, kTileRows);
  for (int n_block = key_tiles.begin; n_block < key_tiles.end; ++n_block) {
    const int64_t n0 = int64_t(n_block) * kTileRows;
    const int valid_keys = static_cast<int>(min(int64_t(kTileRows), mask.valid_k - n0));
    __syncthreads();  // previous tile's P V done with smem_kv / smem_p (and Q stored, first time)
    load_tile<kTileRows, kHeadDim>(smem_kv, k_head + n0 * kv_shape.row_stride(), kv_shape.row_stride(),
                                   valid_keys, static_cast<int>(p.head_dim), vectorized);
    __syncthreads();
    [[maybe_unused]] uint32_t keep = 0;
    if constexpr (kGeneral) {
      keep = dropout.keep_bits<kRowsPerThread * kCols>([&](int e, int64_t* i, int64_t* j) {
        *i = m0 + t.ty + 16 * (e / kCols);
        *j = n0 + t.tx + 16 * (e % kCols);
      });
    }
    float s[kRowsPerThread][kCols];
    tile_abt<kHeadDim, kCols>(smem_q, smem_kv, t, s);
    // V replaces K once everyone has read K; its copy runs while the softmax below does.
    __syncthreads();
    load_tile_start<kTileRows, kHeadDim>(smem_kv, v_head + n0 * kv_shape.row_stride(), kv_shape.row_stride(),
                                         valid_keys, static_cast<int>(p.head_dim), vectorized);

    const bool check_mask = tile_needs_mask<kGeneral>(mask, m0, kTileRows, n0, kTileRows);
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int64_t i = m0 + t.ty + 16 * r;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int64_t j = n0 + t.tx + 16 * c;
        s[r][c] = forward_score<kGeneral>(p, mask, check_mask, i, j, s[r][c]);
      }
      // Online softmax: rescale what was accumulated under the old max.
      float tile_max = s[r][0];
#pragma unroll
      for (int c = 1; c < kCols; ++c) tile_max = fmaxf(tile_max, s[r][c]);
      const float new_max = fmaxf(row_max[r], group_max(tile_max));
      const float base = new_max == -INFINITY ? 0.0f : new_max;  // all masked so far: every p is 0
      const float correction = expf(row_max[r] - base);
      row_max[r] = new_max;
      float tile_sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        s[r][c] = expf(s[r][c] - base);
        tile_sum += s[r][c];
      }
      row_sum[r] = row_sum[r] * correction + tile_sum;
#pragma unroll
      for (int c = 0; c < kOutCols; ++c) acc[r][c] *= correction;
    }
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        float prob = s[r][c];
        if constexpr (kGeneral) {  // dropout: only P V sees it
          prob *= dropout.factor(keep, r * kCols + c);
        }
        smem_p[(t.ty + 16 * r) * (kTileRows + 4) + t.tx + 16 * c] = prob;
      }
    cp_async_wait<0>();
    __syncthreads();
    tile_ab_accumulate<kHeadDim, kTileRows>(smem_p, smem_kv, t, acc);
  }

  // Normalise and store; rows that saw no key give o = 0 and lse = -inf.
  float inv_sum[kRowsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const float sum = group_sum(row_sum[r]);
    inv_sum[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int row = t.ty + 16 * r;
    if (t.tx == 0 && row < rows_in_bounds) lse_out[row] = sum > 0.0f ? row_max[r] + logf(sum) : -INFINITY;
  }
  store_rows<kHeadDim>(static_cast<float*>(p.o) + q_offset, q_shape.row_stride(), rows_in_bounds,
                       static_cast<int>(p.head_dim), t, acc, inv_sum);
}

}  // namespace jax_flash::cuda::f32
