// dQ summed in a float32 workspace (AttentionBackwardParams::dq_accum, laid out like q): the fused dK/dV pass
// adds each query tile's dS K slice with vector reductions to global memory, then one elementwise pass scales
// and converts it into dq. Sums of float adds in whatever order the CTAs arrive: not bit-reproducible, so
// deterministic calls keep the separate dQ pass (backward_dq_kernel.h).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../sm80/tensor_offsets.h"

namespace jax_flash::cuda::sm90 {

// *address += (a, b) as one 8-byte reduction in L2 (sm_90: red.global.add.v2.f32); address is 8-byte aligned.
__device__ __forceinline__ void reduce_add_pair(float* address, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(a), "f"(b) : "memory");
}

// Adds a consumer's (query rows x head-dim columns) dQ accumulator to dq_accum: rows m0 + row of query head
// `head`, columns col0 + col. `coords` is the identity tensor partitioned like `acc`; WGMMA accumulators hold two
// adjacent columns in consecutive registers, so each pair is one 8-byte reduction (head_dim is even here).
template <class Acc, class Coords>
__device__ __forceinline__ void add_dq_tile(const AttentionBackwardParams& p, const Acc& acc, const Coords& coords,
                                            int64_t batch, int64_t head, int64_t m0, int col0) {
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  float* tile = p.dq_accum + q_shape.offset(batch, m0, head) + col0;
  const int64_t rows_in_bounds = p.seqlen_q - m0;
  const int cols_in_bounds = static_cast<int>(p.head_dim) - col0;
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    const int row = cute::get<0>(coords(i)), col = cute::get<1>(coords(i));
    if (row < rows_in_bounds && col < cols_in_bounds) {
      reduce_add_pair(tile + row * q_shape.row_stride() + col, acc(i), acc(i + 1));
    }
  }
}

// dq = dq_accum * softmax_scale in dq's element type; the element count is a multiple of 4 (head_dim % 8 == 0).
template <class T>
__global__ void dq_from_accum_kernel(const AttentionBackwardParams p, int64_t count) {
  const float4* accum = reinterpret_cast<const float4*>(p.dq_accum);
  T* dq = static_cast<T*>(p.dq);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count / 4; i += stride) {
    const float4 sum = accum[i];
    dq[4 * i + 0] = T(sum.x * p.softmax_scale);
    dq[4 * i + 1] = T(sum.y * p.softmax_scale);
    dq[4 * i + 2] = T(sum.z * p.softmax_scale);
    dq[4 * i + 3] = T(sum.w * p.softmax_scale);
  }
}

}  // namespace jax_flash::cuda::sm90
