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

// Split TF32 (float32_precision="highest" on the Hopper kernel, JAX_FLASH_SM90_SPLIT_TF32): every operand x is
// carried as two TF32 numbers, hi = tf32(x) and lo = tf32(x - hi), and each product as lo*hi + hi*lo + hi*hi on
// the TF32 tensor cores (float32 accumulation), which leaves about 2^-21 of x*y: float32's accuracy at a third of
// TF32's rate. The workspace then holds six whole arrays one after the other: V^T hi and V^T lo (each as the V^T
// workspace above), Q hi and Q lo (each shaped like q), K hi and K lo (each shaped like k), written by the call's
// pre-passes (cuda/sm90/split_tf32_launch.h). Its declared shape [*batch, heads_kv, per_head] only sizes it (as
// many floats as those arrays, with `group` = heads_q / heads_kv query heads per KV head); its contents are not
// laid out along those axes. So it is sized consistently within any shard of batch rows and heads.
constexpr int64_t split_tf32_per_head(int64_t seqlen_q, int64_t seqlen_k, int64_t group, int64_t head_dim) {
  return 2 * (tf32_vt_per_head(seqlen_k, head_dim) + group * seqlen_q * head_dim + seqlen_k * head_dim);
}

// One operand's two parts in a split-TF32 workspace: whole arrays shaped like the operand, hi then lo.
struct OperandParts {
  float* hi;
  float* lo;
};

// The next operand's parts at *cursor, `count` floats each; moves the cursor past them.
inline OperandParts next_operand_parts(float** cursor, int64_t count) {
  const OperandParts parts{*cursor, *cursor + count};
  *cursor += 2 * count;
  return parts;
}

// The parts of a split-TF32 forward's workspace that starts at `base`, for `batch` (every leading dimension) x
// heads_kv (batch rows, KV heads).
struct SplitTf32Parts {
  OperandParts vt;
  OperandParts q;
  OperandParts k;
};

inline SplitTf32Parts split_tf32_parts(float* base, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                                       int64_t heads_q, int64_t heads_kv, int64_t head_dim) {
  float* cursor = base;
  // Braced initialisers run in order: the parts follow one another as listed.
  return {next_operand_parts(&cursor, batch * heads_kv * tf32_vt_per_head(seqlen_k, head_dim)),
          next_operand_parts(&cursor, batch * seqlen_q * heads_q * head_dim),
          next_operand_parts(&cursor, batch * seqlen_k * heads_kv * head_dim)};
}

// The split-TF32 backward (its dq_accum workspace on a float32 call: cuda/sm90/split_tf32_backward_launch.h) holds
// eight whole arrays one after the other: Q hi, Q lo, dO hi, dO lo (each shaped like q), K hi, K lo, V hi, V lo
// (each shaped like k). Declared [*batch, heads_kv, per_head] like the forward's, with the same caveat: the
// shape only sizes it.
constexpr int64_t split_tf32_backward_per_head(int64_t seqlen_q, int64_t seqlen_k, int64_t group, int64_t head_dim) {
  return 4 * (group * seqlen_q * head_dim + seqlen_k * head_dim);
}

struct SplitTf32BackwardParts {
  OperandParts q;
  OperandParts d_o;
  OperandParts k;
  OperandParts v;
};

inline SplitTf32BackwardParts split_tf32_backward_parts(float* base, int64_t batch, int64_t seqlen_q,
                                                        int64_t seqlen_k, int64_t heads_q, int64_t heads_kv,
                                                        int64_t head_dim) {
  const int64_t q = batch * seqlen_q * heads_q * head_dim;
  const int64_t k = batch * seqlen_k * heads_kv * head_dim;
  float* cursor = base;
  return {next_operand_parts(&cursor, q), next_operand_parts(&cursor, q), next_operand_parts(&cursor, k),
          next_operand_parts(&cursor, k)};
}

}  // namespace jax_flash
