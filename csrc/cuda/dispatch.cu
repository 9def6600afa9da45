// run_forward / run_backward: check what the GPU kernels support, then turn the runtime element type and head
// dim into the template arguments of one generated instantiation. The set of built head dims comes from the
// build (JAX_FLASH_CUDA_HEAD_DIMS -> generated built_head_dims.h); a head dim runs on the smallest built one
// that is at least as large, its extra columns zero-filled on load and never stored.
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>

#include "../common/tf32_workspace.h"
#include "build_refusal.h"
#include "launch.h"
#include "f32/launchers.h"
#include "sm80/launchers.h"
#include "sm90/forward_variant.h"
#include "sm90/launchers.h"

#if __has_include("built_head_dims.h")
#include "built_head_dims.h"
#else
#define JAX_FLASH_CUDA_HEAD_DIM_LIST 32, 64, 96, 128, 192, 256
#endif
#if __has_include("built_sm90_head_dims.h")
#include "built_sm90_head_dims.h"
#endif
#ifndef JAX_FLASH_CUDA_FP16_BUILT
#define JAX_FLASH_CUDA_FP16_BUILT 1
#endif
#ifndef JAX_FLASH_CUDA_SM90_HEAD_DIM_LIST
#define JAX_FLASH_CUDA_SM90_HEAD_DIM_LIST  // no sm_90a kernels in this build
#endif
#ifndef JAX_FLASH_CUDA_SM90_BACKWARD_HEAD_DIM_LIST
#define JAX_FLASH_CUDA_SM90_BACKWARD_HEAD_DIM_LIST  // no sm_90a backward kernels in this build
#endif

