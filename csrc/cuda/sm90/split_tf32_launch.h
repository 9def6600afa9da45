// Host launcher of the split-TF32 forward (float32_precision="highest" on the Hopper kernel; common/tf32_workspace.h
// says what it computes and what the workspace holds): pre-passes that write each operand's hi and lo parts into
// the call's workspace, then forward_kernel with the kSplitTf32 tile (kernel_traits.h), whose TMA loads read those
// parts. One kernel form per translation unit, as the 16-bit and TF32 forwards (split_tf32_dispatch.h picks it).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "../../common/attention_params.h"
#include "../../common/tf32_workspace.h"
#include "forward_launch.h"
#include "split_tf32_mma.h"
#include "tf32_v_transpose.h"

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
inline std::string launch_split_tf32(const void* x, float* hi, float* lo, int64_t count, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t count4 = count / 4;
  if (count4 == 0) return {};
  // A grid-stride loop over at most ~16 CTAs per SM of an H200 (132 SMs): enough to saturate DRAM.
  const int64_t ctas = std::min<int64_t>((count4 + kThreads - 1) / kThreads, 132 * 16);
  split_tf32_kernel<kThreads><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
      static_cast<const float4*>(x), reinterpret_cast<float4*>(hi), reinterpret_cast<float4*>(lo), count4);
  if (cudaGetLastError() != cudaSuccess) return "sm90 split-TF32 forward: launch of the Q/K pre-pass failed";
  return {};
}

template <int kHeadDim, ForwardVariant kVariant>
std::string launch_split_tf32_variant(const AttentionParams& p, cudaStream_t stream) {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the split-TF32 tiles and the workspace's head dims");
  using Traits = ForwardTraits<kHeadDim, cutlass::tfloat32_t, RowTile::kSplitTf32>;
  if (p.tf32_vt == nullptr || !p.split_tf32) return "sm90 split-TF32 forward: no split-TF32 workspace";
  const SplitTf32Parts parts =
      split_tf32_parts(p.tf32_vt, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim);
  if (std::string err = launch_tf32_v_transpose<kHeadDim>(p, stream, parts.vt_lo); !err.empty()) return err;
  if (std::string err = launch_split_tf32(p.q, parts.q_hi, parts.q_lo, p.batch * p.seqlen_q * p.heads_q * p.head_dim,
                                          stream);
      !err.empty()) {
    return err;
  }
  if (std::string err = launch_split_tf32(p.k, parts.k_hi, parts.k_lo,
                                          p.batch * p.seqlen_k * p.heads_kv * p.head_dim, stream);
      !err.empty()) {
    return err;
  }
  bool persistent = false;
  int64_t max_ctas = 0;
  if (std::string err = persistent_switch(p.seqlen_k, &persistent, &max_ctas); !err.empty()) return err;
  // The kernel's Q and K descriptors read the hi parts; launch_tiles adds those of the lo parts (Traits::kSplit).
  AttentionParams hi = p;
  hi.q = parts.q_hi;
  hi.k = parts.k_hi;
  return launch_tiles<Traits, kVariant>(hi, persistent, max_ctas, stream);
}

}  // namespace jax_flash::cuda::sm90
