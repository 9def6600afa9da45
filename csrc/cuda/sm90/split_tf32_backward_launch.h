// Host launchers of the split-TF32 backward (float32_precision="highest" on the Hopper TF32 backward passes;
// split_tf32_mma.h says what split TF32 computes): the dK/dV launcher first writes the hi and lo parts of Q, dO, K
// and V into the call's workspace (common/tf32_workspace.h backward_operand_parts), then both passes run the
// TF32 kernels with Traits::kSplitTf32 (backward_traits.h), whose TMA loads read those parts. f32/launch.h runs the
// softmax_d pre-pass before them (from the float32 dO and O themselves).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../../common/attention_params.h"
#include "../../common/tf32_workspace.h"
#include "backward_launch.h"
#include "split_tf32_prepass.h"

namespace jax_flash::cuda::sm90 {

template <int kHeadDim>
std::string launch_split_tf32_dkdv(const AttentionBackwardParams& p, cudaStream_t stream) {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the split-TF32 tiles and the workspace's head dims");
  if (p.tf32_vt == nullptr || !p.split_tf32) return "sm90 split-TF32 backward: no split-TF32 workspace";
  if (std::string err = launch_backward_operand_parts(p, p.tf32_vt, stream); !err.empty()) return err;
  return launch_dkdv_kernel<Tf32DkdvTraits<kHeadDim, true>, BackwardForm::kCommon, false>(
      p, stream, "sm90 split-TF32 dK/dV kernel launch");
}

// After launch_split_tf32_dkdv, which wrote the parts this pass reads.
template <int kHeadDim>
std::string launch_split_tf32_dq(const AttentionBackwardParams& p, cudaStream_t stream) {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the split-TF32 tiles and the workspace's head dims");
  if (p.tf32_vt == nullptr || !p.split_tf32) return "sm90 split-TF32 backward: no split-TF32 workspace";
  return launch_dq_kernel<Tf32DqTraits<kHeadDim, true>, BackwardForm::kCommon>(p, stream,
                                                                               "sm90 split-TF32 dQ kernel launch");
}

}  // namespace jax_flash::cuda::sm90
