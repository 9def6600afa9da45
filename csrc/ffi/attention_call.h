// The operands and attributes of the two custom calls, their decoding into AttentionParams, and the one
// Bind() chain per call that every platform's handler shares (so the CPU and CUDA signatures cannot drift).
#pragma once

#include <cstdint>
#include <utility>

#include "../common/attention_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash::ffi_boundary {

namespace ffi = xla::ffi;

// Custom-call target names, registered for every platform the extension was built for.
inline constexpr const char* kForwardTarget = "jax_flash_attention_forward";
inline constexpr const char* kBackwardTarget = "jax_flash_attention_backward";

// Optional per-batch operands; a zero-size last axis means "absent".
struct MaskOperands {
  ffi::AnyBuffer alibi_slopes;    // [*batch, heads_q | 0] float32
  ffi::AnyBuffer q_seqlens;       // [*batch, 1 | 0] int32
  ffi::AnyBuffer kv_seqlens;      // [*batch, 1 | 0] int32
  ffi::AnyBuffer q_segment_ids;   // [*batch, seqlen_q | 0] int32
  ffi::AnyBuffer kv_segment_ids;  // [*batch, seqlen_k | 0] int32
  ffi::AnyBuffer bias;            // [*vmap, batch|1, heads_q|1, seqlen_q|1, seqlen_k|1] float32, or [*vmap, 1, 1, 1, 0]
  ffi::AnyBuffer mask;            // likewise, bool (true = visible)
  ffi::AnyBuffer mask_blocks;     // the mask's block summary (common/mask_blocks.h) uint8, or [*vmap, 1, 1, 1, 0]
  ffi::AnyBuffer dropout_seeds;   // [*batch, 2 | 0] uint32
};

struct ScoreAttributes {
  float softmax_scale;
  float softcap;
  bool causal;
  bool align_to_sequence_end;
  int64_t diagonal_offset;
  int64_t window_left;
  int64_t window_right;
  float dropout_rate;
  bool allow_tf32;
};

// How a forward call's rows map onto the attention it computes (1 and 1: directly).
struct ForwardLayout {
  int64_t packed_heads;  // query rows per position, a power of two: GQA packing (AttentionParams::position_shift)
  int64_t kv_chunks;     // key chunks per sequence as batch rows: split-KV (AttentionParams::kv_chunks)
};

// tf32_vt: float32 [*batch, heads_kv, per head] (common/tf32_workspace.h), or empty.
ffi::Error decode_forward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, const MaskOperands& masks,
                          ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer tf32_vt,
                          const ScoreAttributes& attributes, const ForwardLayout& layout, AttentionParams* params);

struct BackwardOperands {
  ffi::AnyBuffer q, k, v, o, lse, d_o, d_lse;
};
struct BackwardResults {
  ffi::AnyBuffer dq, dk, dv, softmax_d;
  ffi::AnyBuffer dq_accum;  // float32 [*batch, heads_q, per head] (common/dq_workspace.h), or empty (no fused dQ)
  ffi::AnyBuffer dkdv_tail;  // float32, any shape (common/dq_workspace.h: dkdv_tail_elements), or empty
  ffi::AnyBuffer dbias;  // like the bias operand (float32), or [*vmap, 1, 1, 1, 0] when not wanted
};

ffi::Error decode_backward(const BackwardOperands& in, const MaskOperands& masks, const BackwardResults& out,
                           const ScoreAttributes& attributes, bool deterministic, AttentionBackwardParams* params);

// Appends the attributes shared by both calls, in the order the handlers take them.
template <typename Binding>
auto bind_score_attributes(Binding binding) {
  return std::move(binding).template Attr<float>("softmax_scale")
      .template Attr<float>("softcap")
      .template Attr<bool>("causal")
      .template Attr<bool>("align_to_sequence_end")
      .template Attr<int64_t>("diagonal_offset")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<float>("dropout_rate")
      .template Attr<bool>("allow_tf32");
}

template <typename Binding>
auto bind_mask_operands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // alibi_slopes
      .template Arg<ffi::AnyBuffer>()            // q_seqlens
      .template Arg<ffi::AnyBuffer>()            // kv_seqlens
      .template Arg<ffi::AnyBuffer>()            // q_segment_ids
      .template Arg<ffi::AnyBuffer>()            // kv_segment_ids
      .template Arg<ffi::AnyBuffer>()            // bias
      .template Arg<ffi::AnyBuffer>()            // mask
      .template Arg<ffi::AnyBuffer>()            // mask_blocks
      .template Arg<ffi::AnyBuffer>();           // dropout_seeds
}

// forward(q, k, v, masks...) -> (o, lse, tf32_vt). Bindings can only be moved by their own methods, so each chain is
// one expression of temporaries.
template <typename Binding>
auto bind_forward(Binding binding) {
  return bind_score_attributes(bind_mask_operands(std::move(binding)
                                                      .template Arg<ffi::AnyBuffer>()   // q
                                                      .template Arg<ffi::AnyBuffer>()   // k
                                                      .template Arg<ffi::AnyBuffer>())  // v
                                   .template Ret<ffi::AnyBuffer>()                      // o
                                   .template Ret<ffi::AnyBuffer>()                      // lse
                                   .template Ret<ffi::AnyBuffer>())                     // tf32_vt (workspace)
      .template Attr<int64_t>("packed_heads")
      .template Attr<int64_t>("kv_chunks");
}

// backward(q, k, v, o, lse, d_o, d_lse, masks...) -> (dq, dk, dv, softmax_d, dq_accum, dkdv_tail, dbias)
template <typename Binding>
auto bind_backward(Binding binding) {
  return bind_score_attributes(bind_mask_operands(std::move(binding)
                                                      .template Arg<ffi::AnyBuffer>()   // q
                                                      .template Arg<ffi::AnyBuffer>()   // k
                                                      .template Arg<ffi::AnyBuffer>()   // v
                                                      .template Arg<ffi::AnyBuffer>()   // o
                                                      .template Arg<ffi::AnyBuffer>()   // lse
                                                      .template Arg<ffi::AnyBuffer>()   // d_o
                                                      .template Arg<ffi::AnyBuffer>())  // d_lse
                                   .template Ret<ffi::AnyBuffer>()                      // dq
                                   .template Ret<ffi::AnyBuffer>()                      // dk
                                   .template Ret<ffi::AnyBuffer>()                      // dv
                                   .template Ret<ffi::AnyBuffer>()                      // softmax_d (workspace)
                                   .template Ret<ffi::AnyBuffer>()                      // dq_accum (workspace)
                                   .template Ret<ffi::AnyBuffer>()                      // dkdv_tail (workspace)
                                   .template Ret<ffi::AnyBuffer>())                     // dbias
      .template Attr<bool>("deterministic");
}

}  // namespace jax_flash::ffi_boundary
