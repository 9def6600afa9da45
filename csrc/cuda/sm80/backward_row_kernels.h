// The memory-bound pre-pass of the backward: softmax_d = rowsum(dO * O) - dlse.
#pragma once

#include <cstdint>

#include "../../common/attention_params.h"
#include "tensor_offsets.h"

namespace jax_flash::cuda::sm80 {

constexpr int kRowKernelWarps = 8;

// One warp per (batch, query row, head): rows are contiguous head_dim vectors in BSHD, so lanes stride through
// them coalesced. A device function so that each kernel family wraps it in a kernel of its own (a template kernel
// instantiated in translation units built for different architectures would be registered twice).
template <class T>
__device__ __forceinline__ void softmax_d_rows(const AttentionBackwardParams& p) {
  const int64_t row = int64_t(blockIdx.x) * kRowKernelWarps + threadIdx.x / 32;  // ((b * Sq) + i) * Hq + h
  const int lane = threadIdx.x % 32;
  if (row >= p.batch * p.seqlen_q * p.heads_q) return;
  const int64_t head = row % p.heads_q;
  const int64_t position = (row / p.heads_q) % p.seqlen_q;
  const int64_t batch = row / (p.heads_q * p.seqlen_q);
  const T* out = static_cast<const T*>(p.o) + row * p.head_dim;
  const T* d_out = static_cast<const T*>(p.d_o) + row * p.head_dim;
  float dot = 0.0f;
  for (int64_t c = lane; c < p.head_dim; c += 32) dot += float(out[c]) * float(d_out[c]);
  for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffff, dot, offset);
  if (lane == 0) {
    const int64_t stat = row_stat_offset(p, batch, head, position);
    p.softmax_d[stat] = dot - (p.d_lse != nullptr ? p.d_lse[stat] : 0.0f);
  }
}

template <class T>
__global__ void __launch_bounds__(kRowKernelWarps * 32) softmax_d_kernel(const AttentionBackwardParams p) {
  softmax_d_rows<T>(p);
}

}  // namespace jax_flash::cuda::sm80
