// Host emulation of the CUDA built-ins the float32 kernels use (csrc/cuda/tests/f32_emulation/run.py): one
// std::thread per CUDA thread, barriers for __syncthreads and warp-collective operations. Test harness only.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>
#include <atomic>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)
#define __CUDACC__ 1

struct EmuDim { unsigned x = 0, y = 0, z = 0; };
inline thread_local EmuDim threadIdx, blockIdx;

struct EmuCta {
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> xch;          // [warps][32]
  std::vector<uint32_t> frag;      // [warps][32][10]: a0..a3, b0, b1, c0..c3
};
inline EmuCta* g_cta = nullptr;

inline void __syncthreads() { g_cta->all->arrive_and_wait(); }
inline void emu_warp_sync() { g_cta->warps[threadIdx.x / 32]->arrive_and_wait(); }
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
  for (unsigned b = 0; b < grid; ++b) {
    EmuCta cta;
    cta.all = std::make_unique<std::barrier<>>(threads);
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) cta.warps.push_back(std::make_unique<std::barrier<>>(32));
    cta.xch.resize(threads);
    cta.frag.resize(threads * 10);
    g_cta = &cta;
    for (size_t i = 0; i < smem_floats; ++i) smem[i] = NAN;  // poison: unloaded smem reads show up as NaN
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t, b] { threadIdx.x = t; blockIdx.x = b; kernel(); });
    for (auto& th : pool) th.join();
  }
}
