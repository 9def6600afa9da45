// Deterministic dbias of a broadcast bias for the float32 kernels (deterministic=True; common/dbias_plan.h has
// the other cases, which the dQ passes handle). One 256-thread CTA owns one 64 x 64 block of dbias in one
// non-broadcast (batch, head) slice and visits every score tile that sums into it -- batch rows, heads, query
// tiles and key tiles along the broadcast axes -- in a fixed order, recomputing S = Q Kᵀ and dP = dO Vᵀ with the
// exact SIMT micro-GEMMs (in both precision modes: this pass is small) and adding dS = P (dropout(dP) - D) into
// registers. The block is then summed along a broadcast query/key axis in a fixed order in shared memory. No
// atomics, so the result is bit-identical run to run. The shape follows sm80/dbias.h's dbias_kernel.
#pragma once

#include <cmath>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../common/dbias_plan.h"
#include "../sm80/tensor_offsets.h"
#include "backward_kernels.h"
#include "score_element.h"
#include "simt_tile.h"

namespace jax_flash::cuda::f32 {

// The dQ pass's tiles (Q, dO, one K/V buffer, a 64 x 68 score tile) fit the 64 x 64 block sums as well.
template <int kHeadDim>
using DbiasSmem = DqSmem<kHeadDim>;

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) dbias_kernel(const AttentionBackwardParams p, bool vectorized,
                                                         DbiasGrid grid) {
  constexpr int kCols = kTileRows / kGroupLanes;
  static_assert(kTileRows * kTileRows <= 3 * DbiasSmem<kHeadDim>::kTileElems, "block sums reuse the tiles");
  extern __shared__ __align__(16) float smem[];
  float* smem_q = smem;
  float* smem_do = smem_q + DbiasSmem<kHeadDim>::kTileElems;
  float* smem_kv = smem_do + DbiasSmem<kHeadDim>::kTileElems;

  const DbiasBlock owned = decode_dbias_block(grid, blockIdx.x);
  const DbiasBroadcast bc = grid.broadcast;
  const ThreadCoord t = thread_coord();
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  const sm80::BshdShape kv_shape = sm80::key_shape(p);
  const int head_dim = static_cast<int>(p.head_dim);
  const int64_t group = p.heads_q / p.heads_kv;

  float acc[kRowsPerThread][kCols];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;

  // Members in a fixed order: batch rows, heads, query tiles, key tiles (each only along a broadcast axis).
  for (int64_t mb = 0; mb < (bc.batch ? p.inner_batch : 1); ++mb) {
    const int64_t batch = owned.outer * p.inner_batch + (bc.batch ? mb : owned.slice_batch);
    for (int64_t mh = 0; mh < (bc.head ? p.heads_q : 1); ++mh) {
      const int64_t head = bc.head ? mh : owned.slice_head;
      const SliceMask mask = make_slice_mask(p, batch, head);
      const SliceDropout dropout = SliceDropout::make(p, batch, head);
      for (int mm = 0; mm < (bc.query ? grid.m_total : 1); ++mm) {
        const int64_t m0 = int64_t(bc.query ? mm : owned.m_tile) * kTileRows;
        const TileSpan key_tiles = key_tiles_for_rows(mask, m0, kTileRows, kTileRows);
        const int q_rows = static_cast<int>(max(int64_t(0), min(int64_t(kTileRows), mask.valid_q - m0)));
        for (int nn = 0; nn < (bc.key ? grid.n_total : 1); ++nn) {
          const int n_block = bc.key ? nn : owned.n_tile;
          if (n_block < key_tiles.begin || n_block >= key_tiles.end) continue;  // nothing visible
          const int64_t n0 = int64_t(n_block) * kTileRows;
          const int k_rows = static_cast<int>(max(int64_t(0), min(int64_t(kTileRows), mask.valid_k - n0)));
          const int64_t q_offset = q_shape.offset(batch, m0, head);
          const int64_t kv_offset = kv_shape.offset(batch, n0, head / group);
          __syncthreads();  // everyone is done with the previous member's tiles
          load_tile<kTileRows, kHeadDim>(smem_q, static_cast<const float*>(p.q) + q_offset, q_shape.row_stride(),
                                         q_rows, head_dim, vectorized);
          load_tile<kTileRows, kHeadDim>(smem_do, static_cast<const float*>(p.d_o) + q_offset,
                                         q_shape.row_stride(), q_rows, head_dim, vectorized);
          load_tile<kTileRows, kHeadDim>(smem_kv, static_cast<const float*>(p.v) + kv_offset, kv_shape.row_stride(),
                                         k_rows, head_dim, vectorized);
          float lse[kRowsPerThread], softmax_d[kRowsPerThread];
          const int64_t stats = sm80::row_stat_offset(p, batch, head, m0);
#pragma unroll
          for (int r = 0; r < kRowsPerThread; ++r) {
            const int row = t.ty + 16 * r;
            lse[r] = backward_lse(row < q_rows ? p.lse[stats + row] : INFINITY);
            softmax_d[r] = row < q_rows ? p.softmax_d[stats + row] : 0.0f;
          }
          __syncthreads();
          const uint32_t keep = dropout.keep_bits<kRowsPerThread * kCols>([&](int e, int64_t* i, int64_t* j) {
            *i = m0 + t.ty + 16 * (e / kCols);
            *j = n0 + t.tx + 16 * (e % kCols);
          });
          float s[kRowsPerThread][kCols], dp[kRowsPerThread][kCols];
          tile_abt<kHeadDim, kCols>(smem_do, smem_kv, t, dp);
          __syncthreads();
          load_tile<kTileRows, kHeadDim>(smem_kv, static_cast<const float*>(p.k) + kv_offset, kv_shape.row_stride(),
                                         k_rows, head_dim, vectorized);
          __syncthreads();
          tile_abt<kHeadDim, kCols>(smem_q, smem_kv, t, s);
          const bool check_mask = tile_needs_mask<true>(mask, m0, kTileRows, n0, kTileRows);
#pragma unroll
          for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
              const ElementGrad g =
                  general_grad(p, mask, check_mask, m0 + t.ty + 16 * r, n0 + t.tx + 16 * c, s[r][c], dp[r][c],
                               lse[r], softmax_d[r], dropout.factor(keep, r * kCols + c));
              if (g.scored) acc[r][c] += g.dbias;
            }
        }
      }
    }
  }

  // Stage the block in shared memory, then sum along the broadcast query/key axes in a fixed order.
  __syncthreads();
  float* block_sums = smem;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) block_sums[(t.ty + 16 * r) * kTileRows + t.tx + 16 * c] = acc[r][c];
  __syncthreads();
  const int64_t m0 = bc.query ? 0 : int64_t(owned.m_tile) * kTileRows;
  const int64_t n0 = bc.key ? 0 : int64_t(owned.n_tile) * kTileRows;
  const int rows_out = bc.query ? 1 : static_cast<int>(min(int64_t(kTileRows), p.seqlen_q - m0));
  const int cols_out = bc.key ? 1 : static_cast<int>(min(int64_t(kTileRows), p.seqlen_k - n0));
  const int rows_summed = bc.query ? kTileRows : 1;
  const int cols_summed = bc.key ? kTileRows : 1;
  float* dbias = p.dbias + owned.outer * p.bias_strides.outer +
                 (bc.batch ? 0 : owned.slice_batch) * p.bias_strides.batch +
                 (bc.head ? 0 : owned.slice_head) * p.bias_strides.head;
  for (int o = threadIdx.x; o < rows_out * cols_out; o += kThreads) {
    const int row = o / cols_out;
    const int col = o % cols_out;
    float sum = 0.0f;
    for (int r = 0; r < rows_summed; ++r)
      for (int c = 0; c < cols_summed; ++c) sum += block_sums[(row + r) * kTileRows + col + c];
    dbias[(m0 + row) * p.bias_strides.query + (n0 + col) * p.bias_strides.key] = sum;
  }
}

}  // namespace jax_flash::cuda::f32