namespace jax_flash::cuda {

// Compute capability major of the current device, cached per device id.
int current_device_major() {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static int majors[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device < 0 || device >= kMaxDevices) return 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (majors[device] == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return 0;
    majors[device] = major;
  }
  return majors[device];
}

namespace {

// Calls launch(Element{}) with the CUTLASS type of a 16-bit call. A build with JAX_FLASH_CUDA_FP16=OFF (development,
// CI's compile check) has no float16 instantiations, and says so instead of linking against them.
template <class Launch>
std::string with_half_element(ElementType type, Launch&& launch) {
  if (type == ElementType::kBFloat16) return launch(cutlass::bfloat16_t{});
  if constexpr (JAX_FLASH_CUDA_FP16_BUILT) {
    return launch(cutlass::half_t{});
  } else {
    return build_refusal("no float16 kernels (built with JAX_FLASH_CUDA_FP16=OFF)");
  }
}

template <size_t N>
constexpr bool contains(const int (&head_dims)[N], int head_dim) {
  for (int d : head_dims) {
    if (d == head_dim) return true;
  }
  return false;
}

// The smallest of `head_dims` (0 entries ignored) that is >= head_dim, or 0: the kernel a head dim runs on.
template <size_t N>
int smallest_at_least(const int (&head_dims)[N], int64_t head_dim) {
  int best = 0;
  for (int d : head_dims) {
    if (d > 0 && d >= head_dim && (best == 0 || d < best)) best = d;
  }
  return best;
}

constexpr int kBuiltHeadDims[] = {JAX_FLASH_CUDA_HEAD_DIM_LIST};
constexpr int kMaxHeadDim = 256;  // the largest head dim any build has kernels for (CMakeLists.txt's list)

struct Sm80Built {  // also the float32 kernels' head dims
  constexpr bool operator()(int d) const { return contains(kBuiltHeadDims, d); }
};

int padded_head_dim(int64_t head_dim) { return smallest_at_least(kBuiltHeadDims, head_dim); }

std::string check_supported(const AttentionParams& p) {
  if (p.element_type != ElementType::kFloat32 && p.element_type != ElementType::kBFloat16 &&
      p.element_type != ElementType::kFloat16) {
    return "unknown element type";
  }
  if (p.head_dim <= 0 || p.head_dim > kMaxHeadDim) {
    return "head_dim must be between 1 and " + std::to_string(kMaxHeadDim) + ", got " + std::to_string(p.head_dim);
  }
  if (padded_head_dim(p.head_dim) == 0) {
    return build_refusal("no kernels for head_dim " + std::to_string(p.head_dim) +
                         " or larger (JAX_FLASH_CUDA_HEAD_DIMS)");
  }
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return "heads_q must be a multiple of heads_kv";
  if (p.seqlen_q >= (int64_t(1) << 31) || p.seqlen_k >= (int64_t(1) << 31)) {
    return "sequence lengths must be below 2^31";
  }
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) {
    return "q_segment_ids and kv_segment_ids must be given together";
  }
  return {};
}

// o and lse are empty.
bool nothing_to_do(const AttentionParams& p) { return p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0; }

// Calls launch(int_constant<D>) for the head dim D that is `head_dim` and that Built{}(D) admits (only those
// are instantiated).
template <class Built, class Launch>
std::string with_head_dim(int head_dim, Launch&& launch) {
  std::string result = "internal error: no kernel for head dim " + std::to_string(head_dim);
  auto try_dim = [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    if constexpr (Built{}(kDim)) {
      if (kDim == head_dim) result = launch(dim);
    }
  };
  try_dim(std::integral_constant<int, 32>{});
  try_dim(std::integral_constant<int, 64>{});
  try_dim(std::integral_constant<int, 96>{});
  try_dim(std::integral_constant<int, 128>{});
  try_dim(std::integral_constant<int, 192>{});
  try_dim(std::integral_constant<int, 256>{});
  return result;
}

// ---- Forward kernel family: the Hopper kernel (sm90/) on compute capability 9.x where it applies, else the
// FA2-class kernel (sm80/). JAX_FLASH_CUDA_KERNEL=sm80|sm90 (read at every call) forces one, for testing.

constexpr int kSm90HeadDims[] = {0 JAX_FLASH_CUDA_SM90_HEAD_DIM_LIST};  // leading 0: the list may be empty

int sm90_head_dim(int64_t head_dim) { return smallest_at_least(kSm90HeadDims, head_dim); }

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// JAX_FLASH_SM90_DENSE (read at every call): unset, "" or "1" lets the sm90 forward take calls with an additive
// bias and/or a boolean mask (its dense form, sm90/forward_variant.h; 1.75x the sm80 general variant on a d=128 4k
// padding-mask forward on the H200); "0" leaves them on sm80.
std::string sm90_dense_switch(bool* enabled) {
  const char* env = std::getenv("JAX_FLASH_SM90_DENSE");
  const std::string value = env ? env : "";
  *enabled = value != "0";
  if (value != "" && value != "0" && value != "1") return "JAX_FLASH_SM90_DENSE must be 0 or 1, not '" + value + "'";
  return {};
}

// What both Hopper forwards (bf16/fp16 and TF32) need of the call's sizes: the tile grid and the TMA coordinates in
// 32 bits, and a non-empty key tensor for the descriptors. Empty when they hold, else why not.
std::string sm90_forward_size_refusal(const AttentionParams& p) {
  if (p.batch > INT32_MAX || p.heads_q > INT32_MAX) return "batch and heads must fit in 32 bits";
  if (p.seqlen_k == 0) return "seqlen_k is 0 (a TMA descriptor needs a non-empty tensor)";
  return {};
}

// Empty when the sm90 forward kernel can run this call, else why not. dense: JAX_FLASH_SM90_DENSE is not 0.
std::string sm90_forward_refusal(const AttentionParams& p, bool dense) {
  if (sm90_head_dim(p.head_dim) == 0) {
    return build_refusal("no sm_90a kernel for head_dim " + std::to_string(p.head_dim));
  }
  if (current_device_major() != 9) return "the device is not compute capability 9.x";
  if (p.dropout_rate > 0.0f) return "dropout runs on the sm80 kernel only";
  if ((p.bias != nullptr || p.mask != nullptr) && !dense) {
    return "JAX_FLASH_SM90_DENSE=0 keeps bias and mask on the sm80 kernel";
  }
  // TMA: 16-byte aligned base addresses and row strides.
  if (p.head_dim % 8 != 0) return "head_dim must be a multiple of 8";
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o)) {
    return "q, k, v and o must be 16-byte aligned";
  }
  return sm90_forward_size_refusal(p);
}

