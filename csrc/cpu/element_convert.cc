#include "element_convert.h"

#include <algorithm>

namespace jax_flash::cpu {

void load_rows(const void* src, ElementType type, int64_t src_row_stride, int64_t first_row, int64_t rows,
               int64_t valid_rows, int64_t cols, float* dst, int64_t dst_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    float* out = dst + r * dst_stride;
    const int64_t row = first_row + r;
    if (row >= valid_rows) {
      std::fill(out, out + dst_stride, 0.0f);
      continue;
    }
    const int64_t offset = row * src_row_stride;
    switch (type) {
      case ElementType::kFloat32: {
        const float* in = static_cast<const float*>(src) + offset;
        std::copy(in, in + cols, out);
        break;
      }
      case ElementType::kBFloat16: {
        const uint16_t* in = static_cast<const uint16_t*>(src) + offset;
        for (int64_t c = 0; c < cols; ++c) out[c] = bfloat16_to_float(in[c]);
        break;
      }
      case ElementType::kFloat16: {
        const uint16_t* in = static_cast<const uint16_t*>(src) + offset;
        for (int64_t c = 0; c < cols; ++c) out[c] = float16_to_float(in[c]);
        break;
      }
    }
    std::fill(out + cols, out + dst_stride, 0.0f);
  }
}

void store_rows(const float* src, int64_t src_stride, int64_t rows, int64_t cols, void* dst, ElementType type,
                int64_t dst_row_stride, int64_t first_row) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = src + r * src_stride;
    const int64_t offset = (first_row + r) * dst_row_stride;
    switch (type) {
      case ElementType::kFloat32:
        std::copy(in, in + cols, static_cast<float*>(dst) + offset);
        break;
      case ElementType::kBFloat16: {
        uint16_t* out = static_cast<uint16_t*>(dst) + offset;
        for (int64_t c = 0; c < cols; ++c) out[c] = float_to_bfloat16(in[c]);
        break;
      }
      case ElementType::kFloat16: {
        uint16_t* out = static_cast<uint16_t*>(dst) + offset;
        for (int64_t c = 0; c < cols; ++c) out[c] = float_to_float16(in[c]);
        break;
      }
    }
  }
}

}  // namespace jax_flash::cpu
