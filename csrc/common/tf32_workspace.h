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

// One operand's two parts in a parts workspace: whole arrays shaped like the operand, hi then lo. T: float for split
// TF32, a 16-bit type for the float16 parts below.
template <class T = float>
struct OperandParts {
  T* hi;
  T* lo;
};

// The next operand's parts at *cursor, `count` elements each; moves the cursor past them.
template <class T>
OperandParts<T> next_operand_parts(T** cursor, int64_t count) {
  const OperandParts<T> parts{*cursor, *cursor + count};
  *cursor += 2 * count;
  return parts;
}

// The parts of a split-TF32 forward's workspace that starts at `base`, for `batch` (every leading dimension) x
// heads_kv (batch rows, KV heads).
struct SplitTf32Parts {
  OperandParts<> vt;
  OperandParts<> q;
  OperandParts<> k;
};

inline SplitTf32Parts split_tf32_parts(float* base, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                                       int64_t heads_q, int64_t heads_kv, int64_t head_dim) {
  float* cursor = base;
  // Braced initialisers run in order: the parts follow one another as listed.
  return {next_operand_parts(&cursor, batch * heads_kv * tf32_vt_per_head(seqlen_k, head_dim)),
          next_operand_parts(&cursor, batch * seqlen_q * heads_q * head_dim),
          next_operand_parts(&cursor, batch * seqlen_k * heads_kv * head_dim)};
}

// The backward's parts workspace (a float32 call's dq_accum slot) holds eight whole arrays one after the other: Q hi,
// Q lo, dO hi, dO lo (each shaped like q), K hi, K lo, V hi, V lo (each shaped like k). Its element type says which
// parts: float32, split TF32's (cuda/sm90/split_tf32_backward_launch.h); float16, the float16 parts of
// float32_precision="highest" on the 16-bit Hopper backward (cuda/sm90/float16_parts_backward_launch.h: the same
// hi + lo split with float16 parts, of operands the Python side scaled into float16's range,
// jax_flash/_half_operands.py). Declared [*batch, heads_kv, per_head] like the forward's, with the same caveat: the
// shape only sizes it.
constexpr int64_t backward_parts_per_head(int64_t seqlen_q, int64_t seqlen_k, int64_t group, int64_t head_dim) {
  return 4 * (group * seqlen_q * head_dim + seqlen_k * head_dim);
}

template <class T>
struct BackwardOperandParts {
  OperandParts<T> q;
  OperandParts<T> d_o;
  OperandParts<T> k;
  OperandParts<T> v;
};

template <class T>
BackwardOperandParts<T> backward_operand_parts(T* base, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                                               int64_t heads_q, int64_t heads_kv, int64_t head_dim) {
  const int64_t q = batch * seqlen_q * heads_q * head_dim;
  const int64_t k = batch * seqlen_k * heads_kv * head_dim;
  T* cursor = base;
  // Braced initialisers run in order: the parts follow one another as listed.
  return {next_operand_parts(&cursor, q), next_operand_parts(&cursor, q), next_operand_parts(&cursor, k),
          next_operand_parts(&cursor, k)};
}

}  // namespace jax_flash
