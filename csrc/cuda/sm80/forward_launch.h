// Host launcher of the forward kernel for one (head dim, element type); instantiated once per generated .cu.
#pragma once

#include <string>

#include "../../common/attention_params.h"
#include "../common/block_range.h"
#include "forward_kernel.h"
#include "kernel_traits.h"
#include "launch_common.h"

namespace jax_flash::cuda::sm80 {

template <int kHeadDim, class Element>
std::string launch_forward(const AttentionParams& p, cudaStream_t stream) {
  using Traits = ForwardTraits<kHeadDim, Element>;
  if (std::string err = check_dense_strides(p); !err.empty()) return err;
  constexpr int kSmemBytes =
      (Traits::kQElems + 2 * Traits::kStages * Traits::kKVElems) * int(sizeof(Element));
  auto kernel = needs_general_variant(p) ? forward_kernel<Traits, true> : forward_kernel<Traits, false>;
  if (std::string err = allow_dynamic_smem(kernel, kSmemBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = grid_size(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch, &grid);
      !err.empty()) {
    return err;
  }
  if (grid == 0) return {};
  kernel<<<grid, Traits::kThreads, kSmemBytes, stream>>>(p, rows_are_16b_aligned(p));
  return last_launch_error("sm80 forward kernel launch");
}

}  // namespace jax_flash::cuda::sm80