// Whether a call runs the sm90 family: the environment variable `variable` (read at every call) forces "sm80" or
// "sm90" (an error naming the reason where `kernel` cannot run the call) or asks for "auto"; unset means
// `unset_means_auto`. refusal() says why sm90 cannot run the call, empty when it can.
template <class Refusal>
std::string choose_sm90(const char* variable, const char* kernel, bool unset_means_auto, Refusal refusal,
                        bool* use_sm90) {
  const char* env = std::getenv(variable);
  const std::string forced = env ? env : "";
  *use_sm90 = false;
  if (forced == "sm80" || (forced.empty() && !unset_means_auto)) return {};
  if (!forced.empty() && forced != "auto" && forced != "sm90") {
    return std::string(variable) + " must be sm80, sm90 or auto, not '" + forced + "'";
  }
  const std::string why_not = refusal();
  if (forced == "sm90" && !why_not.empty()) {
    return std::string(variable) + "=sm90, but the " + kernel + " cannot run this call: " + why_not;
  }
  *use_sm90 = why_not.empty();
  return {};
}

struct Sm90ForwardBuilt {
  constexpr bool operator()(int d) const { return contains(kSm90HeadDims, d); }
};

std::string run_sm90_forward(const AttentionParams& p, cudaStream_t stream) {
  return with_head_dim<Sm90ForwardBuilt>(sm90_head_dim(p.head_dim), [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    return with_half_element(p.element_type, [&](auto element) {
      return sm90::launch_forward<kDim, decltype(element)>(p, stream);
    });
  });
}

// ---- Backward kernel family: on compute capability 9.x the Hopper backward (sm90/backward_*.h) runs every call it
// can (sm90_backward_refusal says which), sm80 the rest. JAX_FLASH_CUDA_KERNEL_BACKWARD=sm80 or =sm90 forces a
// family (forced sm90: an error naming the reason where it cannot run); read at every call.

constexpr int kSm90BackwardHeadDims[] = {0 JAX_FLASH_CUDA_SM90_BACKWARD_HEAD_DIM_LIST};

int sm90_backward_head_dim(int64_t head_dim) { return smallest_at_least(kSm90BackwardHeadDims, head_dim); }

// ---- float32 forward: the Hopper TF32 kernel (sm90::launch_forward with element cutlass::tfloat32_t) on compute
// capability 9.x where it applies, else the float32 kernels (f32/). JAX_FLASH_CUDA_KERNEL_F32=sm80|sm90 forces one,
// for testing. Its kernel head dim is the V^T workspace's (common/tf32_workspace.h tf32_vt_head_dim).

// Whether this build has the Hopper TF32 kernels (forward, and the dK/dV pass) of head_dim's kernel head dim.
bool sm90_tf32_built(int64_t head_dim) {
  return head_dim <= kTf32MaxHeadDim && contains(kSm90HeadDims, static_cast<int>(tf32_vt_head_dim(head_dim)));
}

