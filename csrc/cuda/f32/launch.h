// Host launchers of the float32 kernels for one head dim; instantiated once per generated .cu. p.allow_tf32
// picks the TF32 tensor-core kernels (the backward's up to head dim 128; above, it is the exact one).
#pragma once

#include <algorithm>
#include <string>

#include "../../common/attention_params.h"
#include "../common/block_range.h"
#include "../sm80/backward_row_kernels.h"
#include "../sm80/launch_common.h"
#include "backward_kernels.h"
#include "forward_kernel.h"
#include "launchers.h"
#include "tf32_backward_kernels.h"
#include "tf32_forward_kernel.h"

namespace jax_flash::cuda::f32 {

// float4 tile loads need head_dim % 4 == 0 and 16-byte aligned tensors.
inline bool rows_are_16b_aligned(const AttentionParams& p) {
  return p.head_dim % 4 == 0 && sm80::aligned16(p.q) && sm80::aligned16(p.k) && sm80::aligned16(p.v);
}

// What the float32 kernels do not do yet (dispatch.cu may stop refusing these for the 16-bit kernels first).
inline std::string unsupported(const AttentionParams& p) {
  if (p.bias != nullptr || p.mask != nullptr || p.dropout_rate > 0.0f)
    return "the float32 CUDA kernels do not support bias, mask or dropout yet";
  return {};
}

// A readable error where a head dim's tiles need more shared memory than this GPU gives a block (head dims 192
// and 256 need sm90's 227 KiB).
inline std::string check_smem(int bytes, int head_dim) {
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return sm80::last_launch_error("float32 kernels: querying the shared memory limit");
  if (bytes <= limit) return {};
  return "the float32 kernels for head dim " + std::to_string(head_dim) + " need " + std::to_string(bytes) +
         " bytes of shared memory per block; this GPU allows " + std::to_string(limit);
}

template <int kHeadDim>
std::string launch_forward(const AttentionParams& p, cudaStream_t stream) {
  if (std::string err = unsupported(p); !err.empty()) return err;
  unsigned grid = 0;
  if (p.allow_tf32) {
    using G = Tf32ForwardGeometry<kHeadDim>;
    auto kernel = transforms_scores(p) ? tf32_forward_kernel<kHeadDim, true> : tf32_forward_kernel<kHeadDim, false>;
    if (std::string err = check_smem(G::kBytes, kHeadDim); !err.empty()) return err;
    if (std::string err = sm80::allow_dynamic_smem(kernel, G::kBytes); !err.empty()) return err;
    if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, G::kBlockM), p.heads_q, p.batch, &grid); !err.empty())
      return err;
    if (grid == 0) return {};
    kernel<<<grid, G::kThreads, G::kBytes, stream>>>(p, rows_are_16b_aligned(p));
    return sm80::last_launch_error("float32 (TF32) forward kernel launch");
  }
  constexpr int kSmemBytes = ForwardSmem<kHeadDim>::kBytes;
  auto kernel = transforms_scores(p) ? forward_kernel<kHeadDim, true> : forward_kernel<kHeadDim, false>;
  if (std::string err = check_smem(kSmemBytes, kHeadDim); !err.empty()) return err;
  if (std::string err = sm80::allow_dynamic_smem(kernel, kSmemBytes); !err.empty()) return err;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, kTileRows), p.heads_q, p.batch, &grid); !err.empty())
    return err;
  if (grid == 0) return {};
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, rows_are_16b_aligned(p));
  return sm80::last_launch_error("float32 forward kernel launch");
}

template <int kHeadDim>
std::string launch_tf32_dkdv_dq(const AttentionBackwardParams& p, bool vectorized, bool transforms,
                                cudaStream_t stream) {
  using G = Tf32BackwardGeometry<kHeadDim>;
  if (std::string err = check_smem(G::kBytes, kHeadDim); !err.empty()) return err;
  auto dkdv = transforms ? tf32_dkdv_kernel<kHeadDim, true> : tf32_dkdv_kernel<kHeadDim, false>;
  if (std::string err = sm80::allow_dynamic_smem(dkdv, G::kBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_k, G::kBlock), p.heads_kv, p.batch, &grid); !err.empty())
    return err;
  if (grid > 0) {
    dkdv<<<grid, G::kThreads, G::kBytes, stream>>>(p, vectorized);
    if (std::string err = sm80::last_launch_error("float32 (TF32) dK/dV kernel launch"); !err.empty()) return err;
  }
  auto dq = transforms ? tf32_dq_kernel<kHeadDim, true> : tf32_dq_kernel<kHeadDim, false>;
  if (std::string err = sm80::allow_dynamic_smem(dq, G::kBytes); !err.empty()) return err;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, G::kBlock), p.heads_q, p.batch, &grid); !err.empty())
    return err;
  if (grid == 0) return {};
  dq<<<grid, G::kThreads, G::kBytes, stream>>>(p, vectorized);
  return sm80::last_launch_error("float32 (TF32) dQ kernel launch");
}

template <int kHeadDim>
std::string launch_backward(const AttentionBackwardParams& p, cudaStream_t stream) {
  if (std::string err = unsupported(p); !err.empty()) return err;
  if (std::string err = check_smem(std::max(DkdvGeometry<kHeadDim>::kBytes, DqSmem<kHeadDim>::kBytes), kHeadDim);
      !err.empty())
    return err;
  const bool vectorized = rows_are_16b_aligned(p) && sm80::aligned16(p.d_o);
  const int64_t rows = p.batch * p.seqlen_q * p.heads_q;
  const int64_t row_blocks = ceil_div(rows, sm80::kRowKernelWarps);
  if (row_blocks > INT32_MAX) return "attention problem too large for one launch (more than 2^31 - 1 CTAs)";
  if (row_blocks > 0) {
    sm80::softmax_d_kernel<float><<<static_cast<unsigned>(row_blocks), sm80::kRowKernelWarps * 32, 0, stream>>>(p);
    if (std::string err = sm80::last_launch_error("float32 softmax_d kernel launch"); !err.empty()) return err;
  }
  const bool transforms = transforms_scores(p);
  if constexpr (kHeadDim <= 128) {
    if (p.allow_tf32) return launch_tf32_dkdv_dq<kHeadDim>(p, vectorized, transforms, stream);
  }

  constexpr int kDkdvBytes = DkdvGeometry<kHeadDim>::kBytes;
  auto dkdv = transforms ? dkdv_kernel<kHeadDim, true> : dkdv_kernel<kHeadDim, false>;
  if (std::string err = sm80::allow_dynamic_smem(dkdv, kDkdvBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_k, kTileRows), p.heads_kv, p.batch, &grid); !err.empty())
    return err;
  if (grid > 0) {
    dkdv<<<grid, kThreads, kDkdvBytes, stream>>>(p, vectorized);
    if (std::string err = sm80::last_launch_error("float32 dK/dV kernel launch"); !err.empty()) return err;
  }

  constexpr int kDqBytes = DqSmem<kHeadDim>::kBytes;
  auto dq = transforms ? dq_kernel<kHeadDim, true> : dq_kernel<kHeadDim, false>;
  if (std::string err = sm80::allow_dynamic_smem(dq, kDqBytes); !err.empty()) return err;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, kTileRows), p.heads_q, p.batch, &grid); !err.empty())
    return err;
  if (grid == 0) return {};
  dq<<<grid, kThreads, kDqBytes, stream>>>(p, vectorized);
  return sm80::last_launch_error("float32 dQ kernel launch");
}

}  // namespace jax_flash::cuda::f32
