// The size of the float32 V^T workspace of a TF32 forward on the Hopper kernel (AttentionParams::tf32_vt), in one
// place for the Python side's declaration (jax_flash/_ffi_calls.py mirrors it), the FFI check and the launcher.
// A TF32 WGMMA reads its B operand K-major only, so P V needs V with keys contiguous: a pre-pass
// (cuda/sm90/tf32_v_transpose.h) writes [batch, heads_kv, kernel head dim, whole 8-key chunks] there, rounded to
// TF32, each chunk's keys in the order the probabilities' registers hold them.
#pragma once

#include <cstdint>

namespace jax_flash {

// The workspace exists only for head dims the TF32 kernel has (64 and 128; smaller ones are zero-padded to 64).
constexpr int64_t kTf32MaxHeadDim = 128;

// Keys per V^T row: seqlen_k in whole 8-key chunks.
constexpr int64_t tf32_vt_keys(int64_t seqlen_k) { return (seqlen_k + 7) / 8 * 8; }

// Rows of V^T per head: the kernel's head dim.
constexpr int64_t tf32_vt_head_dim(int64_t head_dim) { return head_dim <= 64 ? 64 : 128; }

// Floats per (batch row, KV head): the last axis of the declared shape [*batch, heads_kv, per_head].
constexpr int64_t tf32_vt_per_head(int64_t seqlen_k, int64_t head_dim) {
  return tf32_vt_head_dim(head_dim) * tf32_vt_keys(seqlen_k);
}

}  // namespace jax_flash
