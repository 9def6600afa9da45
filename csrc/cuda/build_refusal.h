// Errors of run_forward / run_backward that mean the build left the kernel out (the development switches
// JAX_FLASH_CUDA_HEAD_DIMS, JAX_FLASH_CUDA_SM90_HEAD_DIMS and JAX_FLASH_CUDA_FP16=OFF), not that the call is
// invalid or that a kernel failed. dispatch.cu writes every such message with build_refusal(), so that the
// standalone check can tell them apart and, on a narrowed build, skip those cases instead of failing them.
#pragma once

#include <string>

namespace jax_flash::cuda {

inline constexpr char kBuildRefusalPrefix[] = "this build has ";

// "this build has " + what, e.g. build_refusal("no float16 kernels (built with JAX_FLASH_CUDA_FP16=OFF)").
inline std::string build_refusal(const std::string& what) { return kBuildRefusalPrefix + what; }

inline bool is_build_refusal(const std::string& error) { return error.rfind(kBuildRefusalPrefix, 0) == 0; }

}  // namespace jax_flash::cuda
