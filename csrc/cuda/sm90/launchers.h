// Declarations of the Hopper (sm_90a) launchers; each (direction, head dim, element type) is defined by its own
// generated translation unit in instantiations/, compiled only when the build targets sm_90a.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../../common/attention_params.h"

namespace jax_flash::cuda::sm90 {

// Element bf16 / fp16, or cutlass::tfloat32_t: float32 calls on TF32 tensor cores (head dims 64 and 128), with the
// V^T workspace (forward_launch.h).
template <int kHeadDim, class Element>
std::string launch_forward(const AttentionParams& p, cudaStream_t stream);

// Split TF32 (float32_precision="highest" with the split-TF32 workspace; head dims 64 and 128, built with the TF32
// forward): split_tf32_launch.h.
template <int kHeadDim>
std::string launch_split_tf32_forward(const AttentionParams& p, cudaStream_t stream);

// The Hopper backward (backward_traits.h); dispatch.cu runs it on 9.x for the calls it supports
// (sm90_backward_refusal), JAX_FLASH_CUDA_KERNEL_BACKWARD forces either family.
// Built head dims: the generated built_sm90_head_dims.h (CMakeLists.txt), read by dispatch.cu.
// OutElement: the gradients' type, Element, or float for float16 operands with float32 gradients
// (AttentionBackwardParams::float32_gradients; built for every backward head dim whatever JAX_FLASH_CUDA_FP16 says).
template <int kHeadDim, class Element, class OutElement>
std::string launch_backward(const AttentionBackwardParams& p, cudaStream_t stream);

// The TF32 dK/dV and dQ passes of a float32 backward (head dims 64 and 128, built with the TF32 forward);
// f32::launch_backward runs them in place of its own when dispatch.cu hands them over
// (JAX_FLASH_CUDA_KERNEL_F32_BACKWARD).
template <int kHeadDim>
std::string launch_tf32_dkdv(const AttentionBackwardParams& p, cudaStream_t stream);
template <int kHeadDim>
std::string launch_tf32_dq(const AttentionBackwardParams& p, cudaStream_t stream);
// Their split-TF32 forms (float32_precision="highest" with the split-TF32 workspace; split_tf32_backward_launch.h),
// the dK/dV launcher first writing the operands' parts.
template <int kHeadDim>
std::string launch_split_tf32_dkdv(const AttentionBackwardParams& p, cudaStream_t stream);
template <int kHeadDim>
std::string launch_split_tf32_dq(const AttentionBackwardParams& p, cudaStream_t stream);
// The float16-parts backward (float32_precision="highest" with the float16-parts workspace,
// AttentionBackwardParams::float16_parts; float16_parts_backward_launch.h): head dim 128, built with the 16-bit
// backward of that head dim; the dK/dV launcher first writing the operands' parts.
template <int kHeadDim>
std::string launch_float16_parts_dkdv(const AttentionBackwardParams& p, cudaStream_t stream);
template <int kHeadDim>
std::string launch_float16_parts_dq(const AttentionBackwardParams& p, cudaStream_t stream);

}  // namespace jax_flash::cuda::sm90
