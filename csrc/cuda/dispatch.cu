// run_forward / run_backward: check what the GPU kernels support, then turn the runtime element type and head
// dim into the template arguments of one generated instantiation. The set of built head dims comes from the
// build (JAX_FLASH_CUDA_HEAD_DIMS -> generated built_head_dims.h); a head dim runs on the smallest built one
// that is at least as large, its extra columns zero-filled on load and never stored.
#include <cutlass/numeric_types.h>

#include <string>

#include "launch.h"
#include "f32/launchers.h"
#include "sm80/launchers.h"

#if __has_include("built_head_dims.h")
#include "built_head_dims.h"
#else
#define JAX_FLASH_CUDA_HEAD_DIM_LIST 32, 64, 96, 128, 192, 256
#endif

namespace jax_flash::cuda {
namespace {

constexpr int kBuiltHeadDims[] = {JAX_FLASH_CUDA_HEAD_DIM_LIST};

constexpr bool is_built(int head_dim) {
  for (int d : kBuiltHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

int padded_head_dim(int64_t head_dim) {
  int best = 0;
  for (int d : kBuiltHeadDims) {
    if (d >= head_dim && (best == 0 || d < best)) best = d;
  }
  return best;
}

std::string check_supported(const AttentionParams& p) {
  if (p.element_type != ElementType::kFloat32 && p.element_type != ElementType::kBFloat16 &&
      p.element_type != ElementType::kFloat16) {
    return "unknown element type";
  }
  if (p.head_dim <= 0 || padded_head_dim(p.head_dim) == 0) {
    return "head_dim " + std::to_string(p.head_dim) + " is larger than every head dim this build has kernels for";
  }
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return "heads_q must be a multiple of heads_kv";
  if (p.seqlen_q >= (int64_t(1) << 31) || p.seqlen_k >= (int64_t(1) << 31)) {
    return "sequence lengths must be below 2^31";
  }
  if (p.bias != nullptr) return "an additive bias is not supported by the CUDA kernels yet";
  if (p.mask != nullptr) return "a boolean mask is not supported by the CUDA kernels yet";
  if (p.dropout_rate > 0.0f) return "dropout is not supported by the CUDA kernels yet";
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) {
    return "q_segment_ids and kv_segment_ids must be given together";
  }
  return {};
}

// o and lse are empty.
bool nothing_to_do(const AttentionParams& p) { return p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0; }

// Calls launch(int_constant<D>, element) for the built head dim D that `head_dim` runs on.
template <class Launch>
std::string with_head_dim(int head_dim, Launch&& launch) {
  std::string result = "internal error: no kernel for head dim " + std::to_string(head_dim);
  auto try_dim = [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    if constexpr (is_built(kDim)) {
      if (kDim == head_dim) result = launch(dim);
    }
  };
  try_dim(std::integral_constant<int, 32>{});
  try_dim(std::integral_constant<int, 64>{});
  try_dim(std::integral_constant<int, 96>{});
  try_dim(std::integral_constant<int, 128>{});
  try_dim(std::integral_constant<int, 192>{});
  try_dim(std::integral_constant<int, 256>{});
  return result;
}

}  // namespace

std::string run_forward(const AttentionParams& p, cudaStream_t stream) {
  if (std::string err = check_supported(p); !err.empty()) return err;
  if (nothing_to_do(p)) return {};
  if (p.element_type == ElementType::kFloat32) {
    return with_head_dim(padded_head_dim(p.head_dim), [&](auto dim) {
      return f32::launch_forward<decltype(dim)::value>(p, stream);
    });
  }
  const bool bf16 = p.element_type == ElementType::kBFloat16;
  return with_head_dim(padded_head_dim(p.head_dim), [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    return bf16 ? sm80::launch_forward<kDim, cutlass::bfloat16_t>(p, stream)
                : sm80::launch_forward<kDim, cutlass::half_t>(p, stream);
  });
}

std::string run_backward(const AttentionBackwardParams& p, cudaStream_t stream) {
  if (std::string err = check_supported(p); !err.empty()) return err;
  if (p.batch == 0 || p.heads_q == 0) return {};  // empty seqlens still need zero dK/dV or dQ
  if (p.element_type == ElementType::kFloat32) {
    return with_head_dim(padded_head_dim(p.head_dim), [&](auto dim) {
      return f32::launch_backward<decltype(dim)::value>(p, stream);
    });
  }
  const bool bf16 = p.element_type == ElementType::kBFloat16;
  return with_head_dim(padded_head_dim(p.head_dim), [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    return bf16 ? sm80::launch_backward<kDim, cutlass::bfloat16_t>(p, stream)
                : sm80::launch_backward<kDim, cutlass::half_t>(p, stream);
  });
}

}  // namespace jax_flash::cuda