// Empty when the sm90 TF32 forward (split false) or the split-TF32 one (sm90/split_tf32_launch.h; split true) can run
// this float32 call, else why not. The Python side passes each its workspace only for the calls it sends there
// (jax_flash/_ffi_calls.py _uses_tf32_workspace, _uses_split_tf32_workspace): the common form, and unless
// JAX_FLASH_TF32_FORMS=0 also softcap / ALiBi / bias / mask.
std::string sm90_float32_refusal(const AttentionParams& p, bool split) {
  if (!split && !p.allow_tf32) return "float32_precision='highest' runs the exact float32 kernel";
  if (p.dropout_rate > 0.0f) return "dropout runs on the float32 kernels only";
  bool dense = false;
  if (std::string err = sm90_dense_switch(&dense); !err.empty()) return err;
  if ((p.bias != nullptr || p.mask != nullptr) && !dense) {
    return "JAX_FLASH_SM90_DENSE=0 keeps bias and mask on the float32 kernels";
  }
  const std::string workspace = split ? "split-TF32 workspace" : "V^T workspace";
  if (p.tf32_vt == nullptr) return "the call has no " + workspace + " (jax_flash/_ffi_calls.py)";
  if (!sm90_tf32_built(p.head_dim)) {
    return build_refusal(std::string("no sm_90a ") + (split ? "split-TF32" : "TF32") + " kernel for head_dim " +
                         std::to_string(p.head_dim));
  }
  if (current_device_major() != 9) return "the device is not compute capability 9.x";
  if (p.head_dim % 4 != 0) return "head_dim must be a multiple of 4";  // TMA row strides, split's float4 pre-pass
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.o) || !aligned16(p.tf32_vt)) {
    return "q, k, o and the " + workspace + " must be 16-byte aligned";
  }
  return sm90_forward_size_refusal(p);
}

// The Hopper TF32 forward, or with p.split_tf32 the split-TF32 one, of the call's kernel head dim (64 or 128).
// (The calls stay inside the if constexpr branches, so that a build without a head dim never references its
// launchers.)
std::string run_sm90_float32_forward(const AttentionParams& p, cudaStream_t stream) {
  if (tf32_vt_head_dim(p.head_dim) == 64) {
    if constexpr (contains(kSm90HeadDims, 64)) {
      return p.split_tf32 ? sm90::launch_split_tf32_forward<64>(p, stream)
                          : sm90::launch_forward<64, cutlass::tfloat32_t>(p, stream);
    }
  } else {
    if constexpr (contains(kSm90HeadDims, 128)) {
      return p.split_tf32 ? sm90::launch_split_tf32_forward<128>(p, stream)
                          : sm90::launch_forward<128, cutlass::tfloat32_t>(p, stream);
    }
  }
  return std::string("internal error: no sm90 ") + (p.split_tf32 ? "split-TF32" : "TF32") + " kernel for head dim " +
         std::to_string(p.head_dim);
}

// ---- float32 backward: the float32 kernels (f32/), whose TF32 dK/dV and dQ passes the Hopper TF32 ones
// (sm90::launch_tf32_dkdv / launch_tf32_dq, backward_dkdv_tf32_consumer.h / backward_dq_tf32_consumer.h) replace where
// they can run the call: JAX_FLASH_CUDA_KERNEL_F32_BACKWARD unset or auto (the default since the fifteenth session's
// H200 run: its tests pass, ~2x the mma.sync backward), sm90 to insist, sm80 to keep the mma.sync passes.

// With float32_precision="highest" a parts workspace asks for those passes on operands in parts: the split-TF32
// workspace (jax_flash/_ffi_calls.py _uses_split_tf32_backward_workspace, p.split_tf32) for their split-TF32 forms
// (sm90/split_tf32_backward_launch.h), the float16-parts one (_uses_float16_parts_backward, p.float16_parts) for the
// 16-bit Hopper backward's passes on float16 parts (sm90/float16_parts_backward_launch.h, kernel head dim 128); the
// rest of "highest" runs the exact float32 kernels.

const char* sm90_float32_backward_name(const AttentionBackwardParams& p) {
  if (p.float16_parts != nullptr) return "sm90 float16-parts backward";
  return p.split_tf32 ? "sm90 split-TF32 backward" : "sm90 TF32 backward";
}

