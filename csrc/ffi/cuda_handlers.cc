// CUDA handlers: decode and re-check the buffers, then enqueue the kernels on XLA's stream. No
// synchronisation and no scratch allocation, so the calls can be captured into command buffers (CUDA graphs).
#include <cuda_runtime_api.h>

#include <string>

#include "../cuda/launch.h"
#include "attention_call.h"
#include "handlers.h"

namespace jax_flash::ffi_boundary {
namespace {

ffi::Error to_ffi_error(const std::string& message) {
  if (message.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, "jax_flash (CUDA): " + message);
}

ffi::Error forward_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
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
  // What the kernels cannot do (float32, ...) comes back as an error from run_forward.
  return to_ffi_error(cuda::run_forward(params, stream));
}

ffi::Error backward_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
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
  return to_ffi_error(cuda::run_backward(params, stream));
}

}  // namespace
}  // namespace jax_flash::ffi_boundary

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashForwardCuda, jax_flash::ffi_boundary::forward_cuda,
    jax_flash::ffi_boundary::bind_forward(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashBackwardCuda, jax_flash::ffi_boundary::backward_cuda,
    jax_flash::ffi_boundary::bind_backward(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
