// The three compiled forms of the Hopper backward and which one a call needs (the backward's counterpart of
// forward_variant.h). Each form is its own instantiation of both kernels, in a translation unit of its own
// (instantiations/backward_hdim{D}_{type}_{form}.cu), so a call without softcap, ALiBi or a mask runs code that has
// none of their per-element work. Additive bias, dbias and dropout have no form here: those calls run the sm80
// backward (dispatch.cu sm90_backward_refusal).
#pragma once

#include "../../common/attention_params.h"

namespace jax_flash::cuda::sm90 {

enum class BackwardForm {
  kCommon,      // raw dots and position masks; the scale folds into the exp2 argument
  kTransforms,  // + softcap and/or ALiBi: scores transformed element by element, the scale inside the transform
                //   (transformed_scores.h)
  kMasked,      // + a boolean mask: the transforms form's per-element path, which also skips the work items the
                //   mask's block summary hides and reads mask elements only in the partially hidden ones
                //   (backward_mask_walk.h, masked_scores.h)
};

// Whether the kernels transform scores element by element (transformed_scores.h) rather than folding the scale.
constexpr bool transforms_scores(BackwardForm form) { return form != BackwardForm::kCommon; }

// Whether the kernels read the boolean mask (its block summary and, where that says partial, its elements).
constexpr bool reads_boolean_mask(BackwardForm form) { return form == BackwardForm::kMasked; }

// The form a call needs. A softcap/ALiBi call with a mask takes the masked form, which transforms scores as well.
inline BackwardForm backward_form(const AttentionParams& p) {
  if (p.mask != nullptr) return BackwardForm::kMasked;
  return p.softcap > 0.0f || p.alibi_slopes != nullptr ? BackwardForm::kTransforms : BackwardForm::kCommon;
}

// Whether the dK/dV kernel of this head dim has the fused-dQ form (in every score form): with a dq_accum workspace
// (which the Python side declares only where fusing measured faster: jax_flash/_ffi_calls.py _uses_fused_dq) it
// sums dQ there instead of the launcher running the separate dQ pass. Never d=256 (the split kernel has no shared
// memory left for the staged tile). Measured faster at both (one bulk reduction per item): d=128 4k 473 vs 413
// TFLOP/s (standalone), d=64 through JAX 0-9% faster than the separate pass (sixth session).
constexpr bool has_fused_dq(int head_dim) { return head_dim == 64 || head_dim == 128; }

// Whether the head dim has the transforms and masked forms: not the d=256 split-head-dim kernel (dispatch.cu
// refuses softcap/ALiBi/mask there, so those calls run the sm80 backward).
constexpr bool has_transforms_form(int head_dim) { return head_dim <= 128; }

}  // namespace jax_flash::cuda::sm90
