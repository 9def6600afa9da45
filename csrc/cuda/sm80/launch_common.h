// Host-side helpers shared by the sm80 launchers.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "../../common/attention_params.h"

namespace jax_flash::cuda {
// Compute capability major of the current device, cached per device id (dispatch.cu); 0 where it is unknown.
int current_device_major();
}  // namespace jax_flash::cuda

namespace jax_flash::cuda::sm80 {

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// 16-byte cp.async and stores need every row start 16-byte aligned.
inline bool rows_are_16b_aligned(const AttentionParams& p) {
  return p.head_dim % 8 == 0 && aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.o);
}

inline std::string last_launch_error(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return {};
  return std::string(what) + ": " + cudaGetErrorString(err);
}

// Opts a kernel into more than the default 48 KiB of dynamic shared memory (not a stream operation, so it is
// allowed during CUDA graph capture). Where that fails because the GPU gives a block less shared memory than the
// tile needs (e.g. sm_86/89 with large head dims), the message says so rather than "invalid argument"; the limit
// is only looked up then, off the launch path.
template <class Kernel>
std::string allow_dynamic_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return {};
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) return {};
  cudaGetLastError();  // not left behind for a later launch check to report
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
      bytes > limit) {
    return "this kernel's tiles need " + std::to_string(bytes) + " bytes of shared memory per block; this GPU "
           "allows " + std::to_string(limit) + " (a smaller head dim runs)";
  }
  return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(err);
}

// CTAs of kKernel (launched with `threads` threads and `smem_bytes` of dynamic shared memory, the same at every call
// on a device) that fit on the current GPU at once, SMs x CTAs per SM: the size of one wave. Looked up once per device
// (the kernel's dynamic shared memory limit must have been raised already); on failure, the CUDA error's name (also
// cleared, so that no later launch check reports it).
template <auto kKernel>
std::string resident_ctas(int threads, int smem_bytes, int64_t* ctas) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int64_t> known[kMaxDevices];  // 0: not looked up yet
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    cudaGetLastError();
    return std::string("cudaGetDevice: ") + cudaGetErrorString(err);
  }
  if (device >= 0 && device < kMaxDevices && (*ctas = known[device].load(std::memory_order_relaxed)) > 0) return {};
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, smem_bytes) != cudaSuccess) {
    return cudaGetErrorString(cudaGetLastError());
  }
  *ctas = int64_t(std::max(sms, 1)) * std::max(per_sm, 1);
  if (device >= 0 && device < kMaxDevices) known[device].store(*ctas, std::memory_order_relaxed);
  return {};
}

// The general variant reads bias/mask at 32-bit offsets from a thread's first element of a tile: rows at most
// 255 apart, times the query stride (seqlen_k, or 0 when broadcast).
inline std::string check_dense_strides(const AttentionParams& p) {
  constexpr int64_t kLimit = (int64_t(1) << 31) / 256;
  if ((p.bias != nullptr && p.bias_strides.query >= kLimit) || (p.mask != nullptr && p.mask_strides.query >= kLimit)) {
    return "a bias or mask with more than 2^23 keys per row is not supported by the sm80 kernels";
  }
  return {};
}

// blockIdx.x carries (tile, head, batch) folded together; *grid == 0 means there is nothing to launch.
inline std::string grid_size(int64_t tiles, int64_t heads, int64_t batch, unsigned* grid) {
  const int64_t blocks = tiles * heads * batch;
  if (blocks > INT32_MAX) return "attention problem too large for one launch (more than 2^31 - 1 CTAs)";
  *grid = static_cast<unsigned>(blocks);
  return {};
}

}  // namespace jax_flash::cuda::sm80
