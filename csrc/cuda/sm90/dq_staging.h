// The sm90 fused dK/dV pass's way into the float32 dQ workspace (common/dq_accum.h has the workspace, its
// conversion into dq and why deterministic calls do not use it): a staged shared tile and bulk reductions.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../sm80/tensor_offsets.h"

namespace jax_flash::cuda::sm90 {

// Consumers store their dQ tile into shared memory (padded rows); one warp adds each row to dq_accum with a bulk
// reduction (cp.reduce.async.bulk, an async-proxy copy that adds in L2), so no consumer thread issues a global
// atomic (per-element red.global.add from the consumers measured 15% slower than the separate dQ pass).

// Stores a consumer's accumulator into the staged tile: row r, column col0 + c at tile[r * kRowFloats + col0 + c].
// With kRowFloats = head_dim + 8, a half-warp's 8-byte stores (4 rows x 4 column pairs) hit 32 distinct banks.
template <int kRowFloats, class Acc, class Coords>
__device__ __forceinline__ void stage_dq_tile(float* tile, const Acc& acc, const Coords& coords, int col0) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    const int row = cute::get<0>(coords(i)), col = cute::get<1>(coords(i));
    *reinterpret_cast<float2*>(tile + row * kRowFloats + col0 + col) = make_float2(acc(i), acc(i + 1));
  }
}

// global[0, bytes) += shared[0, bytes) in L2; both 16-byte aligned, bytes a multiple of 16. Part of the calling
// thread's current bulk group.
__device__ __forceinline__ void bulk_reduce_add(float* global, const float* shared, int bytes) {
  const uint32_t shared_address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(global), "r"(shared_address), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Every committed bulk group of this thread has finished reading shared memory (its source may be overwritten).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Every committed bulk group of this thread is complete (its global writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// One warp: rows [0, rows) of the staged tile (kRowFloats apart) added to dq_accum rows m0 + r of query head
// `head`, head_dim floats each (a multiple of 8 here: 16-byte aligned rows of 16-byte multiples).
template <int kRowFloats>
__device__ __forceinline__ void reduce_dq_rows(const AttentionBackwardParams& p, const float* tile, int64_t batch,
                                               int64_t head, int64_t m0, int rows, int lane) {
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  float* first = p.dq_accum + q_shape.offset(batch, m0, head);
  const int bytes = static_cast<int>(p.head_dim) * 4;
  for (int r = lane; r < rows; r += 32) bulk_reduce_add(first + r * q_shape.row_stride(), tile + r * kRowFloats, bytes);
  bulk_commit();
}

}  // namespace jax_flash::cuda::sm90
