// Bulk reductions from shared memory into global float32 (sm_90 and newer: cp.reduce.async.bulk): the whole range
// is added in L2 by the copy engine, in full lines, with one instruction, instead of one red.global per pair of
// floats. Both fused-dQ forms use them (sm90/dq_staging.h, and the sm80 kernel where it is built for sm_90).
#pragma once

#include <cstdint>

namespace jax_flash::cuda {

// global[0, bytes) += shared[0, bytes) in L2; both 16-byte aligned, bytes a multiple of 16. Part of the calling
// thread's current bulk group. The caller fences its generic-proxy stores of `shared` (fence.proxy.async) first.
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

}  // namespace jax_flash::cuda
