// The shared score pipeline (score_pipeline.h) applied to one accumulator tile of raw q.k dot products.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/score_pipeline.h"
#include "fragments.h"
#include "keep_bits.h"

namespace jax_flash::cuda::sm80 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x as the single MUFU.EX2 instruction. exp2f without fast-math adds denormal range fix-ups around it (three
// more instructions per probability); flushing results below 2^-126 to zero is harmless for softmax weights.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The "general" variant: anything that needs each score element by element (softcap, ALiBi, an additive bias, a
// boolean mask) or each probability (dropout). A compile-time choice (kernels are built both ways) because its
// registers would otherwise crowd the accumulators of the common case. Without it the tile keeps raw dots and
// the scale is folded into the exp2 argument -- which needs softmax_scale > 0: the row maximum of raw dots is the
// maximum of the scores only for a positive scale, and a zero scale would turn masked -inf dots into NaN.
__host__ __device__ inline bool needs_general_variant(const AttentionParams& p) {
  return p.softcap > 0.0f || p.alibi_slopes != nullptr || p.bias != nullptr || p.mask != nullptr ||
         p.dropout_rate > 0.0f || !(p.softmax_scale > 0.0f);
}

// Callbacks of ScoreTile::apply that do nothing.
struct IgnoreVisible {
  __device__ void operator()(int, int, int64_t, int64_t, float) const {}
};
struct IgnoreHidden {
  __device__ void operator()(int, int) const {}
};

// tanh(s / softcap) in the half-precision kernels: s times the reciprocal (taken once per tile, by of()) and one
// MUFU.TANH (tanh.approx.f32, relative error about 2^-11, below the rounding of a bf16/fp16 logit). A softcap score
// then costs two MUFU operations (this and the softmax's EX2) instead of three with a division per element; tanhf
// and an IEEE division are long FMA-pipe sequences (the sm90 softcap forward measured 146 TFLOP/s with them
// against 621 without softcap, d=128 4k). Forward and backward both build theirs with of(), so they compute the
// same logits bit for bit (P must match the forward's lse).
struct FastSoftcapTanh {
  float inverse;  // 1 / softcap

  __device__ __forceinline__ static FastSoftcapTanh of(float softcap) {
    return {softcap > 0.0f ? __frcp_rn(softcap) : 0.0f};  // correctly rounded, without the division's slow path
  }
  __device__ __forceinline__ float operator()(float s, float /*softcap*/) const {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(s * inverse));
    return t;
  }
};

// Kernels build one where a tile is scored rather than holding it across their main loop: its fields come from
// kernel parameters (constant bank) and a few cached loads, and the registers go to the accumulators instead.
// kReadsBiasOrMask = false (general variant only) compiles no bias or boolean-mask reads, for a kernel form that
// never gets them (the sm90 forward's softcap/ALiBi form: sm90/forward_variant.h).
//
// kUnswitchSoftcap compiles the tile loop twice, with and without the softcap, and computes ALiBi's distance in
// float from a per-row value, so that no element carries a branch or 64-bit integer work: the sm90 forward's feature
// forms take it (d=128 transforms form spills 62/76 -> 50/56 bytes), on the theory that a branch per element cuts
// the unrolled loop into blocks the scheduler cannot interleave (not measured apart: the sixth session changed this
// together with the softcap reciprocal, and the forms got 1.9-2x faster). The sm80 kernels keep transform_score
// per element (Softcap::kTested): the other form raised their spills (see apply_with).
template <bool kGeneral, bool kReadsBiasOrMask = kGeneral, bool kUnswitchSoftcap = false>
struct ScoreTile {
  static_assert(kGeneral || !kReadsBiasOrMask, "bias and boolean mask are general-variant work");

  SliceMask mask;
  float softmax_scale;
  float softcap;

  // read_boolean_mask = false drops the per-element mask reads, for a tile whose mask blocks are all visible
  // (common/mask_blocks.h).
  // Params: AttentionParams or AttentionBackwardParams, whose make_slice_mask drops the forward's row layouts.
  template <class Params>
  __device__ static ScoreTile make(const Params& p, int64_t batch, int64_t head, bool read_boolean_mask = true) {
    ScoreTile tile{make_slice_mask(p, batch, head), p.softmax_scale, p.softcap};
    if (!read_boolean_mask) tile.mask.mask = nullptr;
    return tile;
  }
  // Multiplier from the tile's units (after apply) to log2-domain logits.
  __device__ static float to_log2(const AttentionParams& p) {
    return kGeneral ? kLog2e : p.softmax_scale * kLog2e;
  }

