// The split-TF32 kernels' pre-pass (common/tf32_workspace.h): each operand's hi and lo parts written into the call's
// workspace, where the kernels' TMA loads read them.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "../../common/tf32_workspace.h"
#include "../sm80/launch_common.h"
#include "split_tf32_mma.h"

namespace jax_flash::cuda::sm90 {

// hi and lo parts of `count4` float4s (x, hi and lo 16-byte aligned). A template so that the header can be included
// by several translation units.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) split_tf32_kernel(const float4* x, float4* hi, float4* lo, int64_t count4) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < count4; i += int64_t(gridDim.x) * kThreads) {
    const float4 v = x[i];
    float4 h, l;
    split_to_tf32(v.x, h.x, l.x);
    split_to_tf32(v.y, h.y, l.y);
    split_to_tf32(v.z, h.z, l.z);
    split_to_tf32(v.w, h.w, l.w);
    hi[i] = h;
    lo[i] = l;
  }
}

// Writes the parts of `count` floats (a multiple of 4: head_dim is) of x on `stream`.
inline std::string launch_split_tf32(const void* x, OperandParts parts, int64_t count, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t count4 = count / 4;
  if (count4 == 0) return {};
  // A grid-stride loop over at most the CTAs the device holds at once (cached per device): enough to saturate DRAM.
  int64_t resident = 0;
  if (std::string err = sm80::resident_ctas<split_tf32_kernel<kThreads>>(kThreads, 0, &resident); !err.empty()) {
    return "sm90 split TF32: sizing the pre-pass grid: " + err;
  }
  const int64_t ctas = std::min<int64_t>((count4 + kThreads - 1) / kThreads, resident);
  split_tf32_kernel<kThreads><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
      static_cast<const float4*>(x), reinterpret_cast<float4*>(parts.hi), reinterpret_cast<float4*>(parts.lo), count4);
  if (cudaGetLastError() != cudaSuccess) return "sm90 split TF32: launch of an operand's pre-pass failed";
  return {};
}

}  // namespace jax_flash::cuda::sm90
