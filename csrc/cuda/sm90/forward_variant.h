// The three compiled forms of the Hopper forward kernel and which one a call needs. Each form carries only the
// per-element work its calls use: the consumers' registers are all taken by the accumulators, so code a call never
// runs still costs spills: sharing one form with the bias/mask reads and the mask-summary tile walk, the softcap/ALiBi
// kernel spilled 426 bytes per thread at d=128 (nvcc 13.0); on its own it spills 86, fewer than main's general
// variant (174), which compiled the bias/mask reads too.
#pragma once

#include "../../common/attention_params.h"
#include "../sm80/score_tile.h"

namespace jax_flash::cuda::sm90 {

enum class ForwardVariant {
  kCommon,      // raw dots and position masks; the scale folds into the exp2 argument
  kTransforms,  // + softcap, ALiBi or a non-positive scale: scores transformed element by element, no extra loads
  kDense,       // + an additive bias and/or a boolean mask: per-element loads, and a key-tile walk that skips the
                //   tiles the mask's block summary hides (JAX_FLASH_SM90_DENSE=0 turns it off, dispatch.cu)
};

// Whether the kernel transforms scores element by element (sm80::ScoreTile's general variant).
constexpr bool transforms_scores(ForwardVariant v) { return v != ForwardVariant::kCommon; }

// Whether the kernel reads an additive bias or a boolean mask.
constexpr bool reads_bias_or_mask(ForwardVariant v) { return v == ForwardVariant::kDense; }

inline bool has_bias_or_mask(const AttentionParams& p) { return p.bias != nullptr || p.mask != nullptr; }

inline ForwardVariant forward_variant(const AttentionParams& p) {
  if (has_bias_or_mask(p)) return ForwardVariant::kDense;
  return sm80::needs_general_variant(p) ? ForwardVariant::kTransforms : ForwardVariant::kCommon;
}

}  // namespace jax_flash::cuda::sm90
