// Conversions between the storage types (float32, bfloat16, float16) and the float32 the CPU kernels compute
// in. Rows are converted a tile at a time into zero-padded float buffers, so the tile GEMMs never branch on
// edges.
#pragma once

#include <cstdint>
#include <cstring>

#include "../common/attention_params.h"

namespace jax_flash::cpu {

inline float bfloat16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &widened, sizeof(f));
  return f;
}

inline uint16_t float_to_bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

inline float float16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: renormalise
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_float16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (abs < 0x38800000u) {  // subnormal or zero in half precision
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs - 0x38000000u) >> 13);
  const uint32_t remainder = abs & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

inline int64_t element_size(ElementType type) { return type == ElementType::kFloat32 ? 4 : 2; }

// dst[r * dst_stride + c] = src[(first_row + r) * src_row_stride + c] for c < cols, zero for the padding
// columns up to dst_stride and for rows at or past `valid_rows`.
void load_rows(const void* src, ElementType type, int64_t src_row_stride, int64_t first_row, int64_t rows,
               int64_t valid_rows, int64_t cols, float* dst, int64_t dst_stride);

// The inverse, for `rows` rows of `cols` columns.
void store_rows(const float* src, int64_t src_stride, int64_t rows, int64_t cols, void* dst, ElementType type,
                int64_t dst_row_stride, int64_t first_row);

}  // namespace jax_flash::cpu
