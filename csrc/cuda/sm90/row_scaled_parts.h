// The float16-parts backward's score gradients (float16_parts_backward_launch.h), scaled row by row before their
// split into float16 parts. Why: a float16 lo part is a subnormal, with absolute spacing 2^-24, wherever its value
// is below ~2^-3, and dS spans a range no one static scale covers: the Python side can only bound it (Cauchy-Schwarz,
// P <= 1), while spread attention over N keys makes a typical element ~N sqrt(head_dim) times smaller than that
// bound. Scaled statically, dS's lo parts were subnormal from a few thousand keys on (an emulation put dq 1.5e-5 off
// at 64k keys, tests/test_float16_parts.py). So each row of a tile (dQ pass: a query's keys; dK/dV pass: a key's
// queries, which is the row dK is formed from) is multiplied by 2^(kScoreGradRowExponent - e), e = floor(log2) of the
// row's largest magnitude, and the GEMM's partial row by 2^(e - kScoreGradRowExponent) before it joins the total:
// a power of two either way, so exact, and the rows' partial sums are independent (dQ_i = sum_j dS_ij K_j).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "../sm80/fragments.h"
#include "fragments.h"

namespace jax_flash::cuda::sm90 {

// A row's largest magnitude lands in [2^12, 2^13): hi parts far below float16's largest (65504), lo parts normal
// down to elements ~2^-15 of it.
constexpr int kScoreGradRowExponent = 12;

// floor(log2 x) of a row maximum x >= 0, within [-100, 100] (so that both scales are normal float32); 0 for zero,
// subnormal and non-finite maxima (a row of zeros needs no scale; an infinite or NaN one propagates as it is).
__device__ __forceinline__ int row_max_exponent(float x) {
  const int biased = static_cast<int>((__float_as_uint(x) >> 23) & 0xffu);
  if (biased == 0 || biased == 255) return 0;
  return max(-100, min(100, biased - 127));
}

// 2^e, exactly, for e in [-126, 127].
__device__ __forceinline__ float power_of_two(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }

// The exponents of this thread's rows of `rows` (a rows x cols view of float32 accumulators, each row held by one
// quad): the quad's largest magnitude per row.
template <int kRows, class Rows>
__device__ __forceinline__ void quad_row_exponents(Rows const& rows, int (&exponents)[kRows]) {
  static_assert(decltype(cute::size<0>(rows))::value == kRows);
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float largest = 0.0f;
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(rows); ++c) largest = fmaxf(largest, fabsf(rows(r, c)));
    exponents[r] = row_max_exponent(sm80::quad_allreduce(largest, [](float a, float b) { return fmaxf(a, b); }));
  }
}

// rows(r, c) *= 2^(kScoreGradRowExponent - exponents[r]).
template <int kRows, class Rows>
__device__ __forceinline__ void scale_rows_for_parts(Rows& rows, const int (&exponents)[kRows]) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float scale = power_of_two(kScoreGradRowExponent - exponents[r]);
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(rows); ++c) rows(r, c) *= scale;
  }
}

// total += partial with row r multiplied back by 2^(exponents[r] - kScoreGradRowExponent): split_tf32_mma.h
// add_partial_sums for a GEMM whose A operand was scaled by scale_rows_for_parts (the accumulators' rows are the A
// operand's rows: both are the M of 64-row WGMMAs of the same warpgroup).
template <int kRows, class Total, class Partial>
__device__ __forceinline__ void add_row_scaled_partial(Total& total, Partial& partial, const int (&exponents)[kRows]) {
  cute::warpgroup_fence_operand(partial);  // read after the WGMMA that wrote it has retired
  auto total_rows = sm80::as_rows_cols(sm80_view(total));
  auto partial_rows = sm80::as_rows_cols(sm80_view(partial));
  static_assert(decltype(cute::size<0>(total_rows))::value == kRows);
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float scale = power_of_two(exponents[r] - kScoreGradRowExponent);
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(total_rows); ++c) total_rows(r, c) += partial_rows(r, c) * scale;
  }
}

}  // namespace jax_flash::cuda::sm90
