// Orders this thread's generic-proxy shared-memory stores before later async-proxy reads of them (WGMMA operands,
// TMA / bulk copies): fence.proxy.async.shared::cta, as CUTLASS's fence_view_async_shared, but with a memory
// clobber, which that one lacks, so that the compiler cannot move the stores past it either.
#pragma once

namespace jax_flash::cuda {

__device__ __forceinline__ void fence_stores_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace jax_flash::cuda
