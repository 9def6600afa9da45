// The two compiled forms of the Hopper backward and which one a call needs (the backward's counterpart of
// forward_variant.h, without a dense form: bias, boolean masks and dropout run on the sm80 backward). Each form is
// its own instantiation of both kernels, in a translation unit of its own (instantiations/backward_hdim{D}_{type}_
// {form}.cu), so a call without softcap or ALiBi runs code that has none of their per-element work.
#pragma once

#include "../../common/attention_params.h"

namespace jax_flash::cuda::sm90 {

// Whether a call needs the transforms form (softcap and/or ALiBi: scores transformed element by element, the
// scale inside the transform); the common form folds the scale into the exp2 argument.
inline bool backward_transforms_scores(const AttentionParams& p) {
  return p.softcap > 0.0f || p.alibi_slopes != nullptr;
}

// Whether the dK/dV kernel of this head dim has the fused-dQ form (in either score form): with a dq_accum workspace
// (which the Python side declares only where fusing measured faster: jax_flash/_ffi_calls.py _uses_fused_dq) it
// sums dQ there instead of the launcher running the separate dQ pass. Never d=256 (the split kernel has no shared
// memory left for the staged tile). Measured faster at both (one bulk reduction per item): d=128 4k 473 vs 413
// TFLOP/s (standalone), d=64 through JAX 0-9% faster than the separate pass (sixth session).
constexpr bool has_fused_dq(int head_dim) { return head_dim == 64 || head_dim == 128; }

// Whether the head dim has the transforms form: not the d=256 split-head-dim kernel (dispatch.cu refuses
// softcap/ALiBi there, so those calls run the sm80 backward).
constexpr bool has_transforms_form(int head_dim) { return head_dim <= 128; }

}  // namespace jax_flash::cuda::sm90
