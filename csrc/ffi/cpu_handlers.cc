// CPU handlers: decode and re-check the buffers, then run the C++ specification kernels.
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

#include "../cpu/attention_cpu.h"
#include "attention_call.h"
#include "handlers.h"

namespace jax_flash::ffi_boundary {
namespace {

// JAX_FLASH_POISON_OUTPUTS=1 (tests/conftest.py sets it): results start with every bit set, a NaN in each float
// format, so that an element the kernels leave unwritten shows as NaN instead of what the allocator left there
// (often zeros, which rows that see no key must hold anyway). Read once.
void poison_if_testing(std::initializer_list<ffi::AnyBuffer*> results) {
  static const bool enabled = [] {
    const char* value = std::getenv("JAX_FLASH_POISON_OUTPUTS");
    return value != nullptr && std::string(value) == "1";
  }();
  if (!enabled) return;
  for (ffi::AnyBuffer* result : results) std::memset(result->untyped_data(), 0xFF, result->size_bytes());
}

ffi::Error forward_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                       ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer bias,
                       ffi::AnyBuffer mask, ffi::AnyBuffer mask_blocks, ffi::AnyBuffer dropout_seeds,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> tf32_vt, float softmax_scale,
                       float softcap, bool causal, bool align_to_sequence_end, int64_t diagonal_offset,
                       int64_t window_left, int64_t window_right, float dropout_rate, bool allow_tf32,
                       int64_t packed_heads, int64_t kv_chunks) {
  AttentionParams params;
  ffi::Error error = decode_forward(
      q, k, v,
      {alibi_slopes, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, bias, mask, mask_blocks, dropout_seeds},
      *o, *lse, *tf32_vt,
      {softmax_scale, softcap, causal, align_to_sequence_end, diagonal_offset, window_left, window_right,
       dropout_rate, allow_tf32}, {packed_heads, kv_chunks}, &params);
  if (error.failure()) return error;
  poison_if_testing({&*o, &*lse});
  cpu::attention_forward(params);
  return ffi::Error::Success();
}

ffi::Error backward_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer d_o, ffi::AnyBuffer d_lse,
                        ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
                        ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::AnyBuffer mask_blocks, ffi::AnyBuffer dropout_seeds,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> softmax_d, ffi::Result<ffi::AnyBuffer> dq_accum,
                        ffi::Result<ffi::AnyBuffer> dkdv_tail,
                        ffi::Result<ffi::AnyBuffer> dbias,
                        float softmax_scale, float softcap, bool causal, bool align_to_sequence_end,
                        int64_t diagonal_offset, int64_t window_left, int64_t window_right, float dropout_rate,
                        bool allow_tf32, bool deterministic) {
  AttentionBackwardParams params;
  ffi::Error error = decode_backward(
      {q, k, v, o, lse, d_o, d_lse},
      {alibi_slopes, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, bias, mask, mask_blocks, dropout_seeds},
      {*dq, *dk, *dv, *softmax_d, *dq_accum, *dkdv_tail, *dbias},
      {softmax_scale, softcap, causal, align_to_sequence_end, diagonal_offset, window_left, window_right,
       dropout_rate, allow_tf32},
      deterministic, &params);
  if (error.failure()) return error;
  poison_if_testing({&*dq, &*dk, &*dv, &*dbias});
  cpu::attention_backward(params);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_flash::ffi_boundary

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashForwardCpu, jax_flash::ffi_boundary::forward_cpu,
                              jax_flash::ffi_boundary::bind_forward(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBackwardCpu, jax_flash::ffi_boundary::backward_cpu,
                              jax_flash::ffi_boundary::bind_backward(xla::ffi::Ffi::Bind()));
