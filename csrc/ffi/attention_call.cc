#include "attention_call.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "../common/dq_workspace.h"
#include "../common/tf32_workspace.h"
#include "buffer_checks.h"

namespace jax_flash::ffi_boundary {
namespace {

#define JF_RETURN_IF_ERROR(expr)                  \
  do {                                            \
    if (auto error = (expr)) return *std::move(error); \
  } while (0)

ffi::Error invalid(const std::string& message) { return ffi::Error::InvalidArgument("jax_flash: " + message); }

bool to_element_type(ffi::DataType type, ElementType* out) {
  switch (type) {
    case ffi::DataType::F32: *out = ElementType::kFloat32; return true;
    case ffi::DataType::BF16: *out = ElementType::kBFloat16; return true;
    case ffi::DataType::F16: *out = ElementType::kFloat16; return true;
    default: return false;
  }
}

// Checks q/k/v/o/lse and the optional operands, and fills everything but the backward fields.
ffi::Error decode_common(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, const MaskOperands& masks,
                         ffi::AnyBuffer o, ffi::AnyBuffer lse, const ScoreAttributes& a, AttentionParams* p) {
  const auto q_dims = q.dimensions();
  if (q_dims.size() < 4) return invalid("q must have rank >= 4 ([*batch, seqlen_q, heads_q, head_dim]), got " +
                                        format_dims(q_dims));
  if (k.dimensions().size() != q_dims.size())
    return invalid("k must have the rank of q, got " + format_dims(k.dimensions()));
  const std::vector<int64_t> batch = batch_prefix(q);
  const auto k_dims = k.dimensions();
  const int64_t rank = static_cast<int64_t>(q_dims.size());
  const int64_t seqlen_q = q_dims[rank - 3], heads_q = q_dims[rank - 2], head_dim = q_dims[rank - 1];
  const int64_t seqlen_k = k_dims[rank - 3], heads_kv = k_dims[rank - 2];
  if (!to_element_type(q.element_type(), &p->element_type))
    return invalid("q must be float32, bfloat16 or float16");
  if (heads_kv <= 0 || heads_q % heads_kv != 0)
    return invalid("heads_q (" + std::to_string(heads_q) + ") must be a positive multiple of heads_kv (" +
                   std::to_string(heads_kv) + ")");
  JF_RETURN_IF_ERROR(expect_buffer("k", k, q.element_type(), batch, {seqlen_k, heads_kv, head_dim}));
  JF_RETURN_IF_ERROR(expect_buffer("v", v, q.element_type(), batch, {seqlen_k, heads_kv, head_dim}));
  JF_RETURN_IF_ERROR(expect_buffer("o", o, q.element_type(), batch, {seqlen_q, heads_q, head_dim}));
  JF_RETURN_IF_ERROR(expect_buffer("lse", lse, ffi::DataType::F32, batch, {heads_q, seqlen_q}));

  bool has_alibi, has_q_seqlens, has_kv_seqlens, has_q_segments, has_kv_segments;
  JF_RETURN_IF_ERROR(
      expect_optional("alibi_slopes", masks.alibi_slopes, ffi::DataType::F32, batch, heads_q, &has_alibi));
  JF_RETURN_IF_ERROR(expect_optional("q_seqlens", masks.q_seqlens, ffi::DataType::S32, batch, 1, &has_q_seqlens));
  JF_RETURN_IF_ERROR(
      expect_optional("kv_seqlens", masks.kv_seqlens, ffi::DataType::S32, batch, 1, &has_kv_seqlens));
  JF_RETURN_IF_ERROR(expect_optional("q_segment_ids", masks.q_segment_ids, ffi::DataType::S32, batch, seqlen_q,
                                     &has_q_segments));
  JF_RETURN_IF_ERROR(expect_optional("kv_segment_ids", masks.kv_segment_ids, ffi::DataType::S32, batch, seqlen_k,
                                     &has_kv_segments));
  if (has_q_segments != has_kv_segments) return invalid("q_segment_ids and kv_segment_ids go together");
  const std::vector<int64_t> vmap_dims(batch.begin(), batch.end() - 1);
  const int64_t broadcast_full[4] = {batch.back(), heads_q, seqlen_q, seqlen_k};
  bool has_bias, has_mask, has_dropout;
  JF_RETURN_IF_ERROR(expect_broadcastable("bias", masks.bias, ffi::DataType::F32, vmap_dims, broadcast_full,
                                          &has_bias, &p->bias_strides));
  JF_RETURN_IF_ERROR(expect_broadcastable("mask", masks.mask, ffi::DataType::PRED, vmap_dims, broadcast_full,
                                          &has_mask, &p->mask_strides));
  JF_RETURN_IF_ERROR(
      expect_mask_blocks(masks.mask_blocks, masks.mask, has_mask, vmap_dims, &p->mask_blocks_strides));
  JF_RETURN_IF_ERROR(
      expect_optional("dropout_seeds", masks.dropout_seeds, ffi::DataType::U32, batch, 2, &has_dropout));
  if (!(a.dropout_rate >= 0.0f && a.dropout_rate < 1.0f)) return invalid("dropout_rate must be in [0, 1)");
  if (a.dropout_rate > 0.0f && !has_dropout) return invalid("dropout_rate > 0 needs dropout_seeds");

  if (!std::isfinite(a.softmax_scale)) return invalid("softmax_scale must be finite");
  if (!(a.softcap >= 0.0f) || !std::isfinite(a.softcap)) return invalid("softcap must be finite and >= 0");
  if (a.window_left < -1 || a.window_right < -1) return invalid("window sizes must be >= -1");
  // Bounds that keep the kernels' int64 diagonal arithmetic (i + offset +- window) far from overflow.
  constexpr int64_t kMaxDiagonalTerm = int64_t(1) << 40;
  if (a.window_left > kMaxDiagonalTerm || a.window_right > kMaxDiagonalTerm ||
      a.diagonal_offset > kMaxDiagonalTerm || a.diagonal_offset < -kMaxDiagonalTerm)
    return invalid("window sizes and diagonal_offset must be at most 2^40 in magnitude (-1: unbounded window)");

  int64_t batch_size = 1;
  for (int64_t d : batch) batch_size *= d;
  p->batch = batch_size;
  p->seqlen_q = seqlen_q;
  p->seqlen_k = seqlen_k;
  p->heads_q = heads_q;
  p->heads_kv = heads_kv;
  p->head_dim = head_dim;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->o = o.untyped_data();
  p->lse = static_cast<float*>(lse.untyped_data());
  p->alibi_slopes = has_alibi ? static_cast<const float*>(masks.alibi_slopes.untyped_data()) : nullptr;
  p->q_seqlens = has_q_seqlens ? static_cast<const int32_t*>(masks.q_seqlens.untyped_data()) : nullptr;
  p->kv_seqlens = has_kv_seqlens ? static_cast<const int32_t*>(masks.kv_seqlens.untyped_data()) : nullptr;
  p->q_segment_ids = has_q_segments ? static_cast<const int32_t*>(masks.q_segment_ids.untyped_data()) : nullptr;
  p->kv_segment_ids = has_kv_segments ? static_cast<const int32_t*>(masks.kv_segment_ids.untyped_data()) : nullptr;
  p->inner_batch = batch.back();
  p->outer_batch = 1;
  for (int64_t d : vmap_dims) p->outer_batch *= d;
  p->bias = has_bias ? static_cast<const float*>(masks.bias.untyped_data()) : nullptr;
  p->mask = has_mask ? static_cast<const bool*>(masks.mask.untyped_data()) : nullptr;
  p->mask_blocks = has_mask ? static_cast<const uint8_t*>(masks.mask_blocks.untyped_data()) : nullptr;
  p->dropout_rate = has_dropout ? a.dropout_rate : 0.0f;
  p->dropout_seeds = has_dropout ? static_cast<const uint32_t*>(masks.dropout_seeds.untyped_data()) : nullptr;
  p->softmax_scale = a.softmax_scale;
  p->softcap = a.softcap;
  p->causal = a.causal;
  p->align_to_sequence_end = a.align_to_sequence_end;
  p->diagonal_offset = a.diagonal_offset;
  p->window_left = a.window_left;
  p->window_right = a.window_right;
  p->allow_tf32 = a.allow_tf32;
  return ffi::Error::Success();
}

// GQA packing's rows (AttentionParams::position_shift): a power of two of heads (a shift maps a row to its position),
// whole positions, and none of the operands that read a row as a position or a head.
std::optional<ffi::Error> check_packed_heads(int64_t packed_heads, const AttentionParams& p) {
  if (packed_heads < 1 || packed_heads > (int64_t(1) << 20) || (packed_heads & (packed_heads - 1)) != 0)
    return invalid("packed_heads must be a power of two up to 2^20, got " + std::to_string(packed_heads));
  if (packed_heads == 1) return std::nullopt;
  if (p.seqlen_q % packed_heads != 0)
    return invalid("packed_heads (" + std::to_string(packed_heads) + ") must divide seqlen_q (" +
                   std::to_string(p.seqlen_q) + ")");
  if (p.alibi_slopes != nullptr) return invalid("alibi_slopes cannot be combined with packed_heads > 1");
  if (p.dropout_rate > 0.0f) return invalid("dropout cannot be combined with packed_heads > 1");
  if (p.bias != nullptr && p.bias_strides.query != 0)
    return invalid("a bias that varies along the queries cannot be combined with packed_heads > 1");
  if (p.mask != nullptr && p.mask_strides.query != 0)
    return invalid("a mask that varies along the queries cannot be combined with packed_heads > 1");
  return std::nullopt;
}

// Split-KV's batch rows (AttentionParams::kv_chunks): whole chunks of each sequence, which the vmap axes folded in
// front of the batch keep together, their kv_seqlens (counted from each row's first key), and no dropout (its draws
// would count keys within the chunk).
std::optional<ffi::Error> check_kv_chunks(int64_t kv_chunks, const AttentionParams& p) {
  if (kv_chunks < 1) return invalid("kv_chunks must be >= 1, got " + std::to_string(kv_chunks));
  if (kv_chunks == 1) return std::nullopt;
  if (p.inner_batch % kv_chunks != 0)
    return invalid("kv_chunks (" + std::to_string(kv_chunks) + ") must divide the batch (" +
                   std::to_string(p.inner_batch) + ")");
  if (p.kv_seqlens == nullptr) return invalid("kv_chunks > 1 needs kv_seqlens (counted from each chunk's first key)");
  if (p.dropout_rate > 0.0f) return invalid("dropout cannot be combined with kv_chunks > 1");
  return std::nullopt;
}

}  // namespace

ffi::Error decode_forward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, const MaskOperands& masks,
                          ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer tf32_vt,
                          const ScoreAttributes& attributes, const ForwardLayout& layout, AttentionParams* p) {
  ffi::Error error = decode_common(q, k, v, masks, o, lse, attributes, p);
  if (error.failure()) return error;
  JF_RETURN_IF_ERROR(check_packed_heads(layout.packed_heads, *p));
  JF_RETURN_IF_ERROR(check_kv_chunks(layout.kv_chunks, *p));
  while ((int64_t(1) << p->position_shift) < layout.packed_heads) ++p->position_shift;
  p->kv_chunks = layout.kv_chunks;
  // tf32_vt: absent when empty, else a float32 workspace [*batch, heads_kv, per head] of a float32 call with
  // head_dim <= 128 (common/tf32_workspace.h): with allow_tf32 the V^T workspace, without it the split-TF32 one.
  if (tf32_vt.element_count() > 0) {
    if (p->element_type != ElementType::kFloat32 || p->head_dim > kTf32MaxHeadDim) {
      return invalid("tf32_vt is only for float32 calls with head_dim <= 128");
    }
    const int64_t per_head =
        p->allow_tf32 ? tf32_vt_per_head(p->seqlen_k, p->head_dim)
                      : split_tf32_per_head(p->seqlen_q, p->seqlen_k, p->heads_q / p->heads_kv, p->head_dim);
    JF_RETURN_IF_ERROR(
        expect_buffer("tf32_vt", tf32_vt, ffi::DataType::F32, batch_prefix(q), {p->heads_kv, per_head}));
    p->tf32_vt = static_cast<float*>(tf32_vt.untyped_data());
    p->split_tf32 = !p->allow_tf32;
  }
  return ffi::Error::Success();
}

