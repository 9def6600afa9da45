// Named barriers (id 0 is __syncthreads): a subset of a CTA's warps waits for arrivals of others. Counts are in
// threads and must be multiples of 32; every thread of a warp takes the same call (bar.sync / bar.arrive are
// aligned).
#pragma once

namespace jax_flash::cuda {

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same without .aligned: PTX requires every participant of an aligned barrier to execute the same barrier
// instruction, so warps that meet from different places in the code (a branch taken by whole warpgroups, each
// with a barrier of its own) use this form (compute-sanitizer's synccheck reports the aligned form there).
__device__ __forceinline__ void named_barrier_sync_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace jax_flash::cuda
