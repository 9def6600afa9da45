// Moves [rows, head_dim] tiles between global memory (BSHD rows, `row_stride` elements apart) and swizzled
// shared memory in 16-byte chunks of 8 elements. Rows past `valid_rows` and columns past `head_dim` read as
// zero and are never written, so edge tiles need no padding in global memory.
//
// `vectorized` (head_dim and every base pointer 16-byte aligned) selects cp.async; otherwise the same chunks
// move element by element with ordinary loads: correct for any head_dim, slower, and the caller's
// cp_async_wait/__syncthreads still orders them.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

namespace jax_flash::cuda::sm80 {

// 16-byte cp.async that writes zeros instead of reading when `valid` is false (src-size 0: no access).
__device__ __forceinline__ void cp_async_16_or_zero(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes));
}

// SmemLayout must be swizzled_smem_layout<kRows, kCols>(): 8-row swizzle atoms kAtomCols wide, stacked down the
// rows first. Each thread starts at (first_row, first_col) and steps kRowsPerPass rows and kAtomCols columns,
// which move its smem offset by compile-time constants (the swizzle only mixes bits inside an 8-row atom), so
// every address is one per-thread base plus an immediate and nothing per chunk stays live in registers.
template <class T, int kRows, int kCols, int kThreads, class SmemLayout>
struct TileCopy {
  static constexpr int kChunkElems = 8;
  static constexpr int kAtomCols = kCols % 64 == 0 ? 64 : 32;
  static constexpr int kThreadsPerRow = kAtomCols / kChunkElems;
  static constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  static constexpr int kPasses = kRows / kRowsPerPass;
  static constexpr int kColumnBlocks = kCols / kAtomCols;
  static_assert(kRows % kRowsPerPass == 0 && kRowsPerPass % 8 == 0, "tile must split into whole passes");
  static constexpr bool steps_match_layout() {
    const bool rows_ok = kPasses == 1 || SmemLayout{}(kRowsPerPass + 3, 8) == SmemLayout{}(3, 8) + smem_step(1, 0);
    const bool cols_ok = kColumnBlocks == 1 || SmemLayout{}(3, kAtomCols + 8) == SmemLayout{}(3, 8) + smem_step(0, 1);
    return rows_ok && cols_ok;
  }

  __device__ static int first_row() { return threadIdx.x / kThreadsPerRow; }
  __device__ static int first_col() { return (threadIdx.x % kThreadsPerRow) * kChunkElems; }
  __host__ __device__ static constexpr int smem_step(int pass, int block) {
    return pass * kRowsPerPass * kAtomCols + block * kRows * kAtomCols;
  }
  static_assert(steps_match_layout(), "smem layout is not the row-stacked swizzle this copy assumes");

  __device__ static void load(T* smem, const T* gmem, int64_t row_stride, int valid_rows, int head_dim,
                              bool vectorized) {
    const int row0 = first_row();
    const int col0 = first_col();
    T* smem_base = smem + SmemLayout{}(row0, col0);
    const T* gmem_base = gmem + row0 * row_stride + col0;
    const int64_t pass_stride = kRowsPerPass * row_stride;
    if (vectorized) {
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        CUTE_UNROLL
        for (int block = 0; block < kColumnBlocks; ++block) {
          const bool valid = row0 + pass * kRowsPerPass < valid_rows && col0 + block * kAtomCols < head_dim;
          const T* src = gmem_base + pass * pass_stride + block * kAtomCols;
          cp_async_16_or_zero(smem_base + smem_step(pass, block), valid ? src : gmem, valid);
        }
      }
      return;
    }
    for (int pass = 0; pass < kPasses; ++pass) {
      for (int block = 0; block < kColumnBlocks; ++block) {
        const int row = row0 + pass * kRowsPerPass;
        const int col = col0 + block * kAtomCols;
        T* dst = smem_base + smem_step(pass, block);
        const T* src = gmem_base + pass * pass_stride + block * kAtomCols;
        CUTE_UNROLL
        for (int e = 0; e < kChunkElems; ++e) {
          dst[e] = (row < valid_rows && col + e < head_dim) ? src[e] : T(0);
        }
      }
    }
  }

  __device__ static void store(T* gmem, const T* smem, int64_t row_stride, int valid_rows, int head_dim,
                               bool vectorized) {
    const int row0 = first_row();
    const int col0 = first_col();
    const T* smem_base = smem + SmemLayout{}(row0, col0);
    T* gmem_base = gmem + row0 * row_stride + col0;
    CUTE_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      CUTE_UNROLL
      for (int block = 0; block < kColumnBlocks; ++block) {
        const int row = row0 + pass * kRowsPerPass;
        const int col = col0 + block * kAtomCols;
        if (row >= valid_rows || col >= head_dim) continue;
        const T* src = smem_base + smem_step(pass, block);
        T* dst = gmem_base + pass * kRowsPerPass * row_stride + block * kAtomCols;
        if (vectorized) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
          CUTE_UNROLL
          for (int e = 0; e < kChunkElems; ++e) {
            if (col + e < head_dim) dst[e] = src[e];
          }
        }
      }
    }
  }

  // Writes zeros to the in-bounds part of the tile (outputs of rows that see no key).
  __device__ static void store_zeros(T* gmem, int64_t row_stride, int valid_rows, int head_dim) {
    for (int row = first_row(); row < valid_rows; row += kRowsPerPass) {
      for (int col = first_col(); col < head_dim; col += kAtomCols) {
        CUTE_UNROLL
        for (int e = 0; e < kChunkElems; ++e) {
          if (col + e < head_dim) gmem[row * row_stride + col + e] = T(0);
        }
      }
    }
  }
};

}  // namespace jax_flash::cuda::sm80
