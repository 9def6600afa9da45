// dQ summed in a float32 workspace (AttentionBackwardParams::dq_accum; its size: common/dq_workspace.h), shared by
// the sm80 and sm90 backward: a fused dK/dV pass adds each (query tile, key tile) item's dS K to it with
// reductions in L2, then one pass scales and converts it into dq. Sums of float adds in whatever order the CTAs
// arrive: not bit-reproducible, so deterministic calls keep each family's separate dQ pass.
// Layout per family: sm80 adds into it laid out like q (add_dq_tile, dq_from_accum below: the first
// batch * seqlen_q * heads_q * head_dim floats); sm90 into whole query tiles in fragment order (sm90/dq_staging.h).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../../common/attention_params.h"
#include "../sm80/launch_common.h"
#include "../sm80/tensor_offsets.h"
#include "block_range.h"
#include "async_proxy_fence.h"
#include "bulk_reduce.h"

namespace jax_flash::cuda {

// *address += a, *(address + 1) += b, without reading the result back. One 8-byte vector reduction where the
// target has it (sm_90) and the pair is 8-byte aligned; two scalar reductions otherwise.
__device__ __forceinline__ void reduce_add_pair(float* address, float a, float b, bool pair_aligned) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pair_aligned) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(a), "f"(b) : "memory");
    return;
  }
#endif
  atomicAdd(address, a);
  atomicAdd(address + 1, b);
}

// Adds a (query rows x head-dim columns) dQ accumulator to dq_accum: rows m0 + row of query head `head`; rows at
// or past `rows_in_bounds` and columns at or past head_dim are skipped. `whole_tile`: the caller knows that every
// element is in bounds and head_dim is the tile's (even) width, so no pair needs a test. `coords` is the identity
// tensor partitioned like `acc`. mma.sync accumulators hold two adjacent columns of one row in consecutive
// registers, so each pair is one reduction; an even head_dim makes every pair 8-byte aligned (row starts and
// columns are even). An odd head_dim leaves a last column without its pair.
template <class Acc, class Coords>
__device__ __forceinline__ void add_dq_tile(const AttentionBackwardParams& p, const Acc& acc, const Coords& coords,
                                            int64_t batch, int64_t head, int64_t m0, int64_t rows_in_bounds,
                                            bool whole_tile) {
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  float* tile = p.dq_accum + q_shape.offset(batch, m0, head);
  const int cols_in_bounds = static_cast<int>(p.head_dim);
  const bool pairs_aligned = p.head_dim % 2 == 0;
  // The pairs' offsets row * stride + col do not change from item to item, so the compiler would compute them
  // once before the item loop and keep them live across it; at 255 registers that spilled them (36 local loads
  // per item at d=128). An opaque copy of the stride makes them cheap per-item arithmetic instead.
  int64_t row_stride = q_shape.row_stride();
  asm volatile("" : "+l"(row_stride));
  if (whole_tile) {  // the common case: no bounds to test, every pair 8-byte aligned
    CUTE_UNROLL
    for (int i = 0; i < cute::size(acc); i += 2) {
      const int row = cute::get<0>(coords(i)), col = cute::get<1>(coords(i));
      reduce_add_pair(tile + row * row_stride + col, acc(i), acc(i + 1), true);
    }
    return;
  }
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    const int row = cute::get<0>(coords(i)), col = cute::get<1>(coords(i));
    if (row >= rows_in_bounds || col >= cols_in_bounds) continue;
    float* address = tile + row * row_stride + col;
    if (col + 1 < cols_in_bounds) {
      reduce_add_pair(address, acc(i), acc(i + 1), pairs_aligned);
    } else {
      atomicAdd(address, acc(i));
    }
  }
}