ffi::Error decode_backward(const BackwardOperands& in, const MaskOperands& masks, const BackwardResults& out,
                           const ScoreAttributes& attributes, bool deterministic, AttentionBackwardParams* p) {
  ffi::Error error = decode_common(in.q, in.k, in.v, masks, in.o, in.lse, attributes, p);
  if (error.failure()) return error;
  const std::vector<int64_t> batch = batch_prefix(in.q);
  const auto type = in.q.element_type();
  JF_RETURN_IF_ERROR(expect_buffer("d_o", in.d_o, type, batch, {p->seqlen_q, p->heads_q, p->head_dim}));
  JF_RETURN_IF_ERROR(expect_buffer("d_lse", in.d_lse, ffi::DataType::F32, batch, {p->heads_q, p->seqlen_q}));
  // The gradients take q's type, or float32 for all three of a float16 call (AttentionBackwardParams::
  // float32_gradients: the TF32-class backward of float32 calls on scaled float16 operands).
  p->float32_gradients = type == ffi::DataType::F16 && out.dq.element_type() == ffi::DataType::F32;
  const auto gradient_type = p->float32_gradients ? ffi::DataType::F32 : type;
  JF_RETURN_IF_ERROR(expect_buffer("dq", out.dq, gradient_type, batch, {p->seqlen_q, p->heads_q, p->head_dim}));
  JF_RETURN_IF_ERROR(expect_buffer("dk", out.dk, gradient_type, batch, {p->seqlen_k, p->heads_kv, p->head_dim}));
  JF_RETURN_IF_ERROR(expect_buffer("dv", out.dv, gradient_type, batch, {p->seqlen_k, p->heads_kv, p->head_dim}));
  JF_RETURN_IF_ERROR(
      expect_buffer("softmax_d", out.softmax_d, ffi::DataType::F32, batch, {p->heads_q, p->seqlen_q}));
  // dq_accum: absent when empty, else the float32 workspace [*batch, heads_q, per head] (common/dq_workspace.h: its
  // layout inside belongs to the kernel family that runs; the size fits every family).
  // A float32 call has no fused dQ: there a non-empty dq_accum is a parts workspace (float32 without allow_tf32,
  // head_dim <= 128: [*batch, heads_kv, per head], common/tf32_workspace.h backward_parts_per_head) whose type says
  // which: float32, the split-TF32 Hopper passes'; float16, the float16-parts Hopper backward's. Each is asked for
  // where it can run (the CPU kernels ignore both).
  const bool parts_workspace = out.dq_accum.element_count() > 0 && p->element_type == ElementType::kFloat32;
  if (parts_workspace) {
    if (p->allow_tf32 || p->head_dim > kTf32MaxHeadDim) {
      return invalid("a float32 call's dq_accum is a parts workspace: only without allow_tf32 and with "
                     "head_dim <= 128");
    }
    const auto parts_type = out.dq_accum.element_type() == ffi::DataType::F16 ? ffi::DataType::F16
                                                                              : ffi::DataType::F32;
    JF_RETURN_IF_ERROR(expect_buffer(
        "dq_accum", out.dq_accum, parts_type, batch,
        {p->heads_kv, backward_parts_per_head(p->seqlen_q, p->seqlen_k, p->heads_q / p->heads_kv, p->head_dim)}));
    if (parts_type == ffi::DataType::F16) {
      p->float16_parts = out.dq_accum.untyped_data();
    } else {
      p->tf32_vt = static_cast<float*>(out.dq_accum.untyped_data());
      p->split_tf32 = true;
    }
  }
  const bool wants_dq_accum = out.dq_accum.element_count() > 0 && !parts_workspace;
  if (wants_dq_accum) {
    JF_RETURN_IF_ERROR(expect_buffer("dq_accum", out.dq_accum, ffi::DataType::F32, batch,
                                     {p->heads_q, dq_workspace_per_head(p->seqlen_q, p->head_dim)}));
  }
  // dkdv_tail: absent when empty, else float32 slots for the sm80 fused pass's split tail, beside dq_accum. Any
  // shape: vmap prepends axes and sharding may shrink it; the launcher uses the slots that fit.
  const bool wants_dkdv_tail = out.dkdv_tail.element_count() > 0;
  if (wants_dkdv_tail) {
    if (!wants_dq_accum) return invalid("dkdv_tail is only for calls with a dq_accum workspace");
    if (out.dkdv_tail.element_type() != ffi::DataType::F32) return invalid("dkdv_tail must be float32");
  }
  // dbias: the bias's shape when the caller differentiates with respect to the bias, else a placeholder.
  const std::vector<int64_t> vmap_dims(batch.begin(), batch.end() - 1);
  const int64_t broadcast_full[4] = {batch.back(), p->heads_q, p->seqlen_q, p->seqlen_k};
  bool wants_dbias;
  BroadcastStrides dbias_strides;
  JF_RETURN_IF_ERROR(expect_broadcastable("dbias", out.dbias, ffi::DataType::F32, vmap_dims, broadcast_full,
                                          &wants_dbias, &dbias_strides));
  if (wants_dbias) {
    if (p->bias == nullptr) return invalid("dbias requested without a bias");
    if (out.dbias.dimensions().size() != masks.bias.dimensions().size() ||
        !std::equal(out.dbias.dimensions().begin(), out.dbias.dimensions().end(), masks.bias.dimensions().begin()))
      return invalid("dbias must have the shape of bias");
  }
  p->dbias = wants_dbias ? static_cast<float*>(out.dbias.untyped_data()) : nullptr;
  p->d_o = in.d_o.untyped_data();
  p->d_lse = static_cast<const float*>(in.d_lse.untyped_data());
  p->dq = out.dq.untyped_data();
  p->dk = out.dk.untyped_data();
  p->dv = out.dv.untyped_data();
  p->softmax_d = static_cast<float*>(out.softmax_d.untyped_data());
  p->dq_accum = wants_dq_accum ? static_cast<float*>(out.dq_accum.untyped_data()) : nullptr;
  p->dkdv_tail = wants_dkdv_tail ? static_cast<float*>(out.dkdv_tail.untyped_data()) : nullptr;
  p->dkdv_tail_floats = wants_dkdv_tail ? static_cast<int64_t>(out.dkdv_tail.element_count()) : 0;
  p->deterministic = deterministic;
  return ffi::Error::Success();
}

}  // namespace jax_flash::ffi_boundary
