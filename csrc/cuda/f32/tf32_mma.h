// TF32 tensor-core pieces of the tf32 kernels: rounding to TF32, the SM80 m16n8k8 TF32 MMA atom (CuTe's), the
// warp's fragment coordinates, and the A-fragment loads of resident tiles (ldmatrix moves only 16-bit elements, so
// 32-bit operands are read from shared memory with plain float2 / float loads; cp.async tile loads: async_copy.h).
//
// Fragment coordinates of mma.m16n8k8 (PTX ISA), with g = lane / 4 and q = lane % 4:
//   A (16 x 8, row-major):  a0 (g, q), a1 (g + 8, q), a2 (g, q + 4), a3 (g + 8, q + 4)
//   B (8 x 8, k x n):       b0 (q, g), b1 (q + 4, g)
//   C (16 x 8):             c0 (g, 2q), c1 (g, 2q + 1), c2 (g + 8, 2q), c3 (g + 8, 2q + 1)
// A sum over k may visit k in any order, so the kernels let MMA k-slot q stand for element 2q of an 8-wide
// chunk and slot q + 4 for element 2q + 1. Then each thread's two k-values are adjacent in memory (one float2
// load), and a C fragment of P is already an A fragment: a = (c0, c2, c1, c3), no shuffles.
//
// The n index of S = Q Kᵀ (and of every other A Bᵀ product) is permuted within each 8-wide chunk: MMA column c
// stands for tile row π(c), π = (0 1 6 7 3 2 5 4). That same tile (K; Q or dO of the backward, ...) is read in
// two patterns: as B of A Bᵀ (float2 at rows π(g), g < 4 per half-warp) and, since the k index of P V is the n
// index of S, as B of P V (scalars at rows π(2q) and π(2q + 1) of a chunk, columns g). With a row stride of
// 8 mod 32 words both patterns hit 32 distinct banks under π, while the identity order would make the P V reads
// two-way conflicts. Code that turns C-fragment element (tile t, e) into a coordinate uses
// 8 t + lane.c_rows[e % 2].
//
// Shared-memory tiles hold TF32 bit patterns: every tile is rounded once, in place, by the threads that loaded
// it (round_loaded_tile), before the barrier that publishes it. The rounding (cvt.rna, two instructions on sm_90)
// then costs once per element and CTA instead of once per element, warp and reuse, which kept the issue slots
// busier than the MMAs; the fragment loads below hand the bits to the MMA unchanged. Only fragments made in
// registers (P, dS) are rounded as they become A fragments.
#pragma once

#include <cstdint>

#include <cute/arch/mma_sm80.hpp>

#include "async_copy.h"

namespace jax_flash::cuda::f32 {

// Round to nearest (ties away) to TF32's 10-bit mantissa. The MMA would otherwise just ignore the low 13 bits
// (truncation): rounding halves the worst-case operand error and removes truncation's bias toward zero.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t out;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(out) : "f"(x));
  return out;
}

// 2^x as the single MUFU.EX2 instruction (relative error ~2^-22, results below 2^-126 flush to zero): the
// softmax of the TF32 kernels, whose operands carry 2^-11 rounding anyway. expf would be eight instructions.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.4426950408889634f;

// The bits of a value already rounded to TF32 (a shared-memory tile after round_loaded_tile).
__device__ __forceinline__ uint32_t bits(float tf32_value) { return __float_as_uint(tf32_value); }

struct Mma16x8x8 {
  // c += a b over one 16 x 8 x 8 block, float32 accumulation.
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1, c[0], c[1],
                                              c[2], c[3]);
  }
};

// π of the comment above, as eight 4-bit entries.
__device__ __forceinline__ int chunk_row(int column) { return (0x45237610u >> (4 * column)) & 7; }

struct LaneCoord {
  int g;           // lane / 4: rows g and g + 8 of the warp's 16
  int q;           // lane % 4
  int b_row;       // π(g): the tile row that column g of a B fragment reads
  int c_rows[2];   // π(2q), π(2q + 1): the tile rows (within a chunk) of C columns 2q and 2q + 1
};
__device__ inline LaneCoord lane_coord() {
  const int g = int(threadIdx.x % 32) / 4, q = int(threadIdx.x % 4);
  return {g, q, chunk_row(g), {chunk_row(2 * q), chunk_row(2 * q + 1)}};
}

// acc[t] += A Bᵀ for the warp's 16 rows of A, given as its fragments (load_a_fragments), and the rows 8 t + π(g)
// of the TF32 tile `b` (stride kStrideB), over kDepth columns: S = Q Kᵀ and its kin. b is read as float2 at
// column 2 q of each 8-wide chunk (k-slots q and q + 4).
template <int kDepth, int kNTiles, int kStrideB>
__device__ __forceinline__ void warp_abt(const float4* a_frags, const float* b, LaneCoord lane,
                                         float (&acc)[kNTiles][4]) {
  const float4* a = a_frags + 4 * lane.g + lane.q;
  const float* b0 = b + lane.b_row * kStrideB + 2 * lane.q;
#pragma unroll 4
  for (int ks = 0; ks < kDepth / 8; ++ks) {
    const float4 x = a[32 * ks];
    const uint32_t frag[4] = {bits(x.x), bits(x.y), bits(x.z), bits(x.w)};
#pragma unroll
    for (int t = 0; t < kNTiles; ++t) {
      const float2 w = *reinterpret_cast<const float2*>(b0 + 8 * t * kStrideB + 8 * ks);
      Mma16x8x8::run(acc[t], frag, bits(w.x), bits(w.y));
    }
  }
}