  // Raw dots -> final scores in place for the tile at (row0, col0); invisible entries become -inf.
  // Columns are handled as this thread's first column plus a compile-time offset, so the per-element mask test
  // compares an immediate against two per-row limits.
  // With kGeneral the boolean mask is tested on every tile the kernel did not find fully visible in its block
  // summary, and
  // on_visible(r, c, row, col, dscore_ddot) sees each visible element once its score is final, with the softcap
  // chain-rule factor; on_hidden(r, c) sees the others, after they became -inf.
  template <bool kCheckMask, class Acc, class Coords, class OnVisible = IgnoreVisible, class OnHidden = IgnoreHidden>
  __device__ void apply(Acc& acc, Coords const& coords, int64_t row0, int64_t col0, OnVisible on_visible = {},
                        OnHidden on_hidden = {}) const {
    apply_inlined<kCheckMask>(acc, coords, row0, col0, on_visible, on_hidden);
  }
  // apply, always inlined. Left to the compiler, the general form's two loop copies made apply a called function
  // in the Hopper bf16 dense forward, so its score accumulator went through local memory, and ptxas serialised
  // that kernel's WGMMAs at d=128 (C7514: accumulator registers read inside the pipeline stage). Callers whose
  // accumulator is a WGMMA's use this; the mma.sync kernels keep apply as the compiler chooses.
  template <bool kCheckMask, class Acc, class Coords, class OnVisible = IgnoreVisible, class OnHidden = IgnoreHidden>
  __device__ __forceinline__ void apply_inlined(Acc& acc, Coords const& coords, int64_t row0, int64_t col0,
                                                OnVisible on_visible = {}, OnHidden on_hidden = {}) const {
    if constexpr (kGeneral && kUnswitchSoftcap) {
      if (softcap > 0.0f) {
        apply_unswitched<kCheckMask, Softcap::kOn>(acc, coords, row0, col0, on_visible, on_hidden);
      } else {
        apply_unswitched<kCheckMask, Softcap::kOff>(acc, coords, row0, col0, on_visible, on_hidden);
      }
    } else if constexpr (kGeneral) {
      apply_with<kCheckMask, Softcap::kTested>(acc, coords, row0, col0, on_visible, on_hidden);
    } else if constexpr (kCheckMask) {
      apply_unswitched<kCheckMask, Softcap::kOff>(acc, coords, row0, col0, on_visible, on_hidden);
    }
  }

  // Tile-local column limits: anything outside [-1, 2^30] behaves the same for a tile narrower than 2^30.
  __device__ static int clamp_to_int(int64_t x) {
    return static_cast<int>(x < -1 ? -1 : (x > (1 << 30) ? (1 << 30) : x));
  }

 private:
  // Where the softcap test sits: kTested, in every visible element (one copy of the tile loop); kOn / kOff, in
  // apply (kUnswitchSoftcap: a copy of the loop each, no branch per element).
  enum class Softcap { kOff, kOn, kTested };

  // Without segment ids (most calls) a masked tile's element test is two compares and a select; with them it also
  // loads each key's id under a branch. One copy of the loop each, so that the common case carries no branch per
  // element (with the loads compiled in, the sm90 d=64 forward's masked tiles had one per element). Unmasked tiles
  // have no segment test to drop. Without a left window (causal calls above all) no row has a first visible key
  // but 0, so the element test drops its lower bound too: one compare and a select (Nsight Compute, d=64 causal 1k,
  // standard tile: two ISETPs and an FSEL per element of the diagonal tile, ISETP 8.4 M executed against cuDNN's
  // 1.4 M; NOTES, fifty-third session). Kernel time, H100, sm90 d=64 causal 1k / 2k: -1.3-1.9% / -1.5-1.9% (NOTES,
  // fifty-fourth session).
  template <bool kCheckMask, Softcap kSoftcap, class Acc, class Coords, class OnVisible, class OnHidden>
  __device__ __forceinline__ void apply_unswitched(Acc& acc, Coords const& coords, int64_t row0, int64_t col0,
                                                   OnVisible& on_visible, OnHidden& on_hidden) const {
    if constexpr (kCheckMask) {
      if (mask.q_segment_ids == nullptr) {
        if (mask.window_left < 0) {
          apply_with<kCheckMask, kSoftcap, false, false>(acc, coords, row0, col0, on_visible, on_hidden);
        } else {
          apply_with<kCheckMask, kSoftcap, false>(acc, coords, row0, col0, on_visible, on_hidden);
        }
        return;
      }
    }
    apply_with<kCheckMask, kSoftcap>(acc, coords, row0, col0, on_visible, on_hidden);
  }

