// Host launch of the softmax_d pre-pass (backward_row_kernels.h), shared by every family's backward: each passes its
// own kernel wrapping softmax_d_rows<T>.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "../../common/attention_params.h"
#include "backward_row_kernels.h"
#include "launch_common.h"

namespace jax_flash::cuda::sm80 {

template <class T>
std::string launch_softmax_d(const AttentionBackwardParams& p, void (*kernel)(const AttentionBackwardParams),
                             cudaStream_t stream, const char* family) {
  const int64_t blocks = softmax_d_blocks<T>(p);
  if (blocks > INT32_MAX) return "attention problem too large for one launch (more than 2^31 - 1 CTAs)";
  if (blocks == 0) return {};
  kernel<<<static_cast<unsigned>(blocks), kRowKernelWarps * 32, 0, stream>>>(p);
  return last_launch_error((std::string(family) + " softmax_d kernel launch").c_str());
}

}  // namespace jax_flash::cuda::sm80
