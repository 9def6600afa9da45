// launch_backward for one (head dim, element type) of the Hopper backward (sm_90a only):
//   1. softmax_d = rowsum(dO * O) - dlse   (sm80's row pass, in a kernel of this family)
//   2. the GEMM passes in the kernel form the call needs (backward_form.h: common; transforms for softcap/ALiBi;
//      masked for a boolean mask), each form's launcher (backward_launch.h) instantiated in a translation unit of
//      its own:
//   3. with a dq_accum workspace (where jax_flash/_ffi_calls.py declares one; never for deterministic calls,
//      JAX_FLASH_FUSED_DQ=0 turns it off) where has_fused_dq (d=64, d=128): dQ is summed into it by the dK/dV pass
//      (zeroed by step 1's pass, row by row beside its reads: on the H200 a memset of its own cost 0-2% of the
//      backward, benchmarks/NOTES.md twenty-fifth session), one bulk reduction per item into its tile-major layout,
//      and one pass scales and converts it (dq_staging.h dq_from_tiles). Otherwise the dQ pass recomputes S and dP:
//      no atomics anywhere, bit-reproducible. Fused is the default at d=64 and d=128: with one bulk reduction per
//      item, d=128 4k on the H200 473 vs 413 TFLOP/s (causal 397 vs 352), d=64 through JAX 0-9% faster
//      (benchmarks/NOTES.md).
// The transforms and masked forms exist only where has_transforms_form (not at d=256; dispatch.cu refuses those
// calls). The dispatcher routes here only calls without bias, dbias or dropout, with softmax_scale > 0,
// head_dim % 8 == 0, 16-byte aligned operands and non-empty sequences (dispatch.cu sm90_backward_refusal).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "../../common/attention_params.h"
#include "../common/block_range.h"
#include "../common/dq_accum.h"
#include "../sm80/backward_row_kernels.h"
#include "../sm80/launch_common.h"
#include "../sm80/softmax_d_launch.h"
#include "backward_form.h"
#include "backward_traits.h"
#include "dq_staging.h"

namespace jax_flash::cuda::sm90 {

// Defined in backward_launch.h; instantiated by instantiations/backward_hdim{D}_{type}_{form}.cu (OutElement = Element)
// and backward_hdim{D}_fp16_f32grad_{form}.cu (float16 operands, OutElement = float).
template <int kHeadDim, class Element, BackwardForm kForm, class OutElement>
std::string launch_backward_form(const AttentionBackwardParams& p, bool fused_dq, cudaStream_t stream);

// kZeroDqAccum: the fused dQ's workspace is zeroed by this pass (sm80/backward_row_kernels.h zero_dq_accum_of_row).
template <class T, bool kZeroDqAccum>
__global__ void __launch_bounds__(sm80::kRowKernelWarps * 32) softmax_d_kernel(const AttentionBackwardParams p) {
  sm80::softmax_d_rows<T, kZeroDqAccum>(p);
}

// At least three CTAs per SM (at most 85 registers per thread), so that other CTAs' loads overlap one's barriers and
// stores (without the bound d=128 took 116 registers, two CTAs per SM; four, 64 registers, spilled).
template <class Traits>
__global__ void __launch_bounds__(kDqConvertThreads, 3) dq_from_tiles_kernel(const AttentionBackwardParams p) {
  dq_from_tiles<Traits>(p);
}

// OutElement: dK's, dV's and dQ's type, Element (the 16-bit calls) or float (float16 operands with float32 gradients,
// AttentionBackwardParams::float32_gradients: dK / dV stored from the accumulators, backward_key_block.h
// store_float_key_rows; dQ converted to float32 from the fused dQ's workspace, or stored so by the dQ pass).
template <int kHeadDim, class Element, class OutElement>
std::string launch_backward(const AttentionBackwardParams& p, cudaStream_t stream) {
  if (p.batch > INT32_MAX || p.heads_q > INT32_MAX) return "sm90 backward: batch or heads beyond TMA coordinates";
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return "sm90 backward: empty sequences (a TMA descriptor needs data)";
  // The bulk reductions need 16-byte aligned chunks: XLA's buffers are; otherwise the separate pass.
  const bool use_fused_dq = has_fused_dq(kHeadDim) && p.dq_accum != nullptr && !p.deterministic &&
                            reinterpret_cast<uintptr_t>(p.dq_accum) % 16 == 0;
  auto softmax_d = softmax_d_kernel<Element, false>;
  if constexpr (has_fused_dq(kHeadDim)) {  // only these head dims instantiate the zeroing form
    if (use_fused_dq) softmax_d = softmax_d_kernel<Element, true>;
  }
  if (std::string err = sm80::launch_softmax_d<Element>(p, softmax_d, stream, "sm90"); !err.empty()) {
    return err;
  }
  const BackwardForm form = backward_form(p);
  auto gemm_passes = [&](bool fused_dq) -> std::string {
    if constexpr (has_transforms_form(kHeadDim)) {
      if (form == BackwardForm::kMasked) {
        return launch_backward_form<kHeadDim, Element, BackwardForm::kMasked, OutElement>(p, fused_dq, stream);
      }
      if (form == BackwardForm::kTransforms) {
        return launch_backward_form<kHeadDim, Element, BackwardForm::kTransforms, OutElement>(p, fused_dq, stream);
      }
    } else if (form != BackwardForm::kCommon) {
      return "sm90 backward: no softcap/ALiBi/mask form at this head dim";
    }
    return launch_backward_form<kHeadDim, Element, BackwardForm::kCommon, OutElement>(p, fused_dq, stream);
  };
  if constexpr (has_fused_dq(kHeadDim)) {
    if (use_fused_dq) {
      // The pre-pass zeroed the workspace: no memset.
      return run_fused_dq(p, stream, /*count=*/0, [&] { return gemm_passes(true); },
                          dq_from_tiles_kernel<DkdvTraits<kHeadDim, Element, OutElement>>, dq_workspace_chunks(p),
                          "sm90");
    }
  }
  return gemm_passes(false);
}

}  // namespace jax_flash::cuda::sm90
