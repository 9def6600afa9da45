// Host launchers of the float16-parts backward: float32_precision="highest" of float32 calls on the 16-bit Hopper
// backward (AttentionBackwardParams::float16_parts, jax_flash/_ffi_calls.py _uses_float16_parts_backward).
// Why: the exact SIMT backward runs at about half of XLA's "highest", and split TF32 at d=128 (one consumer
// warpgroup, transposed register loads, spills) at 0.8x of it. Float16 parts carry a float32 x as hi = fp16(x) and
// lo = fp16(x - hi), the same 11 + 11 significant bits as split TF32's parts (split_tf32_mma.h), and products as
// lo * hi + hi * lo + hi * hi at the 16-bit tensor cores' rate, with the 16-bit kernels' operand majors (no
// transposes). What float16 lacks is range: the Python side scales the operands by powers of two per (batch row,
// KV head) slice first (jax_flash/_half_operands.py, as for the TF32 mode's float16 operands), and scales the
// float32 gradients back.
// The dK/dV launcher first writes the hi and lo parts of the scaled Q, dO, K and V into the call's workspace
// (split_tf32_prepass.h launch_backward_operand_parts), then both passes run with Traits::kLowParts: the dK/dV pass
// in the split-head-dim form (DkdvSplitTraits, backward_dkdv_split_consumer.h), the dQ pass as the 16-bit one
// (DqTraits, backward_dq_kernel.h), float32 gradients stored from the accumulators. f32/launch.h runs the softmax_d
// pre-pass before them, in float32 from the scaled float32 dO and O.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include <cutlass/numeric_types.h>

#include "../../common/attention_params.h"
#include "backward_launch.h"
#include "split_tf32_prepass.h"

namespace jax_flash::cuda::sm90 {

template <int kHeadDim>
std::string launch_float16_parts_dkdv(const AttentionBackwardParams& p, cudaStream_t stream) {
  static_assert(kHeadDim == 128, "the float16-parts tiles' head dim (backward_traits.h float16_parts_dkdv_tile)");
  if (p.float16_parts == nullptr) return "sm90 float16-parts backward: no float16-parts workspace";
  if (std::string err = launch_backward_operand_parts(p, static_cast<cutlass::half_t*>(p.float16_parts), stream);
      !err.empty()) {
    return err;
  }
  return launch_dkdv_kernel<DkdvSplitTraits<kHeadDim, cutlass::half_t, float, true>, BackwardForm::kCommon, false>(
      p, stream, "sm90 float16-parts dK/dV kernel launch");
}

// After launch_float16_parts_dkdv, which wrote the parts this pass reads.
template <int kHeadDim>
std::string launch_float16_parts_dq(const AttentionBackwardParams& p, cudaStream_t stream) {
  static_assert(kHeadDim == 128, "the float16-parts tiles' head dim (backward_traits.h float16_parts_dq_tile)");
  if (p.float16_parts == nullptr) return "sm90 float16-parts backward: no float16-parts workspace";
  return launch_dq_kernel<DqTraits<kHeadDim, cutlass::half_t, float, true>, BackwardForm::kCommon>(
      p, stream, "sm90 float16-parts dQ kernel launch");
}

}  // namespace jax_flash::cuda::sm90
