// The pre-pass of the kernels that read operands in parts (common/tf32_workspace.h: split TF32, float16 parts): each
// operand's hi and lo parts written into the call's workspace, where the kernels' TMA loads read them.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "../../common/attention_params.h"
#include "../../common/tf32_workspace.h"
#include "../sm80/launch_common.h"
#include "split_tf32_mma.h"

namespace jax_flash::cuda::sm90 {

// Four consecutive parts, stored at once (16 bytes of float, 8 of float16).
template <class Part>
struct alignas(4 * sizeof(Part)) PartQuad {
  Part x, y, z, w;
};

// hi and lo parts of `count4` float4s (x 16-byte aligned, hi and lo aligned to their quads). A template so that
// the header can be included by several translation units.
template <int kThreads, class Part>
__global__ void __launch_bounds__(kThreads)
    split_parts_kernel(const float4* x, PartQuad<Part>* hi, PartQuad<Part>* lo, int64_t count4) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < count4; i += int64_t(gridDim.x) * kThreads) {
    const float4 v = x[i];
    PartQuad<Part> h, l;
    split_into_parts(v.x, h.x, l.x);
    split_into_parts(v.y, h.y, l.y);
    split_into_parts(v.z, h.z, l.z);
    split_into_parts(v.w, h.w, l.w);
    hi[i] = h;
    lo[i] = l;
  }
}

// Writes the parts of `count` floats (a multiple of 4: head_dim is) of x on `stream`.
template <class Part>
std::string launch_split_parts(const void* x, OperandParts<Part> parts, int64_t count, cudaStream_t stream) {
  constexpr int kThreads = 256;
  constexpr auto kernel = split_parts_kernel<kThreads, Part>;
  const int64_t count4 = count / 4;
  if (count4 == 0) return {};
  // A grid-stride loop over at most the CTAs the device holds at once (cached per device): enough to saturate DRAM.
  int64_t resident = 0;
  if (std::string err = sm80::resident_ctas<kernel>(kThreads, 0, &resident); !err.empty()) {
    return "sm90 operand parts: sizing the pre-pass grid: " + err;
  }
  const int64_t ctas = std::min<int64_t>((count4 + kThreads - 1) / kThreads, resident);
  kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(static_cast<const float4*>(x),
                                                               reinterpret_cast<PartQuad<Part>*>(parts.hi),
                                                               reinterpret_cast<PartQuad<Part>*>(parts.lo), count4);
  if (cudaGetLastError() != cudaSuccess) return "sm90 operand parts: launch of an operand's pre-pass failed";
  return {};
}

// The parts of a backward call's q, dO, k and v (float32) in its parts workspace at `workspace`.
template <class Part>
std::string launch_backward_operand_parts(const AttentionBackwardParams& p, Part* workspace, cudaStream_t stream) {
  const BackwardOperandParts<Part> parts =
      backward_operand_parts(workspace, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim);
  const int64_t q_count = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
  const int64_t k_count = p.batch * p.seqlen_k * p.heads_kv * p.head_dim;
  const struct {
    const void* x;
    OperandParts<Part> parts;
    int64_t count;
  } operands[] = {{p.q, parts.q, q_count}, {p.d_o, parts.d_o, q_count}, {p.k, parts.k, k_count},
                  {p.v, parts.v, k_count}};
  for (const auto& operand : operands) {
    if (std::string err = launch_split_parts(operand.x, operand.parts, operand.count, stream); !err.empty()) return err;
  }
  return {};
}

}  // namespace jax_flash::cuda::sm90