// Empty when the sm90 TF32 (split-TF32, float16-parts) backward passes can run this float32 call, else why not.
std::string sm90_tf32_backward_refusal(const AttentionBackwardParams& p) {
  const bool float16_parts = p.float16_parts != nullptr;
  if (!p.allow_tf32 && !p.split_tf32 && !float16_parts) {
    return "float32_precision='highest' runs the exact float32 kernels (without a parts workspace)";
  }
  if (p.bias != nullptr || p.mask != nullptr || p.dropout_rate > 0.0f || p.dbias != nullptr || p.softcap > 0.0f ||
      p.alibi_slopes != nullptr || !(p.softmax_scale > 0.0f)) {
    return "bias, boolean mask, dropout, softcap, ALiBi and softmax_scale <= 0 run on the float32 kernels only";
  }
  if (float16_parts) {
    if (p.head_dim > 128 || !contains(kSm90BackwardHeadDims, 128)) {
      return build_refusal("no sm_90a float16-parts backward kernel for head_dim " + std::to_string(p.head_dim));
    }
  } else if (!sm90_tf32_built(p.head_dim)) {
    return build_refusal(std::string("no sm_90a ") + (p.split_tf32 ? "split-TF32" : "TF32") +
                         " backward kernel for head_dim " + std::to_string(p.head_dim));
  }
  if (current_device_major() != 9) return "the device is not compute capability 9.x";
  // TMA row strides (16 bytes: 4 floats, 8 float16 parts), the parts pre-pass's float4 loads.
  if (p.head_dim % (float16_parts ? 8 : 4) != 0) {
    return float16_parts ? "head_dim must be a multiple of 8" : "head_dim must be a multiple of 4";
  }
  const void* operands[] = {p.q, p.k, p.v, p.d_o, p.dq, p.dk, p.dv};
  for (const void* ptr : operands) {
    if (!aligned16(ptr)) return "q, k, v, dO, dq, dk and dv must be 16-byte aligned";
  }
  if (p.split_tf32 && !aligned16(p.tf32_vt)) return "the split-TF32 workspace must be 16-byte aligned";
  if (float16_parts && !aligned16(p.float16_parts)) return "the float16-parts workspace must be 16-byte aligned";
  if (p.batch > INT32_MAX || p.heads_q > INT32_MAX) return "batch and heads must fit in 32 bits";
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return "a sequence length is 0 (a TMA descriptor needs a non-empty tensor)";
  return {};
}

f32::Tf32Passes sm90_tf32_passes(const AttentionBackwardParams& p) {
  if (p.float16_parts != nullptr) {
    if constexpr (contains(kSm90BackwardHeadDims, 128)) {
      return {&sm90::launch_float16_parts_dkdv<128>, &sm90::launch_float16_parts_dq<128>};
    }
    return {};
  }
  if (tf32_vt_head_dim(p.head_dim) == 64) {
    if constexpr (contains(kSm90HeadDims, 64)) {
      if (p.split_tf32) return {&sm90::launch_split_tf32_dkdv<64>, &sm90::launch_split_tf32_dq<64>};
      return {&sm90::launch_tf32_dkdv<64>, &sm90::launch_tf32_dq<64>};
    }
  } else {
    if constexpr (contains(kSm90HeadDims, 128)) {
      if (p.split_tf32) return {&sm90::launch_split_tf32_dkdv<128>, &sm90::launch_split_tf32_dq<128>};
      return {&sm90::launch_tf32_dkdv<128>, &sm90::launch_tf32_dq<128>};
    }
  }
  return {};
}

