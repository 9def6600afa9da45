#include "buffer_checks.h"

#include <sstream>

namespace jax_flash::ffi_boundary {

std::string format_dims(ffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
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
  message << "jax_flash: buffer `" << name << "` has shape " << format_dims(dims) << " and type code "
          << static_cast<int>(buffer.element_type()) << "; expected shape "
          << format_dims(ffi::Span<const int64_t>(expected.data(), expected.size())) << " and type code "
          << static_cast<int>(type);
  return ffi::Error::InvalidArgument(message.str());
}

std::optional<ffi::Error> expect_optional(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType type,
                                          const std::vector<int64_t>& batch_dims, int64_t present_size,
                                          bool* present) {
  const auto dims = buffer.dimensions();
  *present = dims.size() == batch_dims.size() + 1 && dims.back() != 0;
  return expect_buffer(name, buffer, type, batch_dims, {*present ? present_size : 0});
}

}  // namespace jax_flash::ffi_boundary
