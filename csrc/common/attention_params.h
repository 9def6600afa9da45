// Plain description of one attention call, filled once by the FFI boundary (csrc/ffi) and read by every
// kernel family (CPU, sm80, sm90). No templates, no framework types: the kernels never see XLA.
#pragma once

#include <cstdint>

namespace jax_flash {

enum class ElementType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Element strides of an operand broadcastable to [batch, heads_q, seqlen_q, seqlen_k]; 0 along broadcast axes.
// vmap folds extra leading axes into the batch: flat batch row b is (b / inner_batch, b % inner_batch), and
// `outer` steps the first of those.
struct BroadcastStrides {
  int64_t outer = 0;
  int64_t batch = 0;
  int64_t head = 0;
  int64_t query = 0;
  int64_t key = 0;
};

// Layout BSHD, contiguous: q/o [batch, seqlen_q, heads_q, head_dim], k/v [batch, seqlen_k, heads_kv, head_dim],
// lse [batch, heads_q, seqlen_q] float32. `batch` is every leading axis folded together (vmap adds axes).
struct AttentionParams {
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  ElementType element_type = ElementType::kFloat32;

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;

  // Optional per-batch operands; nullptr when absent.
  const float* alibi_slopes = nullptr;      // [batch, heads_q]
  const int32_t* q_seqlens = nullptr;       // [batch]: valid prefix length of each query row
  const int32_t* kv_seqlens = nullptr;      // [batch]
  const int32_t* q_segment_ids = nullptr;   // [batch, seqlen_q]
  const int32_t* kv_segment_ids = nullptr;  // [batch, seqlen_k]

  // Optional dense operands, broadcastable to [batch, heads_q, seqlen_q, seqlen_k]; nullptr when absent.
  int64_t inner_batch = 1;                   // the batch axis of q itself; see BroadcastStrides
  int64_t outer_batch = 1;                   // the vmap axes folded in front of it: batch = outer * inner
  const float* bias = nullptr;               // added to the scores after ALiBi
  BroadcastStrides bias_strides;
  const bool* mask = nullptr;                // false masks the score out
  BroadcastStrides mask_strides;
  // One byte per 64 x 64 block of the mask (common/mask_blocks.h): hidden / partial / visible, so the GPU
  // kernels can skip what it hides. Strides in bytes, 0 along size-1 axes. nullptr with a mask: the kernels read
  // every mask element and skip nothing.
  const uint8_t* mask_blocks = nullptr;
  BroadcastStrides mask_blocks_strides;

  // Dropout on the probabilities: element (b, h, i, j) is kept when its 16-bit Philox draw is at least
  // round(rate * 65536), Philox keyed by dropout_seeds[b] (common/philox.h has the element -> draw mapping); kept
  // probabilities are scaled by 1 / (1 - dropout_rate). The lse is that of the undropped probabilities.
  float dropout_rate = 0.0f;
  const uint32_t* dropout_seeds = nullptr;   // [batch, 2]

  float softmax_scale = 1.0f;
  float softcap = 0.0f;  // 0 disables; else s = softcap * tanh(s / softcap)

  // float32 inputs only: true lets the GPU multiply on TF32 tensor cores (10-bit mantissa operands, float32
  // accumulation), false keeps every product and sum in float32. The CPU kernels are always exact.
  bool allow_tf32 = false;
  // Workspace of the Hopper TF32 forward (common/tf32_workspace.h), an extra result of the forward call: V^T, written
  // by the call itself before its kernel reads it. nullptr where the call passed none (then the float32 forward runs
  // the mma.sync kernels).
  float* tf32_vt = nullptr;
  // With allow_tf32 false, a workspace (tf32_vt) asks for split TF32 on the Hopper kernel: tf32_vt is then the
  // start of the split-TF32 workspace (common/tf32_workspace.h split_tf32_parts). The CPU kernels ignore it.
  bool split_tf32 = false;