// Empty when the sm90 backward can run this call, else why not.
std::string sm90_backward_refusal(const AttentionBackwardParams& p) {
  if (sm90_backward_head_dim(p.head_dim) == 0) {
    return build_refusal("no sm_90a backward kernel for head_dim " + std::to_string(p.head_dim));
  }
  if (current_device_major() != 9) return "the device is not compute capability 9.x";
  // Three kernel forms exist (sm90/backward_form.h): common, transforms (softcap, ALiBi) and masked (a boolean mask,
  // with or without softcap/ALiBi). None reads an additive bias, forms dbias or drops out, and the common form folds
  // a positive scale into exp2 (a zero one would turn masked -inf dots into NaN).
  if (p.bias != nullptr || p.dropout_rate > 0.0f || p.dbias != nullptr || !(p.softmax_scale > 0.0f)) {
    return "bias, dbias, dropout and softmax_scale <= 0 run on the sm80 backward only";
  }
  const bool per_element = p.softcap > 0.0f || p.alibi_slopes != nullptr || p.mask != nullptr;
  if (per_element && sm90_backward_head_dim(p.head_dim) > 128) {
    return "softcap, ALiBi and boolean masks at head_dim > 128 run on the sm80 backward only (the d=192 and d=256 "
           "kernels have no transforms or masked form)";
  }
  // The masked form reads a tile's mask elements at 32-bit offsets from its first one (sm90/masked_scores.h
  // MaskBits): at most 127 query and 127 key strides, so their sum stays below 2^31 with strides below 2^23.
  if (p.mask != nullptr && p.mask_strides.query + p.mask_strides.key >= (int64_t{1} << 23)) {
    return "a boolean mask whose query + key strides reach 2^23 elements runs on the sm80 backward only";
  }
  // The transforms form takes ALiBi distances |query + diagonal_shift - key| in 32 bits
  // (sm90/transformed_scores.h); with |diagonal_offset| + 2 (seqlen_q + seqlen_k) below 2^30 they stay far from it.
  if (p.alibi_slopes != nullptr) {
    constexpr int64_t kLimit = int64_t{1} << 30;
    const int64_t offset = p.diagonal_offset;
    // Short-circuited: the sum is formed only from terms below 2^30.
    if (offset <= -kLimit || offset >= kLimit || p.seqlen_q >= kLimit || p.seqlen_k >= kLimit ||
        (offset < 0 ? -offset : offset) + 2 * (p.seqlen_q + p.seqlen_k) >= kLimit) {
      return "ALiBi with |diagonal_offset| + 2 (seqlen_q + seqlen_k) >= 2^30 runs on the sm80 backward only";
    }
  }
  if (p.head_dim % 8 != 0) return "head_dim must be a multiple of 8";  // TMA row strides
  const void* operands[] = {p.q, p.k, p.v, p.o, p.d_o, p.dq, p.dk, p.dv};
  for (const void* ptr : operands) {
    if (!aligned16(ptr)) return "q, k, v, o, dO, dq, dk and dv must be 16-byte aligned";
  }
  if (p.batch > INT32_MAX || p.heads_q > INT32_MAX) return "batch and heads must fit in 32 bits";
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return "a sequence length is 0 (a TMA descriptor needs a non-empty tensor)";
  return {};
}

struct Sm90BackwardBuilt {
  constexpr bool operator()(int d) const { return contains(kSm90BackwardHeadDims, d); }
};

// float16 operands with float32 gradients (AttentionBackwardParams::float32_gradients, the TF32-class backward of
// float32 calls) have kernels of their own for every backward head dim and form, built whatever
// JAX_FLASH_CUDA_FP16 says; the rest take the gradients' type from the operands.
std::string run_sm90_backward(const AttentionBackwardParams& p, cudaStream_t stream) {
  return with_head_dim<Sm90BackwardBuilt>(sm90_backward_head_dim(p.head_dim), [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    if (p.float32_gradients) return sm90::launch_backward<kDim, cutlass::half_t, float>(p, stream);
    return with_half_element(p.element_type, [&](auto element) {
      return sm90::launch_backward<kDim, decltype(element), decltype(element)>(p, stream);
    });
  });
}

}  // namespace

