// Host launchers of the float32 kernels for one head dim; instantiated once per generated .cu. p.allow_tf32
// picks the TF32 tensor-core kernels (the backward's up to head dim 128; above, it is the exact one). Softcap,
// ALiBi, bias, boolean mask and dropout take the kernels' general variant (score_element.h).
#pragma once

#include <algorithm>
#include <string>

#include "../../common/attention_params.h"
#include "../common/block_range.h"
#include "../sm80/backward_row_kernels.h"
#include "../sm80/launch_common.h"
#include "../sm80/softmax_d_launch.h"
#include "../common/dbias_plan.h"
#include "backward_kernels.h"
#include "dbias_kernel.h"
#include "forward_kernel.h"
#include "launchers.h"
#include "score_element.h"
#include "tf32_backward_kernels.h"
#include "tf32_forward_kernel.h"

namespace jax_flash::cuda::f32 {

// float4 tile loads need head_dim % 4 == 0 and 16-byte aligned tensors.
inline bool rows_are_16b_aligned(const AttentionParams& p) {
  return p.head_dim % 4 == 0 && sm80::aligned16(p.q) && sm80::aligned16(p.k) && sm80::aligned16(p.v);
}

// A readable error where a head dim's tiles need more shared memory than this GPU gives a block (head dims 192
// and 256 need sm90's 227 KiB), checked before a backward launches any of its kernels (a single kernel's launch
// gets the same message from sm80::allow_dynamic_smem).
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
  unsigned grid = 0;
  if (p.allow_tf32) {
    using G = Tf32ForwardGeometry<kHeadDim>;
    auto kernel = needs_general_variant(p) ? tf32_forward_kernel<kHeadDim, true> : tf32_forward_kernel<kHeadDim, false>;
    if (std::string err = sm80::allow_dynamic_smem(kernel, G::kBytes); !err.empty()) return err;
    if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, G::kBlockM), p.heads_q, p.batch, &grid); !err.empty())
      return err;
    if (grid == 0) return {};
    kernel<<<grid, G::kThreads, G::kBytes, stream>>>(p, rows_are_16b_aligned(p));
    return sm80::last_launch_error("float32 (TF32) forward kernel launch");
  }
  constexpr int kSmemBytes = ForwardSmem<kHeadDim>::kBytes;
  auto kernel = needs_general_variant(p) ? forward_kernel<kHeadDim, true> : forward_kernel<kHeadDim, false>;
  if (std::string err = sm80::allow_dynamic_smem(kernel, kSmemBytes); !err.empty()) return err;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, kTileRows), p.heads_q, p.batch, &grid); !err.empty())
    return err;
  if (grid == 0) return {};
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, rows_are_16b_aligned(p));
  return sm80::last_launch_error("float32 forward kernel launch");
}

template <int kHeadDim>
std::string launch_tf32_dkdv_dq(const AttentionBackwardParams& p, bool vectorized, bool general,
                                DbiasMode dbias_mode, Tf32Passes hopper, cudaStream_t stream) {
  if (hopper.given()) {  // dispatch.cu hands them over for common-variant calls only
    if (general) return "internal error: the sm90 TF32 kernels were chosen for a call of the general variant";
    if (std::string err = hopper.dkdv(p, stream); !err.empty()) return err;
    return hopper.dq(p, stream);
  }
  using G = Tf32BackwardGeometry<kHeadDim>;
  if (std::string err = check_smem(G::kBytes, kHeadDim); !err.empty()) return err;
  auto dkdv = general ? tf32_dkdv_kernel<kHeadDim, true> : tf32_dkdv_kernel<kHeadDim, false>;
  if (std::string err = sm80::allow_dynamic_smem(dkdv, G::kBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_k, G::kBlock), p.heads_kv, p.batch, &grid); !err.empty())
    return err;
  if (grid > 0) {
    dkdv<<<grid, G::kThreads, G::kBytes, stream>>>(p, vectorized);
    if (std::string err = sm80::last_launch_error("float32 (TF32) dK/dV kernel launch"); !err.empty()) return err;
  }
  auto dq = general ? tf32_dq_kernel<kHeadDim, true> : tf32_dq_kernel<kHeadDim, false>;
  if (std::string err = sm80::allow_dynamic_smem(dq, G::kBytes); !err.empty()) return err;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, G::kBlock), p.heads_q, p.batch, &grid); !err.empty())
    return err;
  if (grid == 0) return {};
  dq<<<grid, G::kThreads, G::kBytes, stream>>>(p, vectorized, dbias_mode);
  return sm80::last_launch_error("float32 (TF32) dQ kernel launch");
}

