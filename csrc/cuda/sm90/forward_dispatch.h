// launch_forward for one (head dim, element type): picks the kernel form a call needs (forward_variant.h). Each
// form's launcher (forward_launch.h) is instantiated in a translation unit of its own, so a build compiles the three
// forms of a head dim in parallel rather than one after another in a single long unit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "../../common/attention_params.h"
#include "forward_variant.h"

namespace jax_flash::cuda::sm90 {

// Defined in forward_launch.h; instantiated by instantiations/forward_hdim{D}_{type}_{form}.cu.
template <int kHeadDim, class Element, ForwardVariant kVariant>
std::string launch_forward_variant(const AttentionParams& p, cudaStream_t stream);

template <int kHeadDim, class Element>
std::string launch_forward(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch > INT32_MAX || p.heads_q > INT32_MAX) return "sm90 forward: batch or heads beyond TMA coordinates";
  switch (forward_variant(p)) {
    case ForwardVariant::kCommon:
      return launch_forward_variant<kHeadDim, Element, ForwardVariant::kCommon>(p, stream);
    case ForwardVariant::kTransforms:
      return launch_forward_variant<kHeadDim, Element, ForwardVariant::kTransforms>(p, stream);
    case ForwardVariant::kDense:
      return launch_forward_variant<kHeadDim, Element, ForwardVariant::kDense>(p, stream);
  }
  return "sm90 forward: unknown kernel form";
}

}  // namespace jax_flash::cuda::sm90