  // kSegments = false: the caller knows the call has no segment ids. kLowerBound = false: the caller knows the call
  // has no left window (SliceMask::key_begin is 0 for every row).
  template <bool kCheckMask, Softcap kSoftcap, bool kSegments = true, bool kLowerBound = true, class Acc, class Coords,
            class OnVisible, class OnHidden>
  __device__ __forceinline__ void apply_with(Acc& acc, Coords const& coords, int64_t row0, int64_t col0,
                                             OnVisible& on_visible, OnHidden& on_hidden) const {
    auto scores = as_rows_cols(acc);
    auto score_coords = as_rows_cols(coords);
    const int64_t first_col = col0 + cute::get<1>(score_coords(0, 0));
    // Bias and mask are read relative to this thread's first element, with 32-bit offsets (row offset < block_m
    // times a stride that is at most seqlen_k < 2^31; the key stride is 0 or 1), so that no 64-bit address per
    // row or element stays live.
    const int64_t first_row = row0 + cute::get<0>(score_coords(0, 0));
    const float* bias_origin = nullptr;
    const bool* mask_origin = nullptr;
    int bias_row_stride = 0, bias_col_stride = 0, mask_row_stride = 0, mask_col_stride = 0;
    if constexpr (kReadsBiasOrMask) {
      if (mask.bias != nullptr) {
        bias_origin = mask.bias + first_row * mask.bias_strides.query + first_col * mask.bias_strides.key;
        bias_row_stride = static_cast<int>(mask.bias_strides.query);
        bias_col_stride = static_cast<int>(mask.bias_strides.key);
      }
      if (mask.mask != nullptr) {
        mask_origin = mask.mask + first_row * mask.mask_strides.query + first_col * mask.mask_strides.key;
        mask_row_stride = static_cast<int>(mask.mask_strides.query);
        mask_col_stride = static_cast<int>(mask.mask_strides.key);
      }
    }
    const FastSoftcapTanh softcap_tanh = FastSoftcapTanh::of(kSoftcap == Softcap::kOff ? 0.0f : softcap);
    CUTE_UNROLL
    for (int r = 0; r < cute::size<0>(scores); ++r) {
      const int64_t row = row0 + cute::get<0>(score_coords(r, 0));
      // ALiBi's distance row + diagonal_shift - col of this row's first column; an element's is this minus its
      // compile-time offset, in float.
      const float first_distance = static_cast<float>(row + mask.diagonal_shift - first_col);
      const int begin = kLowerBound ? clamp_to_int(mask.key_begin(row) - first_col) : -1;
      const int end = clamp_to_int(mask.key_end(row) - first_col);
      const bool segments = kCheckMask && kSegments && mask.q_segment_ids != nullptr && row < mask.valid_q;
      const int32_t* kv_segments = segments ? mask.kv_segment_ids + first_col : nullptr;
      const int32_t row_segment = segments ? mask.q_segment_ids[row] : 0;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(scores); ++c) {
        const int offset = cute::get<1>(score_coords(r, c)) - cute::get<1>(score_coords(0, 0));
        // Position and segment tests first: they bound the bias and mask reads to in-range elements.
        if (kCheckMask && (offset < begin || offset >= end || (segments && kv_segments[offset] != row_segment))) {
          scores(r, c) = -INFINITY;
          on_hidden(r, c);
        } else if (kGeneral) {
          const int64_t col = first_col + offset;
          const int local_row = cute::get<0>(score_coords(r, 0)) - cute::get<0>(score_coords(0, 0));
          if (mask_origin != nullptr && !mask_origin[local_row * mask_row_stride + offset * mask_col_stride]) {
            scores(r, c) = -INFINITY;
            on_hidden(r, c);
          } else {
            if constexpr (kSoftcap == Softcap::kTested) {
              // score_pipeline.h's transform_score itself (branches per element, 64-bit ALiBi distance), then the
              // bias: the sm80 kernels' registers are tight, and the unswitched form's code below raised their
              // spills (d=128 general forward, sm_90a: 244/424 -> 564/776 bytes; this form: 276/460).
              float dscore_ddot;
              const float bias =
                  bias_origin != nullptr ? bias_origin[local_row * bias_row_stride + offset * bias_col_stride] : 0.0f;
              scores(r, c) = transform_score(scores(r, c), softmax_scale, softcap, mask.alibi_slope, row, col,
                                             mask.diagonal_shift, &dscore_ddot, softcap_tanh) +
                             bias;
              on_visible(r, c, row, col, dscore_ddot);
            } else {
              // transform_score without a branch per element: the softcap is compiled in or out, and the ALiBi
              // term is always there (the slope is 0 without ALiBi, and s - 0 * |distance| = s); the distance, in
              // float, is exact below 2^24, so the term is transform_score's slope * float(|distance|).
              float s = scores(r, c) * softmax_scale;
              float dscore_ddot = 1.0f;
              if constexpr (kSoftcap == Softcap::kOn) {
                const float t = softcap_tanh(s, softcap);
                s = softcap * t;
                dscore_ddot = 1.0f - t * t;
              }
              s -= mask.alibi_slope * fabsf(first_distance - static_cast<float>(offset));
              scores(r, c) =
                  bias_origin != nullptr ? s + bias_origin[local_row * bias_row_stride + offset * bias_col_stride] : s;
              on_visible(r, c, row, col, dscore_ddot);
            }
          }
        }
      }
    }
  }

};

}  // namespace jax_flash::cuda::sm80
