// Small dense float32 GEMMs on zero-padded tiles: the only arithmetic-heavy code of the CPU kernels.
#pragma once

#include <cstdint>

namespace jax_flash::cpu {

// Rows of every tile are padded to this many floats, and tile row counts to kTileRowMultiple, so the
// register-blocked GEMM needs no edge cases.
inline constexpr int64_t kTileColumnMultiple = 16;
inline constexpr int64_t kTileRowMultiple = 4;

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// c[m][n] += sum_k a[m][k] * b[k][n]; row-major with leading dimensions lda/ldb/ldc.
// Requires m % kTileRowMultiple == 0 and n % kTileColumnMultiple == 0.
void gemm_accumulate(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                     float* c, int64_t ldc);

// dst[c][r] = src[r][c] for r < rows, c < cols.
void transpose(const float* src, int64_t src_stride, int64_t rows, int64_t cols, float* dst, int64_t dst_stride);

}  // namespace jax_flash::cpu
