// Host emulation of the CUDA built-ins the float32 kernels use (csrc/cuda/tests/f32_emulation/run.py): each CUDA
// thread of a CTA is a fiber (ucontext) on the one host thread, and __syncthreads and the warp-collective operations
// are barriers at which a fiber yields to the next. Fibers, not one std::thread per CUDA thread: on CI's two cores
// the threads' futex wake-ups at every barrier took most of the run (3 of its 4 minutes were system time).
// Test harness only.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)
#define __CUDACC__ 1

struct EmuDim { unsigned x = 0, y = 0, z = 0; };
inline EmuDim threadIdx, blockIdx;

// A barrier of `expected` fibers: the last to arrive opens it and runs on; the others yield until it has opened.
struct EmuBarrier {
  unsigned expected = 0, arrived = 0, generation = 0;
};

struct EmuCta {
  EmuBarrier all;
  std::vector<EmuBarrier> warps;
  std::vector<float> xch;          // [warps][32]
  std::vector<uint32_t> frag;      // [warps][32][10]: a0..a3, b0, b1, c0..c3
};
inline EmuCta* g_cta = nullptr;

struct EmuFibers {
  ucontext_t scheduler;
  std::vector<ucontext_t> contexts;
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<bool> finished;
  unsigned current = 0;
  const std::function<void()>* kernel = nullptr;
};
inline EmuFibers* g_fibers = nullptr;
inline constexpr size_t kEmuStackBytes = 256 * 1024;

inline void emu_yield() { swapcontext(&g_fibers->contexts[g_fibers->current], &g_fibers->scheduler); }
inline void emu_wait(EmuBarrier& barrier) {
  const unsigned generation = barrier.generation;
  if (++barrier.arrived == barrier.expected) {
    barrier.arrived = 0;
    ++barrier.generation;
    return;
  }
  while (barrier.generation == generation) emu_yield();
}
inline void emu_fiber_main() {
  (*g_fibers->kernel)();
  g_fibers->finished[g_fibers->current] = true;  // returning resumes the scheduler (uc_link)
}

inline void __syncthreads() { emu_wait(g_cta->all); }
inline void emu_warp_sync() { emu_wait(g_cta->warps[threadIdx.x / 32]); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  g_cta->xch[w * 32 + lane] = v;
  emu_warp_sync();
  const float r = g_cta->xch[w * 32 + (lane ^ offset)];
  emu_warp_sync();
  return r;
}
inline float atomicAdd(float* address, float value) { return std::atomic_ref<float>(*address).fetch_add(value); }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline uint32_t __float_as_uint(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

template <class Kernel>
void emu_launch(unsigned grid, unsigned threads, float* smem, size_t smem_floats, Kernel&& kernel) {
  const std::function<void()> body = kernel;
  EmuFibers fibers;
  fibers.kernel = &body;
  fibers.contexts.resize(threads);
  fibers.stacks.resize(threads);
  for (auto& stack : fibers.stacks) stack = std::make_unique<char[]>(kEmuStackBytes);
  g_fibers = &fibers;
  for (unsigned b = 0; b < grid; ++b) {
    EmuCta cta;
    cta.all.expected = threads;
    cta.warps.resize((threads + 31) / 32);
    for (auto& warp : cta.warps) warp.expected = 32;
    cta.xch.resize(threads);
    cta.frag.resize(threads * 10);
    g_cta = &cta;
    for (size_t i = 0; i < smem_floats; ++i) smem[i] = NAN;  // poison: unloaded smem reads show up as NaN
    fibers.finished.assign(threads, false);
    for (unsigned t = 0; t < threads; ++t) {
      ucontext_t& context = fibers.contexts[t];
      getcontext(&context);
      context.uc_stack.ss_sp = fibers.stacks[t].get();
      context.uc_stack.ss_size = kEmuStackBytes;
      context.uc_link = &fibers.scheduler;
      makecontext(&context, emu_fiber_main, 0);
    }
    blockIdx.x = b;
    for (unsigned running = threads; running > 0;) {  // round robin until every fiber has returned
      running = 0;
      for (unsigned t = 0; t < threads; ++t) {
        if (fibers.finished[t]) continue;
        fibers.current = t;
        threadIdx.x = t;
        swapcontext(&fibers.scheduler, &fibers.contexts[t]);
        running += fibers.finished[t] ? 0 : 1;
      }
    }
  }
  g_fibers = nullptr;
}