// Exact float32 dbias of a broadcast bias, deterministic (dbias_kernel.h), in both precision modes.
template <int kHeadDim>
std::string launch_dbias(const AttentionBackwardParams& p, bool vectorized, DbiasBroadcast broadcast,
                         cudaStream_t stream) {
  constexpr int kBytes = DbiasSmem<kHeadDim>::kBytes;
  if (std::string err = sm80::allow_dynamic_smem(dbias_kernel<kHeadDim>, kBytes); !err.empty()) return err;
  const DbiasGrid grid = make_dbias_grid(p, broadcast, kTileRows, kTileRows);
  unsigned blocks = 0;
  if (std::string err = sm80::grid_size(int64_t(grid.m_tiles) * grid.n_tiles, grid.slice_heads,
                                        p.outer_batch * grid.slice_batches, &blocks);
      !err.empty())
    return err;
  if (blocks == 0) return {};
  dbias_kernel<kHeadDim><<<blocks, kThreads, kBytes, stream>>>(p, vectorized, grid);
  return sm80::last_launch_error("float32 dbias kernel launch");
}

template <int kHeadDim>
std::string launch_dkdv_dq(const AttentionBackwardParams& p, bool vectorized, bool general, DbiasMode dbias_mode,
                           Tf32Passes hopper, cudaStream_t stream) {
  if constexpr (kHeadDim <= 128) {
    if (p.allow_tf32 || hopper.given()) {  // exact with `hopper`: the split-TF32 passes
      return launch_tf32_dkdv_dq<kHeadDim>(p, vectorized, general, dbias_mode, hopper, stream);
    }
  }
  if (hopper.given()) return "internal error: the sm90 TF32 kernels were chosen for a call wider than 128";

  constexpr int kDkdvBytes = DkdvGeometry<kHeadDim>::kBytes;
  auto dkdv = general ? dkdv_kernel<kHeadDim, true> : dkdv_kernel<kHeadDim, false>;
  if (std::string err = sm80::allow_dynamic_smem(dkdv, kDkdvBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_k, kTileRows), p.heads_kv, p.batch, &grid); !err.empty())
    return err;
  if (grid > 0) {
    dkdv<<<grid, kThreads, kDkdvBytes, stream>>>(p, vectorized);
    if (std::string err = sm80::last_launch_error("float32 dK/dV kernel launch"); !err.empty()) return err;
  }

  constexpr int kDqBytes = DqSmem<kHeadDim>::kBytes;
  auto dq = general ? dq_kernel<kHeadDim, true> : dq_kernel<kHeadDim, false>;
  if (std::string err = sm80::allow_dynamic_smem(dq, kDqBytes); !err.empty()) return err;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, kTileRows), p.heads_q, p.batch, &grid); !err.empty())
    return err;
  if (grid == 0) return {};
  dq<<<grid, kThreads, kDqBytes, stream>>>(p, vectorized, dbias_mode);
  return sm80::last_launch_error("float32 dQ kernel launch");
}

template <int kHeadDim>
std::string launch_backward(const AttentionBackwardParams& p, cudaStream_t stream, Tf32Passes hopper) {
  if (std::string err = check_smem(std::max(DkdvGeometry<kHeadDim>::kBytes, DqSmem<kHeadDim>::kBytes), kHeadDim);
      !err.empty())
    return err;
  const bool vectorized = rows_are_16b_aligned(p) && sm80::aligned16(p.d_o);
  if (std::string err = sm80::launch_softmax_d<float>(p, sm80::softmax_d_kernel<float>, stream, "float32");
      !err.empty())
    return err;
  const bool general = needs_general_variant(p);
  const DbiasPlan dbias = plan_dbias(p);
  if (std::string err = launch_dkdv_dq<kHeadDim>(p, vectorized, general, dbias.dq_mode, hopper, stream);
      !err.empty())
    return err;
  if (dbias.separate_kernel && p.seqlen_q > 0 && p.seqlen_k > 0)
    return launch_dbias<kHeadDim>(p, vectorized, dbias.broadcast, stream);
  return {};
}

}  // namespace jax_flash::cuda::f32
