// cp.async tile loads of the float32 kernels (sm_80 and newer): global -> shared in 16-byte pieces without a trip
// through registers, so that every piece of a tile is in flight at once. (A plain load-then-store loop waits out
// the global latency once per piece: the compiler does not move a load above the previous piece's shared store.)
#pragma once

#include <cstdint>

namespace jax_flash::cuda::f32 {

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool fill) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = fill ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// Copies rows [0, valid_rows) x cols [0, head_dim) of a global tile (row stride `ld`) into a [kRows, kHeadDim]
// shared tile of row stride kStride, the rest of it zero: with cp.async when vectorized (head_dim % 4 == 0 and
// 16-byte aligned rows; the caller commits and waits), else with plain stores.
template <int kRows, int kHeadDim, int kStride, int kThreadCount>
__device__ void load_tile_async(float* smem, const float* gmem, int64_t ld, int valid_rows, int head_dim,
                                bool vectorized) {
  constexpr int kVecs = kHeadDim / 4;
  // Where the threads cover whole rows per pass, each thread's column is fixed and its rows step by a constant:
  // an unrolled loop of pointer increments (the generic loop's index arithmetic stays live across the kernels'
  // tile loops and spills).
  constexpr int kRowsPerPass = kThreadCount / kVecs;
  constexpr bool kWholeRowPasses = kThreadCount % kVecs == 0 && kRows % kRowsPerPass == 0;
  if (vectorized && kWholeRowPasses) {
    const int row0 = int(threadIdx.x) / kVecs, col = (int(threadIdx.x) % kVecs) * 4;
#pragma unroll
    for (int pass = 0; pass < (kWholeRowPasses ? kRows / kRowsPerPass : 1); ++pass) {
      const int row = row0 + pass * kRowsPerPass;
      const bool inside = row < valid_rows && col < head_dim;
      cp_async_16(smem + row * kStride + col, inside ? gmem + row * ld + col : gmem, inside);
    }
  } else if (vectorized) {  // head_dim % 4 == 0 and 16-byte aligned rows
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