// The same addition built for sm_90, as the sm80 kernel's fused dQ does it there: the accumulator staged row-major
// in shared memory (`staging`, kPitch floats per row; every coordinate inside the tile), then one bulk reduction of
// `cols` floats per row in bounds, issued by the thread whose index is that row (one commit group each). Every
// thread of the CTA calls it. Before the next call overwrites `staging`, the issuing threads wait for the reads
// (bulk_wait_read) ahead of a CTA barrier. cols * 4 and `tile`'s rows are multiples of 16 bytes.
template <int kPitch, class Acc, class Coords>
__device__ __forceinline__ void stage_and_reduce_dq(const Acc& acc, const Coords& coords, float* staging, float* tile,
                                                    int64_t row_stride, int rows, int cols) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {  // two adjacent columns of one row per pair of registers
    const int row = cute::get<0>(coords(i)), col = cute::get<1>(coords(i));
    *reinterpret_cast<float2*>(staging + row * kPitch + col) = make_float2(acc(i), acc(i + 1));
  }
  fence_stores_for_async_proxy();  // these generic-proxy stores before the bulk copies (async proxy)
  __syncthreads();
  const int row = static_cast<int>(threadIdx.x);
  if (row < rows) {
    bulk_reduce_add(tile + row * row_stride, staging + row * kPitch, cols * 4);
    bulk_commit();
  }
}

constexpr int kDqConvertThreads = 256;

// Floats in sm80's layout of the workspace (like q; sm90's tile layout is larger, common/dq_workspace.h).
__host__ __device__ inline int64_t dq_elements(const AttentionBackwardParams& p) {
  return p.batch * p.seqlen_q * p.heads_q * p.head_dim;
}

// sm80's layout (like q): dq = dq_accum * softmax_scale (the scale of S = scale * Q K^T, left out of dS) in dq's
// element type, grid-stride over the whole tensor; float4 reads where the workspace is 16-byte aligned. A device
// function so that each family wraps it in a kernel of its own (see sm80/backward_row_kernels.h: a template kernel
// instantiated in translation units built for different architectures would be registered twice).
template <class T>
__device__ __forceinline__ void dq_from_accum(const AttentionBackwardParams& p) {
  const int64_t count = dq_elements(p);
  const bool aligned = reinterpret_cast<uintptr_t>(p.dq_accum) % 16 == 0;
  const int64_t vector_count = aligned ? count / 4 : 0;
  const float4* accum4 = reinterpret_cast<const float4*>(p.dq_accum);
  T* dq = static_cast<T*>(p.dq);
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < vector_count; i += stride) {
    const float4 sum = accum4[i];
    dq[4 * i + 0] = T(sum.x * p.softmax_scale);
    dq[4 * i + 1] = T(sum.y * p.softmax_scale);
    dq[4 * i + 2] = T(sum.z * p.softmax_scale);
    dq[4 * i + 3] = T(sum.w * p.softmax_scale);
  }
  for (int64_t i = 4 * vector_count + first; i < count; i += stride) dq[i] = T(p.dq_accum[i] * p.softmax_scale);
}

// The dQ part of a fused backward, after softmax_d: zero the first `count` floats of the workspace (what the family's
// layout uses), run the family's fused dK/dV pass (launch_fused_dkdv(), which adds into it), then its conversion
// kernel of kDqConvertThreads threads (dq_from_accum or sm90's dq_from_tiles; both grid-stride, so the grid is
// `convert_blocks`, the number of CTAs the work asks for, capped at 65536).
template <class LaunchFusedDkdv>
std::string run_fused_dq(const AttentionBackwardParams& p, cudaStream_t stream, int64_t count,
                         LaunchFusedDkdv launch_fused_dkdv, void (*convert_kernel)(const AttentionBackwardParams),
                         int64_t convert_blocks, const char* family) {
  if (cudaMemsetAsync(p.dq_accum, 0, count * sizeof(float), stream) != cudaSuccess) {
    return sm80::last_launch_error((std::string(family) + " backward: zeroing dq_accum").c_str());
  }
  if (std::string err = launch_fused_dkdv(); !err.empty()) return err;
  const int64_t blocks = std::min<int64_t>(convert_blocks, 65536);
  if (blocks == 0) return {};
  convert_kernel<<<static_cast<unsigned>(blocks), kDqConvertThreads, 0, stream>>>(p);
  return sm80::last_launch_error((std::string(family) + " dQ conversion kernel launch").c_str());
}

}  // namespace jax_flash::cuda