  // Masking by position. Query row i is "at" key column diag(i) = i + diagonal_offset, plus
  // (seqlen_k_b - seqlen_q_b) when align_to_sequence_end (FlashAttention's bottom-right convention; the
  // per-sequence lengths come from q_seqlens/kv_seqlens when given). Causal keeps j <= diag(i); a window keeps
  // diag(i) - window_left <= j <= diag(i) + window_right, -1 meaning unbounded. ALiBi subtracts
  // slope * |diag(i) - j|.
  bool causal = false;
  bool align_to_sequence_end = true;
  int64_t diagonal_offset = 0;
  int64_t window_left = -1;
  int64_t window_right = -1;
  // GQA packing (jax_flash/_gqa_packing.py), forward calls only: the 2^position_shift query heads sharing a KV head
  // are rows of one query sequence, row i being position i >> position_shift of head i % 2^position_shift, and the
  // position masks above read the position wherever they say i (q_seqlens count rows). Calls with position_shift > 0
  // have no ALiBi, dropout, or bias / mask that varies along the queries (the FFI boundary refuses them): those read
  // the row itself as a position or a head.
  int32_t position_shift = 0;
  // Split-KV (jax_flash/_kv_split.py), forward calls only: each sequence's keys are kv_chunks chunks of seqlen_k keys,
  // consecutive batch rows, and kv_seqlens (required then) count from each row's first key, unclamped: a chunk before
  // the sequence's end has more than seqlen_k, one past it none or fewer. The alignment to the sequence end reads
  // them as they are, so the position masks and ALiBi see whole-sequence key positions. No dropout (the FFI
  // boundary refuses it): its draws count keys within the batch row.
  int64_t kv_chunks = 1;
};

struct AttentionBackwardParams : AttentionParams {
  const void* d_o = nullptr;       // like o
  const float* d_lse = nullptr;    // like lse: cotangent of the lse output (zeros when lse is not used)
  void* dq = nullptr;              // like q (float32 with float32_gradients)
  void* dk = nullptr;              // like k (likewise)
  void* dv = nullptr;              // like v (likewise)
  // Workspace, allocated by XLA as an extra result of the call (never the FFI scratch allocator).
  float* softmax_d = nullptr;      // [batch, heads_q, seqlen_q] float32: rowsum(dO * O) - dlse
  // float32, dq_workspace_elements() of common/dq_workspace.h (layout private to each kernel family): dQ summed over
  // key tiles by reductions in L2, where a kernel family fuses dQ into its dK/dV pass; nullptr when the call passed
  // none (deterministic calls, float32 inputs, head dims where fusing does not pay), and then dQ has a pass of its
  // own.
  float* dq_accum = nullptr;
  // float32, dkdv_tail_elements() floats of common/dq_workspace.h (or any number under vmap / sharding: the kernels use
  // what fits), given with dq_accum: the slots in which the sm80 fused dK/dV pass sums the key blocks of its last wave
  // that it splits across SMs (cuda/sm80/dkdv_tail_plan.h); nullptr / 0 when absent.
  float* dkdv_tail = nullptr;
  int64_t dkdv_tail_floats = 0;
  float* dbias = nullptr;          // like bias (same strides), float32; nullptr when not wanted
  bool deterministic = false;      // bit-reproducible gradients
  // dq, dk and dv are float32 although q, k and v are float16: the TF32-class backward of float32 calls, which runs
  // on float16 operands scaled by powers of two (jax_flash/_half_operands.py) and needs its gradients unrounded.
  bool float32_gradients = false;
  // A float32 call with float32_precision="highest" whose dq_accum slot is a float16 workspace (common/tf32_workspace.h
  // backward_parts_per_head): its start, asking for the 16-bit Hopper backward on float16 hi and lo parts of the
  // (scaled) float32 operands, three products per product (cuda/sm90/float16_parts_backward_launch.h); nullptr
  // otherwise. The CPU kernels ignore it.
  void* float16_parts = nullptr;

  ElementType gradient_type() const { return float32_gradients ? ElementType::kFloat32 : element_type; }
};

}  // namespace jax_flash
