#include "row_ops.h"

#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JF_VECTOR_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define JF_VECTOR_CLONES
#endif

namespace jax_flash::cpu {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 by range reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6 polynomial for e^r
// (relative error about 2e-7). Below the float range the result is exactly 0, which also covers -inf.
inline float exp_non_positive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693359375f;  // ln2 split in two so n * kLn2High is exact
  constexpr float kLn2Low = -2.12194440e-4f;
  const bool underflow = x < -87.0f;
  const float clamped = underflow ? -87.0f : x;
  // Round to nearest by truncating y - 0.5 (y <= 0), which vectorises where nearbyint would not.
  const float n = static_cast<float>(static_cast<int32_t>(clamped * kLog2e - 0.5f));
  const float r = (clamped - n * kLn2High) - n * kLn2Low;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent_bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

}  // namespace

void score_row(const SliceMask& mask, const ScoreSettings& settings, int64_t i, int64_t j0, int64_t valid_cols,
               int64_t tile_cols, const float* dots, float* scores, float* softcap_grad) {
  int64_t lo = mask.key_begin(i) - j0;
  int64_t hi = mask.key_end(i) - j0;
  if (lo < 0) lo = 0;
  if (hi > valid_cols) hi = valid_cols;
  for (int64_t c = 0; c < tile_cols; ++c) {
    const int64_t j = j0 + c;
    const bool visible = c >= lo && c < hi &&
                         (mask.q_segment_ids == nullptr || mask.q_segment_ids[i] == mask.kv_segment_ids[j]);
    float grad = 0.0f;
    const float s = visible ? transform_score(dots[c], settings.softmax_scale, settings.softcap, mask.alibi_slope,
                                              i, j, mask.diagonal_shift, &grad)
                            : kNegativeInfinity;
    scores[c] = s;
    if (softcap_grad) softcap_grad[c] = visible ? grad : 0.0f;
  }
}

JF_VECTOR_CLONES
float exp_shifted_and_sum(float* row, int64_t n, float shift) {
  float sum = 0.0f;
  for (int64_t c = 0; c < n; ++c) {
    const float e = exp_non_positive(row[c] - shift);
    row[c] = e;
    sum += e;
  }
  return sum;
}

JF_VECTOR_CLONES
float row_max(const float* row, int64_t n) {
  float m = kNegativeInfinity;
  for (int64_t c = 0; c < n; ++c) m = row[c] > m ? row[c] : m;
  return m;
}

}  // namespace jax_flash::cpu
