// Building blocks of the exact-float32 (SIMT FMA) kernels: the CTA geometry, global <-> shared tile copies, and
// the two shared-memory micro-GEMMs every pass is made of. Classic FlashAttention-1 style: tiles of 64 rows in
// shared memory, each of the 256 threads owns a 4 x 4 piece of a 64 x 64 score tile and a 4-row slice of a
// 64 x head_dim accumulator. No tensor cores, so every product and sum is a float32 FMA.
#pragma once

#include <cstdint>

#include "../../common/attention_params.h"
#include "async_copy.h"

namespace jax_flash::cuda::f32 {

constexpr int kThreads = 256;
constexpr int kTileRows = 64;       // rows of the tile whose rows a thread owns (queries or keys)
constexpr int kRowsPerThread = 4;   // rows ty + 16 * r, r < 4
constexpr int kGroupLanes = 16;     // the 16 threads (same ty, one half-warp) that share those rows

// Shared-memory row stride of a [rows, kHeadDim] tile: 4 floats of padding make consecutive rows start 16 bytes
// apart modulo 128, so eight lanes reading float4s from eight consecutive rows hit distinct banks.
template <int kHeadDim>
constexpr int padded_stride() {
  static_assert(kHeadDim % 32 == 0, "head dims of the float32 kernels are multiples of 32");
  return kHeadDim + 4;
}

struct ThreadCoord {
  int tx;  // 0..15: score columns tx + 16 * c; head-dim columns 32 * g + 2 * tx + {0, 1}
  int ty;  // 0..15: rows ty + 16 * r
};

__device__ inline ThreadCoord thread_coord() { return {int(threadIdx.x) % kGroupLanes, int(threadIdx.x) / kGroupLanes}; }

// Copies rows [0, valid_rows) x cols [0, head_dim) of a global tile (row stride `ld`) into a
// [rows, kHeadDim] shared tile; everything else of the shared tile becomes zero, so padded rows and head-dim
// columns add nothing to any dot product. load_tile_start issues the copy as one cp.async group (vectorized:
// head_dim % 4 == 0 and 16-byte aligned rows; otherwise it stores synchronously); the tile is this thread's once
// cp_async_wait returns, everyone's after the barrier that follows. load_tile waits right away.
template <int kRows, int kHeadDim>
__device__ void load_tile_start(float* smem, const float* gmem, int64_t ld, int valid_rows, int head_dim,
                                bool vectorized) {
  load_tile_async<kRows, kHeadDim, padded_stride<kHeadDim>(), kThreads>(smem, gmem, ld, valid_rows, head_dim,
                                                                         vectorized);
  cp_async_commit();
}
template <int kRows, int kHeadDim>
__device__ void load_tile(float* smem, const float* gmem, int64_t ld, int valid_rows, int head_dim,
                          bool vectorized) {
  load_tile_start<kRows, kHeadDim>(smem, gmem, ld, valid_rows, head_dim, vectorized);
  cp_async_wait<0>();
}

// acc[r][c] = sum_d a[ty + 16 r][d] * b[tx + 16 c][d]: a score tile (A Bᵀ) of two [64, kHeadDim] tiles; b may
// have fewer rows (kCols * 16). The a reads are half-warp broadcasts; the b reads are conflict-free float4s.
template <int kHeadDim, int kCols>
__device__ void tile_abt(const float* a, const float* b, ThreadCoord t, float (&acc)[kRowsPerThread][kCols]) {
  constexpr int kStride = padded_stride<kHeadDim>();
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
#pragma unroll 2
  for (int d = 0; d < kHeadDim; d += 4) {
    float4 av[kRowsPerThread], bv[kCols];
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
      av[r] = *reinterpret_cast<const float4*>(a + (t.ty + 16 * r) * kStride + d);
#pragma unroll
    for (int c = 0; c < kCols; ++c) bv[c] = *reinterpret_cast<const float4*>(b + (t.tx + 16 * c) * kStride + d);
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        float s = acc[r][c];
        s = fmaf(av[r].x, bv[c].x, s);
        s = fmaf(av[r].y, bv[c].y, s);
        s = fmaf(av[r].z, bv[c].z, s);
        s = fmaf(av[r].w, bv[c].w, s);
        acc[r][c] = s;
      }
  }
}

// acc[r][2 g + e] += sum_j p[ty + 16 r][j] * b[j][32 g + 2 tx + e] for j < kDepth: a [64, kDepth] score-shaped
// tile (stride kDepth + 4) times a [kDepth, kHeadDim] tile. The b reads are contiguous 128-byte rows per half-warp.
template <int kHeadDim, int kDepth>
__device__ void tile_ab_accumulate(const float* p, const float* b, ThreadCoord t,
                                   float (&acc)[kRowsPerThread][kHeadDim / 16]) {
  constexpr int kStrideP = kDepth + 4;
  constexpr int kStrideB = padded_stride<kHeadDim>();
  constexpr int kPairs = kHeadDim / 32;
#pragma unroll 2
  for (int j = 0; j < kDepth; j += 4) {
    float4 pv[kRowsPerThread];
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
      pv[r] = *reinterpret_cast<const float4*>(p + (t.ty + 16 * r) * kStrideP + j);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      float2 bv[kPairs];
#pragma unroll
      for (int g = 0; g < kPairs; ++g)
        bv[g] = *reinterpret_cast<const float2*>(b + (j + jj) * kStrideB + 32 * g + 2 * t.tx);
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
        const float pj = jj == 0 ? pv[r].x : jj == 1 ? pv[r].y : jj == 2 ? pv[r].z : pv[r].w;
#pragma unroll
        for (int g = 0; g < kPairs; ++g) {
          acc[r][2 * g] = fmaf(pj, bv[g].x, acc[r][2 * g]);
          acc[r][2 * g + 1] = fmaf(pj, bv[g].y, acc[r][2 * g + 1]);
        }
      }
    }
  }
}

// Stores the thread's slice of a [64, kHeadDim] accumulator, times `scale`, into global rows [0, valid_rows)
// (row stride `ld`), columns below head_dim only.
template <int kHeadDim>
__device__ void store_rows(float* gmem, int64_t ld, int valid_rows, int head_dim, ThreadCoord t,
                           const float (&acc)[kRowsPerThread][kHeadDim / 16], const float (&scale)[kRowsPerThread]) {
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int row = t.ty + 16 * r;
    if (row >= valid_rows) continue;
#pragma unroll
    for (int g = 0; g < kHeadDim / 32; ++g) {
      const int col = 32 * g + 2 * t.tx;
      if (col < head_dim) gmem[row * ld + col] = acc[r][2 * g] * scale[r];
      if (col + 1 < head_dim) gmem[row * ld + col + 1] = acc[r][2 * g + 1] * scale[r];
    }
  }
}

// Max / sum over the 16 threads that share a row (xor offsets below 16 stay inside the half-warp).
__device__ inline float group_max(float x) {
#pragma unroll
  for (int offset = 1; offset < kGroupLanes; offset *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  return x;
}
__device__ inline float group_sum(float x) {
#pragma unroll
  for (int offset = 1; offset < kGroupLanes; offset *= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
  return x;
}

}  // namespace jax_flash::cuda::f32
