#include "buffer_checks.h"

#include <sstream>

#include "../common/mask_blocks.h"

namespace jax_flash::ffi_boundary {

std::string format_dims(ffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

// A buffer type as JAX spells the dtype (what the caller passed), else XLA's type code.
std::string dtype_name(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    default: return "type code " + std::to_string(static_cast<int>(type));
  }
}

std::vector<int64_t> batch_prefix(const ffi::AnyBuffer& tensor) {
  const auto dims = tensor.dimensions();
  return std::vector<int64_t>(dims.begin(), dims.end() - 3);
}

std::optional<ffi::Error> expect_buffer(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType type,
                                        const std::vector<int64_t>& batch_dims,
                                        std::initializer_list<int64_t> trailing) {
  std::vector<int64_t> expected(batch_dims);
  expected.insert(expected.end(), trailing.begin(), trailing.end());
  const auto dims = buffer.dimensions();
  const bool same_dims = std::vector<int64_t>(dims.begin(), dims.end()) == expected;
  if (buffer.element_type() == type && same_dims) return std::nullopt;
  std::ostringstream message;
  message << "jax_flash: buffer `" << name << "` has shape " << format_dims(dims) << " and dtype "
          << dtype_name(buffer.element_type()) << "; expected shape "
          << format_dims(ffi::Span<const int64_t>(expected.data(), expected.size())) << " and dtype "
          << dtype_name(type);
  return ffi::Error::InvalidArgument(message.str());
}

std::optional<ffi::Error> expect_optional(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType type,
                                          const std::vector<int64_t>& batch_dims, int64_t present_size,
                                          bool* present) {
  const auto dims = buffer.dimensions();
  *present = dims.size() == batch_dims.size() + 1 && dims.back() != 0;
  return expect_buffer(name, buffer, type, batch_dims, {*present ? present_size : 0});
}

std::optional<ffi::Error> expect_broadcastable(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType type,
                                               const std::vector<int64_t>& vmap_dims,
                                               const int64_t (&full)[4], bool* present,
                                               BroadcastStrides* strides) {
  const auto dims = buffer.dimensions();
  const size_t rank = vmap_dims.size() + 4;
  *present = dims.size() == rank && dims.back() != 0;
  if (!*present) return expect_buffer(name, buffer, type, vmap_dims, {1, 1, 1, 0});
  bool ok = buffer.element_type() == type &&
            std::vector<int64_t>(dims.begin(), dims.begin() + vmap_dims.size()) == vmap_dims;
  int64_t axis_strides[4];
  int64_t stride = 1;
  for (int axis = 3; axis >= 0; --axis) {
    const int64_t size = dims[vmap_dims.size() + axis];
    ok = ok && (size == 1 || size == full[axis]);
    axis_strides[axis] = size == 1 ? 0 : stride;
    stride *= size;
  }
  if (!ok) {
    std::ostringstream message;
    message << "jax_flash: buffer `" << name << "` has shape " << format_dims(dims) << " and dtype "
            << dtype_name(buffer.element_type()) << "; expected the vmap axes "
            << format_dims(ffi::Span<const int64_t>(vmap_dims.data(), vmap_dims.size()))
            << " followed by four axes broadcastable to "
            << format_dims(ffi::Span<const int64_t>(full, 4)) << ", dtype " << dtype_name(type);
    return ffi::Error::InvalidArgument(message.str());
  }
  *strides = {stride, axis_strides[0], axis_strides[1], axis_strides[2], axis_strides[3]};
  return std::nullopt;
}

std::optional<ffi::Error> expect_mask_blocks(const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& mask,
                                             bool mask_present, const std::vector<int64_t>& vmap_dims,
                                             BroadcastStrides* strides) {
  if (!mask_present) return expect_buffer("mask_blocks", buffer, ffi::DataType::U8, vmap_dims, {1, 1, 1, 0});
  const auto mask_dims = mask.dimensions();
  const size_t lead = mask_dims.size() - 2;
  const int64_t mask_batch = mask_dims[lead - 2], mask_heads = mask_dims[lead - 1];
  const int64_t query_blocks = mask_blocks_along(mask_dims[lead]);
  const int64_t key_blocks = mask_blocks_along(mask_dims[lead + 1]);
  if (auto error = expect_buffer("mask_blocks", buffer, ffi::DataType::U8, vmap_dims,
                                 {mask_batch, mask_heads, query_blocks, key_blocks})) {
    return error;
  }
  const int64_t sizes[4] = {mask_batch, mask_heads, query_blocks, key_blocks};
  int64_t axis_strides[4];
  int64_t stride = 1;
  for (int axis = 3; axis >= 0; --axis) {
    axis_strides[axis] = sizes[axis] == 1 ? 0 : stride;
    stride *= sizes[axis];
  }
  *strides = {stride, axis_strides[0], axis_strides[1], axis_strides[2], axis_strides[3]};
  return std::nullopt;
}

}  // namespace jax_flash::ffi_boundary