std::string run_forward(const AttentionParams& p, cudaStream_t stream) {
  if (std::string err = check_supported(p); !err.empty()) return err;
  if (nothing_to_do(p)) return {};
  if (p.element_type == ElementType::kFloat32) {
    // With float32_precision="highest", the split-TF32 workspace asks for the split-TF32 kernel; the rest of
    // "highest" runs the exact float32 kernel.
    bool use_sm90 = false;
    if (std::string err = choose_sm90("JAX_FLASH_CUDA_KERNEL_F32",
                                      p.split_tf32 ? "sm90 split-TF32 forward" : "sm90 TF32 forward",
                                      /*unset_means_auto=*/true,
                                      [&] { return sm90_float32_refusal(p, p.split_tf32); },
                                      &use_sm90);
        !err.empty()) {
      return err;
    }
    if (use_sm90) return run_sm90_float32_forward(p, stream);
    return with_head_dim<Sm80Built>(padded_head_dim(p.head_dim), [&](auto dim) {
      return f32::launch_forward<decltype(dim)::value>(p, stream);
    });
  }
  bool dense = false;
  if (std::string err = sm90_dense_switch(&dense); !err.empty()) return err;
  bool use_sm90 = false;
  if (std::string err = choose_sm90("JAX_FLASH_CUDA_KERNEL", "sm90 kernel", /*unset_means_auto=*/true,
                                    [&] { return sm90_forward_refusal(p, dense); }, &use_sm90);
      !err.empty()) {
    return err;
  }
  if (use_sm90) return run_sm90_forward(p, stream);
  return with_head_dim<Sm80Built>(padded_head_dim(p.head_dim), [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    return with_half_element(p.element_type, [&](auto element) {
      return sm80::launch_forward<kDim, decltype(element)>(p, stream);
    });
  });
}

std::string run_backward(const AttentionBackwardParams& p, cudaStream_t stream) {
  if (std::string err = check_supported(p); !err.empty()) return err;
  if (p.dbias != nullptr) {  // the kernels add into it; it stays 0 where no score reaches (even an empty batch)
    const int64_t dbias_bytes = p.outer_batch * p.bias_strides.outer * int64_t(sizeof(float));
    if (cudaMemsetAsync(p.dbias, 0, dbias_bytes, stream) != cudaSuccess) return "cudaMemsetAsync of dbias failed";
  }
  if (p.batch == 0 || p.heads_q == 0) return {};  // empty seqlens still need zero dK/dV or dQ
  // Float32 gradients of float16 operands: only the Hopper backward writes them (sm80 GPUs have no such kernels), so
  // a call it cannot run is an error naming why (jax_flash/_ffi_calls.py _uses_half_operands_backward sends only
  // calls it runs).
  if (p.float32_gradients) {
    if (std::string why = sm90_backward_refusal(p); !why.empty()) {
      return "float32 gradients of float16 operands (the Hopper backward's; JAX_FLASH_SM90_TF32_BACKWARD_FP16): " +
             why;
    }
    return run_sm90_backward(p, stream);
  }
  if (p.element_type == ElementType::kFloat32) {
    bool use_sm90 = false;
    if (std::string err = choose_sm90("JAX_FLASH_CUDA_KERNEL_F32_BACKWARD", sm90_float32_backward_name(p),
                                      /*unset_means_auto=*/true, [&] { return sm90_tf32_backward_refusal(p); },
                                      &use_sm90);
        !err.empty()) {
      return err;
    }
    const f32::Tf32Passes hopper = use_sm90 ? sm90_tf32_passes(p) : f32::Tf32Passes{};
    return with_head_dim<Sm80Built>(padded_head_dim(p.head_dim), [&](auto dim) {
      return f32::launch_backward<decltype(dim)::value>(p, stream, hopper);
    });
  }
  bool use_sm90 = false;
  if (std::string err = choose_sm90("JAX_FLASH_CUDA_KERNEL_BACKWARD", "sm90 backward", /*unset_means_auto=*/true,
                                    [&] { return sm90_backward_refusal(p); }, &use_sm90);
      !err.empty()) {
    return err;
  }
  if (use_sm90) return run_sm90_backward(p, stream);
  return with_head_dim<Sm80Built>(padded_head_dim(p.head_dim), [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    return with_half_element(p.element_type, [&](auto element) {
      return sm80::launch_backward<kDim, decltype(element)>(p, stream);
    });
  });
}

}  // namespace jax_flash::cuda
