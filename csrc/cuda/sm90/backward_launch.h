// Host launcher of the Hopper backward for one (head dim, element type); instantiated once per generated .cu
// (sm_90a only):
//   1. softmax_d = rowsum(dO * O) - dlse   (sm80's row pass, in a kernel of this family)
//   2. dK/dV pass (backward_dkdv_kernel.h; at d=256 with backward_dkdv_split_consumer.h), one CTA per key tile
//      and KV head
//   3. with a dq_accum workspace (the default where jax_flash/_ffi_calls.py declares it; never for deterministic
//      calls, JAX_FLASH_FUSED_DQ=0 turns it off) where has_fused_dq (d=64, d=128): dQ was summed into it by step 2
//      (zeroed first), one bulk reduction per item into its tile-major layout; one pass scales and converts it
//      (dq_staging.h dq_from_tiles). Otherwise the dQ pass (backward_dq_kernel.h), one CTA per query tile and head,
//      recomputes S and dP: no atomics anywhere, bit-reproducible. Fused is the default at d=128 since its dQ tile
//      went through shared memory and bulk reductions: d=128 4k on the H200 449 vs 421 TFLOP/s, causal 388 vs 359
//      with one reduction per row (benchmarks/NOTES.md).
// The dispatcher routes here only calls of the common variant with head_dim % 8 == 0, 16-byte aligned operands
// and non-empty sequences (dispatch.cu sm90_backward_refusal).
#pragma once

#include <cstdint>
#include <string>

#include "../../common/attention_params.h"
#include "../../common/dq_workspace.h"
#include "../common/block_range.h"
#include "../common/dq_accum.h"
#include "../sm80/backward_row_kernels.h"
#include "../sm80/launch_common.h"
#include "backward_dkdv_kernel.h"
#include "backward_dq_kernel.h"
#include "backward_traits.h"
#include "dq_staging.h"
#include "forward_launch.h"  // bshd_tensor

namespace jax_flash::cuda::sm90 {

template <class T>
__global__ void __launch_bounds__(sm80::kRowKernelWarps * 32) softmax_d_kernel(const AttentionBackwardParams p) {
  sm80::softmax_d_rows<T>(p);
}

template <class Traits>
__global__ void __launch_bounds__(kDqConvertThreads) dq_from_tiles_kernel(const AttentionBackwardParams p) {
  dq_from_tiles<Traits>(p);
}

// The four TMA descriptors of a backward kernel: Q and dO tiles of TmaQ's box, K and V tiles of TmaKV's box.
template <class Traits, class QLayout, class KVLayout, int kQRows, int kKVRows>
BackwardArgs<Traits> backward_args(const AttentionBackwardParams& p) {
  using namespace cute;
  constexpr int kHeadDim = Traits::kHeadDim;
  auto q_tma = [&](const void* data) {
    return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor<Traits>(data, p.seqlen_q, p.heads_q, p.head_dim, p.batch),
                         QLayout{}, Shape<Int<kQRows>, Int<kHeadDim>>{}, _1{});
  };
  auto kv_tma = [&](const void* data) {
    return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor<Traits>(data, p.seqlen_k, p.heads_kv, p.head_dim, p.batch),
                         KVLayout{}, Shape<Int<kKVRows>, Int<kHeadDim>>{}, _1{});
  };
  return {p, q_tma(p.q), q_tma(p.d_o), kv_tma(p.k), kv_tma(p.v)};
}

template <int kHeadDim, class Element, bool kFusedDq>
std::string launch_dkdv(const AttentionBackwardParams& p, cudaStream_t stream) {
  using namespace cute;
  using Traits = DkdvTraitsFor<kHeadDim, Element>;
  const BackwardArgs<Traits> args =
      backward_args<Traits, decltype(take<0, 2>(typename Traits::SmemLayoutQ{})), typename Traits::SmemLayoutKV,
                    Traits::kBlockM, Traits::kBlockN>(p);
  auto kernel = dkdv_kernel<Traits, kFusedDq>;
  if (std::string err = sm80::allow_dynamic_smem(kernel, Traits::kSmemBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch, &grid);
      !err.empty()) {
    return err;
  }
  if (grid == 0) return {};
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return sm80::last_launch_error("sm90 dK/dV kernel launch");
}

template <int kHeadDim, class Element>
std::string launch_dq(const AttentionBackwardParams& p, cudaStream_t stream) {
  using namespace cute;
  using Traits = DqTraits<kHeadDim, Element>;
  const BackwardArgs<Traits> args =
      backward_args<Traits, typename Traits::SmemLayoutQ, decltype(take<0, 2>(typename Traits::SmemLayoutKV{})),
                    Traits::kBlockM, Traits::kBlockN>(p);
  auto kernel = dq_kernel<Traits>;
  if (std::string err = sm80::allow_dynamic_smem(kernel, Traits::kSmemBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch, &grid);
      !err.empty()) {
    return err;
  }
  if (grid == 0) return {};
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return sm80::last_launch_error("sm90 dQ kernel launch");
}

template <int kHeadDim, class Element>
std::string launch_backward(const AttentionBackwardParams& p, cudaStream_t stream) {
  if (p.batch > INT32_MAX || p.heads_q > INT32_MAX) return "sm90 backward: batch or heads beyond TMA coordinates";
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return "sm90 backward: empty sequences (a TMA descriptor needs data)";
  const int64_t rows = p.batch * p.seqlen_q * p.heads_q;
  const int64_t row_blocks = ceil_div(rows, sm80::kRowKernelWarps);
  if (row_blocks > INT32_MAX) return "attention problem too large for one launch (more than 2^31 - 1 CTAs)";
  if (row_blocks > 0) {
    softmax_d_kernel<Element><<<static_cast<unsigned>(row_blocks), sm80::kRowKernelWarps * 32, 0, stream>>>(p);
    if (std::string err = sm80::last_launch_error("sm90 softmax_d kernel launch"); !err.empty()) return err;
  }
  if constexpr (has_fused_dq(kHeadDim)) {
    // The bulk reductions need 16-byte aligned chunks: XLA's buffers are; otherwise the separate pass.
    if (p.dq_accum != nullptr && !p.deterministic && reinterpret_cast<uintptr_t>(p.dq_accum) % 16 == 0) {
      const int64_t chunks = p.batch * p.heads_q * dq_workspace_query_tiles(p.seqlen_q);  // one CTA each
      return run_fused_dq(
          p, stream, dq_workspace_elements(p.batch, p.seqlen_q, p.heads_q, p.head_dim),
          [&] { return launch_dkdv<kHeadDim, Element, true>(p, stream); },
          dq_from_tiles_kernel<DkdvTraits<kHeadDim, Element>>, chunks, "sm90");
    }
  }
  if (std::string err = launch_dkdv<kHeadDim, Element, false>(p, stream); !err.empty()) return err;
  return launch_dq<kHeadDim, Element>(p, stream);
}

}  // namespace jax_flash::cuda::sm90
