// Declarations of the float32 launchers. Each (head dim, direction) is defined by its own generated translation
// unit in instantiations/ (csrc/cuda/generate_instantiations.py), so the dispatcher never compiles a kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../../common/attention_params.h"

namespace jax_flash::cuda::f32 {

// Exact float32: every product and sum is a float32 FMA (no tensor cores).
template <int kHeadDim>
std::string launch_forward(const AttentionParams& p, cudaStream_t stream);

template <int kHeadDim>
std::string launch_backward(const AttentionBackwardParams& p, cudaStream_t stream);

}  // namespace jax_flash::cuda::f32
