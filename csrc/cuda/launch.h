// The boundary between the host-compiled FFI handlers (csrc/ffi/cuda_handlers.cc) and the nvcc-compiled
// kernels: plain functions, no XLA types. Each returns an empty string on success, else a message naming
// what is unsupported or what failed (the handler turns it into an ffi::Error).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../common/attention_params.h"

namespace jax_flash::cuda {

// Forward: writes p.o and p.lse. Enqueued on `stream`; never synchronises.
std::string run_forward(const AttentionParams& p, cudaStream_t stream);

// Backward: writes p.dq, p.dk, p.dv, using p.softmax_d as workspace.
std::string run_backward(const AttentionBackwardParams& p, cudaStream_t stream);

}  // namespace jax_flash::cuda
