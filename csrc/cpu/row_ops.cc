#include "row_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "simd.h"

namespace jax_flash::cpu {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

typedef int32_t Int8 __attribute__((vector_size(32)));

}  // namespace

void score_row(const SliceMask& mask, const ScoreSettings& settings, int64_t i, int64_t j0, int64_t valid_cols,
               int64_t tile_cols, const float* dots, float* scores, float* softcap_grad) {
  const int64_t lo = std::clamp<int64_t>(mask.key_begin(i) - j0, 0, tile_cols);
  const int64_t hi = std::clamp<int64_t>(std::min(mask.key_end(i) - j0, valid_cols), lo, tile_cols);
  // Same arithmetic as transform_score (the shared pipeline), split into passes so the common case (scale
  // only) vectorises; the optional steps run only when enabled.
  for (int64_t c = lo; c < hi; ++c) scores[c] = dots[c] * settings.softmax_scale;
  if (settings.softcap > 0.0f) {
    for (int64_t c = lo; c < hi; ++c) {
      const float t = std::tanh(scores[c] / settings.softcap);
      scores[c] = settings.softcap * t;
      if (softcap_grad) softcap_grad[c] = 1.0f - t * t;
    }
  } else if (softcap_grad) {
    std::fill(softcap_grad + lo, softcap_grad + hi, 1.0f);
  }
  if (mask.alibi_slope != 0.0f) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t distance = i + mask.diagonal_shift - (j0 + c);
      scores[c] -= mask.alibi_slope * static_cast<float>(distance < 0 ? -distance : distance);
    }
  }
  if (mask.bias != nullptr) {
    for (int64_t c = lo; c < hi; ++c) scores[c] += mask.bias_at(i, j0 + c);
  }
  if (mask.mask != nullptr) {
    for (int64_t c = lo; c < hi; ++c)
      if (!mask.mask_allows(i, j0 + c)) scores[c] = kNegativeInfinity;
  }
  if (mask.q_segment_ids != nullptr) {
    const int32_t segment = mask.q_segment_ids[i];
    for (int64_t c = lo; c < hi; ++c)
      if (mask.kv_segment_ids[j0 + c] != segment) scores[c] = kNegativeInfinity;
  }
  std::fill(scores, scores + lo, kNegativeInfinity);
  std::fill(scores + hi, scores + tile_cols, kNegativeInfinity);
  if (softcap_grad) {
    std::fill(softcap_grad, softcap_grad + lo, 0.0f);
    std::fill(softcap_grad + hi, softcap_grad + tile_cols, 0.0f);
  }
}

// exp(x), eight at a time: range reduction x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r
// (relative error about 2e-7), and 2^n built in the exponent bits. Inputs below -87 (including -inf) give exactly
// 0, above 88 infinity. Mostly x <= 0 (scores less their row's max or lse), but the scaled backwards shift lse
// down (jax_flash/_half_operands.py: P' = 2^7 P), so x reaches 7 ln 2: n rounds to nearest on both sides of 0
// (rounding it down there left r up to 1.5 ln2, where the polynomial is off by ~5e-5).
JF_VECTOR_CLONES
float exp_shifted_and_sum(float* row, int64_t n, float shift) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693359375f;  // ln2 split in two so that n * kLn2High is exact
  constexpr float kLn2Low = -2.12194440e-4f;
  Float8 sum8 = Float8{} + 0.0f;
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const Float8 x = *reinterpret_cast<const UnalignedFloat8*>(row + c) - shift;
    const Int8 underflow = x < -87.0f;
    const Int8 overflow = x > 88.0f;
    const Float8 clamped = underflow ? Float8{} - 87.0f : overflow ? Float8{} + 88.0f : x;
    // Round to nearest by truncating y - 0.5 for y <= 0, y + 0.5 for y > 0.
    const Float8 y = clamped * kLog2e;
    const Int8 n_int = __builtin_convertvector(y + (y > 0.0f ? Float8{} + 0.5f : Float8{} - 0.5f), Int8);
    const Float8 n_float = __builtin_convertvector(n_int, Float8);
    const Float8 r = (clamped - n_float * kLn2High) - n_float * kLn2Low;
    Float8 p = Float8{} + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const Int8 exponent_bits = (n_int + 127) << 23;
    const Float8 e = underflow ? Float8{}
                     : overflow  ? Float8{} + std::numeric_limits<float>::infinity()
                                 : p * __builtin_bit_cast(Float8, exponent_bits);
    *reinterpret_cast<UnalignedFloat8*>(row + c) = e;
    sum8 += e;
  }
  float sum = 0.0f;
  for (int lane = 0; lane < 8; ++lane) sum += sum8[lane];
  for (; c < n; ++c) {
    const float e = std::exp(row[c] - shift);
    row[c] = e;
    sum += e;
  }
  return sum;
}

// dropout_keeps of common/philox.h, element by element; keys j and j + 1 (j even) share a Philox call, so a
// call is reused while the column's call stays the same.
void dropout_row(const DropoutRow& dropout, int64_t j0, int64_t n, float* row) {
  const float keep_scale = 1.0f / (1.0f - dropout.rate);
  PhiloxWords words{};
  int64_t words_column = -1;  // the call column J that `words` belong to
  for (int64_t c = 0; c < n; ++c) {
    const int64_t j = j0 + c;
    if (dropout_call_column(j) != words_column) {
      words = dropout_call(dropout.seed, dropout.head, dropout.row, j);
      words_column = dropout_call_column(j);
    }
    const bool kept = dropout_draw_keeps(words.w[dropout_word(dropout.row, j)], dropout_half(j), dropout.threshold);
    row[c] = kept ? row[c] * keep_scale : 0.0f;
  }
}

JF_VECTOR_CLONES
float row_max(const float* row, int64_t n) {
  float m = kNegativeInfinity;
  for (int64_t c = 0; c < n; ++c) m = row[c] > m ? row[c] : m;
  return m;
}

}  // namespace jax_flash::cpu
