// Declarations of the sm80 launchers. Each (head dim, element type, direction) is defined by its own
// generated translation unit in instantiations/, so the dispatcher never compiles a kernel itself.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../../common/attention_params.h"

namespace jax_flash::cuda::sm80 {

template <int kHeadDim, class Element>
std::string launch_forward(const AttentionParams& p, cudaStream_t stream);

template <int kHeadDim, class Element>
std::string launch_backward(const AttentionBackwardParams& p, cudaStream_t stream);

}  // namespace jax_flash::cuda::sm80
