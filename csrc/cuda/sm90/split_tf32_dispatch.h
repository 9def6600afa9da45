// launch_split_tf32_forward: the split-TF32 forward's kernel form for a call (forward_variant.h); each form's
// launcher (split_tf32_launch.h) is its own translation unit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "../../common/attention_params.h"
#include "forward_variant.h"

namespace jax_flash::cuda::sm90 {

template <int kHeadDim, ForwardVariant kVariant>
std::string launch_split_tf32_variant(const AttentionParams& p, cudaStream_t stream);

template <int kHeadDim>
std::string launch_split_tf32_forward(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch > INT32_MAX || p.heads_q > INT32_MAX) return "sm90 forward: batch or heads beyond TMA coordinates";
  switch (forward_variant(p)) {
    case ForwardVariant::kCommon:
      return launch_split_tf32_variant<kHeadDim, ForwardVariant::kCommon>(p, stream);
    case ForwardVariant::kTransforms:
      return launch_split_tf32_variant<kHeadDim, ForwardVariant::kTransforms>(p, stream);
    case ForwardVariant::kDense:
      return launch_split_tf32_variant<kHeadDim, ForwardVariant::kDense>(p, stream);
  }
  return "sm90 split-TF32 forward: unknown kernel form";
}

}  // namespace jax_flash::cuda::sm90