// acc[t] += P B for a score-shaped C fragment p (16 rows x 8 kKTiles columns, e.g. P or dS) and the
// [8 kKTiles, 8 kNTiles] TF32 tile b (stride kStrideB): O += P V and its kin. P's C fragment is its A fragment
// under the k-slot order above, rounded here; b is read as scalars at rows 8 kt + π(2q), 8 kt + π(2q + 1),
// column 8 t + g.
template <int kKTiles, int kNTiles, int kStrideB>
__device__ __forceinline__ void warp_pb(const float (&p)[kKTiles][4], const float* b, LaneCoord lane,
                                        float (&acc)[kNTiles][4]) {
#pragma unroll
  for (int kt = 0; kt < kKTiles; ++kt) {
    const uint32_t frag[4] = {to_tf32(p[kt][0]), to_tf32(p[kt][2]), to_tf32(p[kt][1]), to_tf32(p[kt][3])};
    const float* b0 = b + (8 * kt + lane.c_rows[0]) * kStrideB + lane.g;
    const float* b1 = b + (8 * kt + lane.c_rows[1]) * kStrideB + lane.g;
#pragma unroll
    for (int t = 0; t < kNTiles; ++t) Mma16x8x8::run(acc[t], frag, bits(b0[8 * t]), bits(b1[8 * t]));
  }
}

template <int kRows, int kCols>
__device__ __forceinline__ void zero(float (&x)[kRows][kCols]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) x[r][c] = 0.0f;
}

// The A fragments of a warp's 16 rows of a [rows, kHeadDim] global tile (row 0 at gmem, row stride ld), rounded
// to TF32, into frags (16 kHeadDim floats, the warp's own) in fragment order: k-step ks of lane l is the float4
// (a0, a1, a2, a3) at frags[32 ks + l]. warp_abt then loads each fragment with one conflict-free 16-byte load
// straight into the four registers the MMA takes (row-major A would need four register moves per k-step).
// For tiles a CTA keeps for its whole life (Q of the forward, the backward's resident tiles), so plain loads.
// Rows >= valid_rows and columns >= head_dim become zero.
template <int kHeadDim>
__device__ void load_a_fragments(float4* frags, const float* gmem, int64_t ld, int valid_rows, int head_dim,
                                 bool vectorized, LaneCoord lane) {
#pragma unroll 4
  for (int ks = 0; ks < kHeadDim / 8; ++ks) {
    const int col = 8 * ks + 2 * lane.q;
    float2 x[2];  // rows g and g + 8, columns col and col + 1 (k-slots q and q + 4)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = lane.g + 8 * h;
      const float* src = gmem + row * ld + col;
      x[h] = make_float2(0.0f, 0.0f);
      if (row >= valid_rows) continue;
      if (vectorized) {  // head_dim % 4 == 0: col < head_dim implies col + 1 < head_dim
        if (col < head_dim) x[h] = *reinterpret_cast<const float2*>(src);
      } else {
        if (col < head_dim) x[h].x = src[0];
        if (col + 1 < head_dim) x[h].y = src[1];
      }
    }
    frags[32 * ks + 4 * lane.g + lane.q] =
        make_float4(__uint_as_float(to_tf32(x[0].x)), __uint_as_float(to_tf32(x[1].x)),
                    __uint_as_float(to_tf32(x[0].y)), __uint_as_float(to_tf32(x[1].y)));
  }
}

// Rounds to TF32, in place, the elements of a tile that this thread loaded with load_tile_async (same thread-to-
// element map). Call it after this thread's cp_async_wait for the tile and before the barrier that publishes
// the tile: a thread sees its own completed copies without a barrier. Zero fill stays zero.
template <int kRows, int kHeadDim, int kStride, int kThreadCount>
__device__ void round_loaded_tile(float* smem, bool vectorized) {
  if (vectorized) {
    constexpr int kVecs = kHeadDim / 4;
    for (int idx = threadIdx.x; idx < kRows * kVecs; idx += kThreadCount) {
      float4* chunk = reinterpret_cast<float4*>(smem + (idx / kVecs) * kStride + (idx % kVecs) * 4);
      const float4 x = *chunk;
      *chunk = make_float4(__uint_as_float(to_tf32(x.x)), __uint_as_float(to_tf32(x.y)),
                           __uint_as_float(to_tf32(x.z)), __uint_as_float(to_tf32(x.w)));
    }
  } else {
    for (int idx = threadIdx.x; idx < kRows * kHeadDim; idx += kThreadCount) {
      float* x = smem + (idx / kHeadDim) * kStride + idx % kHeadDim;
      *x = __uint_as_float(to_tf32(*x));
    }
  }
}

}  // namespace jax_flash::cuda::f32
