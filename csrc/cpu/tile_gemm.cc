#include "tile_gemm.h"

#include "simd.h"

namespace jax_flash::cpu {

static_assert(kTileColumnMultiple == 16, "the GEMM keeps 16 columns of C in two 8-float vectors");

JF_VECTOR_CLONES
void gemm_accumulate(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                     float* c, int64_t ldc) {
  // A 4 x 16 block of C stays in 8 vector registers while k streams through: each step loads two vectors of B
  // and broadcasts four scalars of A to feed eight fused multiply-adds.
  constexpr int64_t R = kTileRowMultiple;
  for (int64_t i0 = 0; i0 < m; i0 += R) {
    for (int64_t j0 = 0; j0 < n; j0 += kTileColumnMultiple) {
      Float8 acc[R][2];
      for (int64_t r = 0; r < R; ++r) {
        acc[r][0] = *reinterpret_cast<const UnalignedFloat8*>(c + (i0 + r) * ldc + j0);
        acc[r][1] = *reinterpret_cast<const UnalignedFloat8*>(c + (i0 + r) * ldc + j0 + 8);
      }
      for (int64_t p = 0; p < k; ++p) {
        const Float8 b_low = *reinterpret_cast<const UnalignedFloat8*>(b + p * ldb + j0);
        const Float8 b_high = *reinterpret_cast<const UnalignedFloat8*>(b + p * ldb + j0 + 8);
        for (int64_t r = 0; r < R; ++r) {
          const float a_value = a[(i0 + r) * lda + p];
          acc[r][0] += a_value * b_low;
          acc[r][1] += a_value * b_high;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        *reinterpret_cast<UnalignedFloat8*>(c + (i0 + r) * ldc + j0) = acc[r][0];
        *reinterpret_cast<UnalignedFloat8*>(c + (i0 + r) * ldc + j0 + 8) = acc[r][1];
      }
    }
  }
}

void transpose(const float* src, int64_t src_stride, int64_t rows, int64_t cols, float* dst, int64_t dst_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
}

}  // namespace jax_flash::cpu
