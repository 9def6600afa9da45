// Programmatic dependent launch (compute capability 9.0+): a grid launched with the programmatic stream
// serialization attribute may start once every CTA of the grid before it has called allow_dependent_grid() (or
// exited), instead of once that grid has finished. Both calls do nothing in builds for older targets and in grids
// launched without the attribute.
#pragma once

namespace jax_flash::cuda {

// Lets the next grid on the stream start scheduling its CTAs (onto SMs this grid frees). Says nothing about this
// grid's memory: the next grid must not read what this one writes before wait_for_prior_grid().
__device__ __forceinline__ void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits until the grid before this one on the stream has completed and its memory operations are visible. A grid
// that started early finishes only after this returns in each of its CTAs, so that work queued after it (launched
// normally) also follows the grid before.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace jax_flash::cuda
