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

// Whether the dK/dV pass may also sum dQ into the dq_accum workspace (the fused dQ), in either form; otherwise the
// launcher runs the separate dQ pass whatever the call gives. d=64 fused measured far slower through JAX on the
// H200 (4k: 242 vs 359 TFLOP/s; half the GEMM work per item against the same 64 bulk row reductions), d=128 faster
// (452 vs 414).
constexpr bool has_fused_dq(int head_dim) { return head_dim == 128; }

}  // namespace jax_flash::cuda::sm90
