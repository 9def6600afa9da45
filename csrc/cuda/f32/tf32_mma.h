// TF32 tensor-core pieces of the tf32 kernels: rounding to TF32, the SM80 m16n8k8 TF32 MMA atom (CuTe's), the
// warp's fragment coordinates, and cp.async tile loads (ldmatrix moves only 16-bit elements, so 32-bit operands
// are read from shared memory with plain float2 loads).
//
// Fragment coordinates of mma.m16n8k8 (PTX ISA), with g = lane / 4 and q = lane % 4:
//   A (16 x 8, row-major):  a0 (g, q), a1 (g + 8, q), a2 (g, q + 4), a3 (g + 8, q + 4)
//   B (8 x 8, k x n):       b0 (q, g), b1 (q + 4, g)
//   C (16 x 8):             c0 (g, 2q), c1 (g, 2q + 1), c2 (g + 8, 2q), c3 (g + 8, 2q + 1)
// A sum over k may visit k in any order, so the kernels let MMA k-slot q stand for element 2q of an 8-wide
// chunk and slot q + 4 for element 2q + 1. Then each thread's two k-values are adjacent in memory (one float2
// load), and a C fragment of P is already an A fragment: a = (c0, c2, c1, c3), no shuffles.
#pragma once

#include <cstdint>

#include <cute/arch/mma_sm80.hpp>

namespace jax_flash::cuda::f32 {

// Round to nearest (ties away) to TF32's 10-bit mantissa. The MMA would otherwise just ignore the low 13 bits
// (truncation): rounding halves the worst-case operand error and removes truncation's bias toward zero.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t out;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(out) : "f"(x));
  return out;
}

struct Mma16x8x8 {
  // c += a b over one 16 x 8 x 8 block, float32 accumulation.
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1, c[0], c[1],
                                              c[2], c[3]);
  }
};

struct LaneCoord {
  int g;  // lane / 4: rows g and g + 8 of the warp's 16, column g of a B fragment
  int q;  // lane % 4
};
__device__ inline LaneCoord lane_coord() { return {int(threadIdx.x % 32) / 4, int(threadIdx.x % 4)}; }

// acc[t] += A Bᵀ for the warp's 16 rows of `a` (row 0 at a, stride kStrideA) and the rows 8 t + g of `b` (stride
// kStrideB), over kDepth columns: S = Q Kᵀ and its kin. Both operands are read as float2 at column 2 q of each
// 8-wide chunk (k-slots q and q + 4) and rounded to TF32.
template <int kDepth, int kNTiles, int kStrideA, int kStrideB>
__device__ __forceinline__ void warp_abt(const float* a, const float* b, LaneCoord lane, float (&acc)[kNTiles][4]) {
  const float* a0 = a + lane.g * kStrideA + 2 * lane.q;
  const float* a1 = a0 + 8 * kStrideA;
  const float* b0 = b + lane.g * kStrideB + 2 * lane.q;
#pragma unroll 4
  for (int ks = 0; ks < kDepth / 8; ++ks) {
    const float2 x = *reinterpret_cast<const float2*>(a0 + 8 * ks);
    const float2 y = *reinterpret_cast<const float2*>(a1 + 8 * ks);
    const uint32_t frag[4] = {to_tf32(x.x), to_tf32(y.x), to_tf32(x.y), to_tf32(y.y)};
#pragma unroll
    for (int t = 0; t < kNTiles; ++t) {
      const float2 w = *reinterpret_cast<const float2*>(b0 + 8 * t * kStrideB + 8 * ks);
      Mma16x8x8::run(acc[t], frag, to_tf32(w.x), to_tf32(w.y));
    }
  }
}

// acc[t] += P B for a score-shaped C fragment p (16 rows x 8 kKTiles columns, e.g. P or dS) and the
// [8 kKTiles, 8 kNTiles] tile b (stride kStrideB): O += P V and its kin. P's C fragment is its A fragment under
// the k-slot order above; b is read as scalars at rows 8 kt + 2 q (+1), column 8 t + g.
template <int kKTiles, int kNTiles, int kStrideB>
__device__ __forceinline__ void warp_pb(const float (&p)[kKTiles][4], const float* b, LaneCoord lane,
                                        float (&acc)[kNTiles][4]) {
#pragma unroll
  for (int kt = 0; kt < kKTiles; ++kt) {
    const uint32_t frag[4] = {to_tf32(p[kt][0]), to_tf32(p[kt][2]), to_tf32(p[kt][1]), to_tf32(p[kt][3])};
    const float* b0 = b + (8 * kt + 2 * lane.q) * kStrideB + lane.g;
#pragma unroll
    for (int t = 0; t < kNTiles; ++t) Mma16x8x8::run(acc[t], frag, to_tf32(b0[8 * t]), to_tf32(b0[kStrideB + 8 * t]));
  }
}

template <int kRows, int kCols>
__device__ __forceinline__ void zero(float (&x)[kRows][kCols]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) x[r][c] = 0.0f;
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool fill) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = fill ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// Like load_tile (simt_tile.h) into a tile of row stride kStride, asynchronously when vectorized (the caller
// commits and waits); rows >= valid_rows and columns >= head_dim become zero.
template <int kRows, int kHeadDim, int kStride, int kThreadCount>
__device__ void load_tile_async(float* smem, const float* gmem, int64_t ld, int valid_rows, int head_dim,
                                bool vectorized) {
  if (vectorized) {  // head_dim % 4 == 0 and 16-byte aligned rows
    constexpr int kVecs = kHeadDim / 4;
    for (int idx = threadIdx.x; idx < kRows * kVecs; idx += kThreadCount) {
      const int row = idx / kVecs, col = (idx % kVecs) * 4;
      const bool inside = row < valid_rows && col < head_dim;
      cp_async_16(smem + row * kStride + col, inside ? gmem + row * ld + col : gmem, inside);
    }
  } else {
    for (int idx = threadIdx.x; idx < kRows * kHeadDim; idx += kThreadCount) {
      const int row = idx / kHeadDim, col = idx % kHeadDim;
      smem[row * kStride + col] = row < valid_rows && col < head_dim ? gmem[row * ld + col] : 0.0f;
    }
  }
}

}  // namespace jax_flash::cuda::f32
