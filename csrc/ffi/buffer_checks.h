// Re-checking the buffers XLA hands a handler. The Python layer validates first; these checks make sure a
// raw call of the custom-call target with inconsistent buffers is an ffi::Error, never an out-of-bounds access.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "../common/attention_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_boundary {

namespace ffi = xla::ffi;

// "[2, 3, 4]", for messages.
std::string format_dims(ffi::Span<const int64_t> dims);
std::string dtype_name(ffi::DataType type);

// The leading (batch) axes of a rank >= 4 tensor; vmap folds into them.
std::vector<int64_t> batch_prefix(const ffi::AnyBuffer& tensor);

// An error naming `name` unless `buffer` has this element type and dimensions batch_dims + trailing.
std::optional<ffi::Error> expect_buffer(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType type,
                                        const std::vector<int64_t>& batch_dims,
                                        std::initializer_list<int64_t> trailing);

// An optional operand: present when its last axis is `present_size`, absent when it is 0 (the Python layer
// passes a zero-size placeholder so that every call has the same operands).
std::optional<ffi::Error> expect_optional(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType type,
                                          const std::vector<int64_t>& batch_dims, int64_t present_size,
                                          bool* present);

// A dense operand broadcastable to [batch, heads_q, seqlen_q, seqlen_k]: its dims are q's vmap axes followed by
// four axes, each 1 or full size; absent when its last axis is 0. Fills the element strides (0 where broadcast).
std::optional<ffi::Error> expect_broadcastable(const char* name, const ffi::AnyBuffer& buffer, ffi::DataType type,
                                               const std::vector<int64_t>& vmap_dims,
                                               const int64_t (&full)[4], bool* present,
                                               BroadcastStrides* strides);

// The block summary of a dense mask (common/mask_blocks.h): uint8, the mask's dims with its last two counted in
// blocks (size-1 axes stay 1), or the absent placeholder [*vmap, 1, 1, 1, 0] exactly when the mask is absent.
// Fills the byte strides (0 along size-1 axes).
std::optional<ffi::Error> expect_mask_blocks(const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& mask,
                                             bool mask_present, const std::vector<int64_t>& vmap_dims,
                                             BroadcastStrides* strides);

}  // namespace jax_flash::ffi_boundary
