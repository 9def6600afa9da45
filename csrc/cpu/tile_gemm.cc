#include "tile_gemm.h"

namespace jax_flash::cpu {

// Built twice on x86-64 (AVX2+FMA and baseline) and picked at load time, so one binary is fast on modern CPUs
// and still runs everywhere.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JF_VECTOR_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define JF_VECTOR_CLONES
#endif

JF_VECTOR_CLONES
void gemm_accumulate(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                     float* c, int64_t ldc) {
  // A 4 x 16 block of C stays in registers while k streams through: 4 broadcasts and 16 loads of B feed 64
  // multiply-adds.
  constexpr int64_t R = kTileRowMultiple;
  constexpr int64_t C = kTileColumnMultiple;
  for (int64_t i0 = 0; i0 < m; i0 += R) {
    for (int64_t j0 = 0; j0 < n; j0 += C) {
      float acc[R][C];
      for (int64_t r = 0; r < R; ++r)
        for (int64_t cc = 0; cc < C; ++cc) acc[r][cc] = c[(i0 + r) * ldc + j0 + cc];
      for (int64_t p = 0; p < k; ++p) {
        const float* b_row = b + p * ldb + j0;
        for (int64_t r = 0; r < R; ++r) {
          const float a_value = a[(i0 + r) * lda + p];
          for (int64_t cc = 0; cc < C; ++cc) acc[r][cc] += a_value * b_row[cc];
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t cc = 0; cc < C; ++cc) c[(i0 + r) * ldc + j0 + cc] = acc[r][cc];
    }
  }
}

void transpose(const float* src, int64_t src_stride, int64_t rows, int64_t cols, float* dst, int64_t dst_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
}

}  // namespace jax_flash::cpu
