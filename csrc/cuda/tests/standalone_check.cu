// Standalone GPU check of run_forward / run_backward against a float64 host reference, without Python or XLA.
// Fresh random inputs per case, outputs poisoned with NaN before each call, every feature of the score pipeline.
//   standalone_check            run the case grid; exit status 1 on any failure
//   standalone_check --small    a few small cases (for compute-sanitizer)
//   standalone_check --bench    time fwd/bwd at d=128 and d=256, 16k tokens, seqlen 4k (CUDA events; plain, causal,
//                               padding mask, softcap 50, causal ALiBi); other head dims with
//                               JAX_FLASH_BENCH_HEAD_DIMS (e.g. "64 128")
//   standalone_check --bench-persistent
//                               the forward at d=64/128/256, 16k tokens, seqlens 512..8k, one CTA per tile vs the
//                               persistent grid (JAX_FLASH_SM90_PERSISTENT=0/1); exit status 1 unless the two
//                               modes' outputs are bit-identical
//   The sm90 forward's grid modes over the case grid: unset (auto) runs the persistent grid where seqlen_k <= 2048,
//   i.e. every case of the grid; JAX_FLASH_SM90_PERSISTENT=0 forces one CTA per tile, =1 the persistent grid, and
//   JAX_FLASH_SM90_PERSISTENT_CTAS=N (e.g. 1 or 3) makes small cases loop over many tiles per CTA.
//   On a 9.x GPU, each case with a bias and/or mask but no dropout runs its forward forced to sm90
//   (JAX_FLASH_CUDA_KERNEL=sm90: a refusal fails the case) unless JAX_FLASH_SM90_DENSE=0 (then sm80, as the
//   dispatcher would); --bench times the padding-mask forward both ways
//   standalone_check --sm90-backward [--small]
//                               the Hopper backward (experimental): a grid aimed at it, each case's backward forced
//                               to sm90 where it applies (JAX_FLASH_CUDA_KERNEL_BACKWARD=sm90, so a refusal fails the
//                               case) and to sm80 elsewhere; --bench honours that variable as set by the caller
//   JAX_FLASH_CHECK_SKIP_UNBUILT=1: on a build narrowed by the development switches (JAX_FLASH_CUDA_HEAD_DIMS,
//   JAX_FLASH_CUDA_SM90_HEAD_DIMS, JAX_FLASH_CUDA_FP16=OFF), cases the build has no kernel for are skipped and
//   counted apart instead of failing (device_run.sh sets it for such builds)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../../common/dq_workspace.h"
#include "../../common/mask_blocks.h"
#include "../../common/philox.h"
#include "../../common/score_pipeline.h"
#include "../build_refusal.h"
#include "../launch.h"

using jax_flash::AttentionBackwardParams;
using jax_flash::AttentionParams;
using jax_flash::ElementType;

namespace {

#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

struct Case {
  std::string name;
  int64_t batch = 1, seqlen_q = 64, seqlen_k = 64, heads_q = 2, heads_kv = 2, head_dim = 64;
  ElementType type = ElementType::kBFloat16;
  bool causal = false;
  bool align_to_sequence_end = true;
  int64_t diagonal_offset = 0, window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false, seqlens = false, segments = false, deterministic = false;
  float input_scale = 1.0f;  // larger logits exercise softcap and the running-max rescale
  int bias = 0;              // 0: none, 1: full [B, Hq, Sq, Sk], 2: [1, Hq, 1, Sk] (broadcast: dbias sums)
  bool dense_mask = false;   // random boolean mask [B, 1, Sq, Sk] with a fully masked row, and its block summary
  bool mask_blocks = false;  // dense_mask with whole regions hidden or visible, padded key tails, a blind row block
  int64_t blind_rows = 0;    // mask_blocks: the last batch row's first blind_rows rows see nothing (whole tiles)
  bool mask_per_head = false;  // dense_mask of shape [B, Hq, Sq, Sk]: each query head its own (regions shifted)
  bool key_padding = false;    // dense_mask as a [B, 1, 1, Sk] key-padding mask instead (query stride 0): batch
                               // row b sees its first Sk - b * Sk / (B - 1) keys, so the last one sees none
  float dropout_rate = 0.0f;
};

// ---- element conversion -------------------------------------------------------------------------------
uint16_t to_bits(float x, ElementType t) {
  uint16_t bits;
  if (t == ElementType::kBFloat16) {
    __nv_bfloat16 h = __float2bfloat16(x);
    std::memcpy(&bits, &h, 2);
  } else {
    __half h = __float2half(x);
    std::memcpy(&bits, &h, 2);
  }
  return bits;
}
float from_bits(uint16_t bits, ElementType t) {
  if (t == ElementType::kBFloat16) {
    __nv_bfloat16 h;
    std::memcpy(&h, &bits, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &bits, 2);
  return __half2float(h);
}

// A host tensor of 16-bit elements and its float values (exactly representable).
struct HostTensor {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};
HostTensor random_tensor(size_t n, ElementType t, float scale, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, scale);
  HostTensor h;
  h.bits.resize(n);
  h.values.resize(n);
  for (size_t i = 0; i < n; ++i) {
    h.bits[i] = to_bits(dist(rng), t);
    h.values[i] = from_bits(h.bits[i], t);
  }
  return h;
}

template <class T>
T* to_device(const std::vector<T>& host) {
  T* ptr = nullptr;
  CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(host.size(), 1) * sizeof(T)));
  if (!host.empty()) CHECK_CUDA(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return ptr;
}
template <class T>
std::vector<T> to_host(const T* ptr, size_t n) {
  std::vector<T> host(n);
  if (n) CHECK_CUDA(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}
template <class T>
T* poisoned(size_t n) {  // 0xFF bytes: NaN in bf16, fp16 and f32
  T* ptr = nullptr;
  CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
  CHECK_CUDA(cudaMemset(ptr, 0xFF, std::max<size_t>(n, 1) * sizeof(T)));
  return ptr;
}

// ---- float64 reference --------------------------------------------------------------------------------
struct Reference {
  std::vector<double> o, lse, dq, dk, dv, dbias;
};

Reference reference(const Case& c, const AttentionParams& host_params, const std::vector<float>& q,
                    const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& d_o,
                    const std::vector<float>& d_lse, size_t bias_elements) {
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, Hq = c.heads_q, Hkv = c.heads_kv, D = c.head_dim;
  Reference r;
  r.o.assign(B * Sq * Hq * D, 0.0);
  r.lse.assign(B * Hq * Sq, -INFINITY);
  r.dq.assign(B * Sq * Hq * D, 0.0);
  r.dk.assign(B * Sk * Hkv * D, 0.0);
  r.dv.assign(B * Sk * Hkv * D, 0.0);
  r.dbias.assign(bias_elements, 0.0);
  const double scale = host_params.softmax_scale;
  const jax_flash::BroadcastStrides& bs = host_params.bias_strides;
  const bool dropout = host_params.dropout_rate > 0.0f;
  const uint32_t threshold = jax_flash::dropout_threshold(host_params.dropout_rate);
  const double keep_scale = 1.0 / (1.0 - double(host_params.dropout_rate));
  std::vector<double> s(Sk), grad(Sk), p(Sk), keep(Sk, 1.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const jax_flash::SliceMask mask = jax_flash::make_slice_mask(host_params, b, h);
      const int64_t hk = h / (Hq / Hkv);
      auto qrow = [&](int64_t i) { return &q[((b * Sq + i) * Hq + h) * D]; };
      auto krow = [&](int64_t j) { return &k[((b * Sk + j) * Hkv + hk) * D]; };
      auto vrow = [&](int64_t j) { return &v[((b * Sk + j) * Hkv + hk) * D]; };
      for (int64_t i = 0; i < Sq; ++i) {
        double max_s = -INFINITY;
        for (int64_t j = 0; j < Sk; ++j) {
          if (!mask.visible(i, j)) {
            s[j] = -INFINITY;
            continue;
          }
          double dot = 0;
          for (int64_t e = 0; e < D; ++e) dot += double(qrow(i)[e]) * krow(j)[e];
          double x = dot * scale, g = 1.0;
          if (c.softcap > 0) {
            const double t = std::tanh(x / c.softcap);
            x = c.softcap * t;
            g = 1.0 - t * t;
          }
          if (mask.alibi_slope != 0.0f) x -= double(mask.alibi_slope) * std::llabs(i + mask.diagonal_shift - j);
          x += mask.bias_at(i, j);
          s[j] = x;
          grad[j] = g;
          max_s = std::max(max_s, x);
        }
        if (max_s == -INFINITY) continue;  // fully masked: o = 0, lse = -inf, no gradient
        double sum = 0;
        for (int64_t j = 0; j < Sk; ++j) sum += (p[j] = s[j] == -INFINITY ? 0.0 : std::exp(s[j] - max_s));
        const int64_t out_row = ((b * Sq + i) * Hq + h) * D;
        for (int64_t j = 0; j < Sk && dropout; ++j) {  // o = dropout(P) V; lse of the undropped P
          const bool kept = jax_flash::dropout_keeps(host_params.dropout_seeds + 2 * b, threshold, h, i, j);
          keep[j] = kept ? keep_scale : 0.0;
        }
        for (int64_t j = 0; j < Sk; ++j) {
          p[j] /= sum;
          if (p[j] == 0) continue;
          for (int64_t e = 0; e < D; ++e) r.o[out_row + e] += p[j] * keep[j] * vrow(j)[e];
        }
        const int64_t stat = (b * Hq + h) * Sq + i;
        r.lse[stat] = max_s + std::log(sum);
        // Backward of this row: dS = P (dP - rowsum(dO o) + dlse).
        double row_d = 0;
        for (int64_t e = 0; e < D; ++e) row_d += double(d_o[out_row + e]) * r.o[out_row + e];
        row_d -= d_lse[stat];
        for (int64_t j = 0; j < Sk; ++j) {
          if (p[j] == 0) continue;
          double dp = 0;
          for (int64_t e = 0; e < D; ++e) dp += double(d_o[out_row + e]) * vrow(j)[e];
          const double dscore = p[j] * (dp * keep[j] - row_d);
          if (!r.dbias.empty()) r.dbias[b * bs.batch + h * bs.head + i * bs.query + j * bs.key] += dscore;
          const double ddot = dscore * grad[j] * scale;
          const int64_t kv_row = ((b * Sk + j) * Hkv + hk) * D;
          for (int64_t e = 0; e < D; ++e) {
            r.dq[out_row + e] += ddot * krow(j)[e];
            r.dk[kv_row + e] += ddot * qrow(i)[e];
            r.dv[kv_row + e] += p[j] * keep[j] * d_o[out_row + e];
          }
        }
      }
    }
  }
  return r;
}

// ---- comparison ---------------------------------------------------------------------------------------
struct Error {
  double rel_l2 = 0, max_abs = 0;
  int64_t nan = 0;
};
Error compare(const std::vector<double>& ref, const std::vector<float>& got) {
  double diff2 = 0, ref2 = 0;
  Error e;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i])) {
      ++e.nan;
      continue;
    }
    const double d = got[i] - ref[i];
    diff2 += d * d;
    ref2 += ref[i] * ref[i];
    e.max_abs = std::max(e.max_abs, std::fabs(d));
  }
  e.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  return e;
}
std::vector<float> values_of(const std::vector<uint16_t>& bits, ElementType t) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = from_bits(bits[i], t);
  return v;
}

bool report(const std::string& what, const Error& e, double tolerance) {
  const bool ok = e.nan == 0 && e.rel_l2 <= tolerance;
  std::printf("    %-4s rel_l2 %.2e  max_abs %.2e  nan %lld  %s\n", what.c_str(), e.rel_l2, e.max_abs,
              static_cast<long long>(e.nan), ok ? "ok" : "FAIL");
  return ok;
}

// lse: -inf exactly where the reference has it, else close in absolute terms.
bool report_lse(const std::vector<double>& ref, const std::vector<float>& got) {
  int64_t mismatched_inf = 0, nan = 0;
  double max_abs = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i])) ++nan;
    else if ((ref[i] == -INFINITY) != (got[i] == -INFINITY)) ++mismatched_inf;
    else if (ref[i] != -INFINITY) max_abs = std::max(max_abs, std::fabs(got[i] - ref[i]));
  }
  const bool ok = nan == 0 && mismatched_inf == 0 && max_abs < 2e-3;
  std::printf("    lse  max_abs %.2e  inf-mismatch %lld  nan %lld  %s\n", max_abs,
              static_cast<long long>(mismatched_inf), static_cast<long long>(nan), ok ? "ok" : "FAIL");
  return ok;
}

// A [B, 1, Sq, Sk] mask, 4 in 5 elements visible at random. With c.mask_blocks, regions of 256 rows x 128 keys
// (whole tiles of every kernel) are in turn hidden, visible and random; batch row b hides its last b * Sk / 2B keys
// (key padding); the last batch row's rows 64..127 (and its first c.blind_rows) see nothing. `head` shifts the
// regions (c.mask_per_head: each query head its own pattern).
std::vector<uint8_t> random_mask(const Case& c, std::mt19937& rng, int64_t head = 0) {
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k;
  std::vector<uint8_t> mask(B * Sq * Sk);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Sq; ++i) {
      for (int64_t j = 0; j < Sk; ++j) {
        uint8_t& m = mask[(b * Sq + i) * Sk + j];
        const int64_t region = (i / 256 + j / 128 + head) % 3;
        if (c.mask_blocks && (j >= Sk - b * Sk / (2 * B) || (b == B - 1 && (i / 64 == 1 || i < c.blind_rows)) ||
                              region == 0)) {
          m = 0;
        } else if (c.mask_blocks && region == 1) {
          m = 1;
        } else {
          m = rng() % 5 != 0;
        }
      }
    }
  }
  return mask;
}

// c.key_padding's [B, 1, 1, Sk] mask: batch row b sees its first Sk - b * Sk / (B - 1) keys (all of them when B
// is 1).
std::vector<uint8_t> key_padding_mask(const Case& c) {
  const int64_t B = c.batch, Sk = c.seqlen_k;
  std::vector<uint8_t> mask(B * Sk);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t visible = B == 1 ? Sk : Sk - b * Sk / (B - 1);
    for (int64_t j = 0; j < Sk; ++j) mask[b * Sk + j] = j < visible;
  }
  return mask;
}

// A case's boolean mask (empty without c.dense_mask), laid out [B, mask_heads, mask_rows, Sk]: mask_heads is Hq
// with c.mask_per_head, else 1; mask_rows is 1 with c.key_padding, else Sq.
struct CaseMask {
  std::vector<uint8_t> elements;
  int64_t heads = 1, rows = 0;
};

CaseMask case_mask(const Case& c, std::mt19937& rng) {
  CaseMask m;
  m.rows = c.seqlen_q;
  if (!c.dense_mask) return m;
  if (c.key_padding) {
    m.rows = 1;
    m.elements = key_padding_mask(c);
    return m;
  }
  m.heads = c.mask_per_head ? c.heads_q : 1;
  const int64_t B = c.batch, slice = c.seqlen_q * c.seqlen_k;
  m.elements.resize(B * m.heads * slice);
  for (int64_t h = 0; h < m.heads; ++h) {
    const std::vector<uint8_t> head_mask = random_mask(c, rng, h);  // [B, Sq, Sk]
    for (int64_t b = 0; b < B; ++b) {
      std::copy(head_mask.begin() + b * slice, head_mask.begin() + (b + 1) * slice,
                m.elements.begin() + (b * m.heads + h) * slice);
    }
  }
  // Row 3 of batch row 0 (its first head) sees nothing.
  if (c.seqlen_q > 3) std::fill(m.elements.begin() + 3 * c.seqlen_k, m.elements.begin() + 4 * c.seqlen_k, 0);
  return m;
}

// The block summary (common/mask_blocks.h) of a [B, 1, Sq, Sk] mask: [B, 1, blocks(Sq), blocks(Sk)].
std::vector<uint8_t> mask_block_summary(const std::vector<uint8_t>& mask, int64_t B, int64_t Sq, int64_t Sk) {
  if (mask.empty()) return {};
  const int64_t nq = jax_flash::mask_blocks_along(Sq), nk = jax_flash::mask_blocks_along(Sk);
  constexpr int64_t kBlock = jax_flash::kMaskBlock;
  std::vector<uint8_t> summary(B * nq * nk);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t qb = 0; qb < nq; ++qb) {
      for (int64_t kb = 0; kb < nk; ++kb) {
        bool any = false, all = true;
        for (int64_t i = qb * kBlock; i < std::min(Sq, (qb + 1) * kBlock); ++i) {
          for (int64_t j = kb * kBlock; j < std::min(Sk, (kb + 1) * kBlock); ++j) {
            any |= mask[(b * Sq + i) * Sk + j] != 0;
            all &= mask[(b * Sq + i) * Sk + j] != 0;
          }
        }
        summary[(b * nq + qb) * nk + kb] = uint8_t(any) + uint8_t(all);
      }
    }
  }
  return summary;
}

// Byte strides of that summary, 0 along its size-1 axes (as csrc/ffi passes them).
jax_flash::BroadcastStrides summary_strides(int64_t B, int64_t Sq, int64_t Sk) {
  const int64_t nq = jax_flash::mask_blocks_along(Sq), nk = jax_flash::mask_blocks_along(Sk);
  return {B * nq * nk, B == 1 ? 0 : nq * nk, 0, nq == 1 ? 0 : nk, nk == 1 ? 0 : 1};
}

bool device_is_hopper() {
  int device = 0, major = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major == 9;
}

// Whether this case's forward is forced to the sm90 kernel: unless JAX_FLASH_SM90_DENSE=0, on a 9.x GPU, every case
// with a bias and/or mask that the sm90 forward can take (dispatch.cu sm90_forward_refusal: no dropout, head_dim a
// multiple of 8 and at most 256).
bool sm90_dense_forward(const Case& c) {
  const char* dense = std::getenv("JAX_FLASH_SM90_DENSE");
  if (dense != nullptr && std::string(dense) == "0") return false;
  static const bool hopper = device_is_hopper();
  return hopper && (c.bias != 0 || c.dense_mask) && c.dropout_rate == 0.0f && c.head_dim % 8 == 0 &&
         c.head_dim <= 256 && c.seqlen_k > 0;
}

// An environment variable the dispatcher reads at every call, set for a scope: the caller's value (or its absence)
// comes back when the scope ends.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* current = std::getenv(name);
    had_ = current != nullptr;
    previous_ = current ? current : "";
    set(value);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, previous_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  void set(const char* value) const { setenv(name_, value, 1); }

 private:
  const char* name_;
  bool had_ = false;
  std::string previous_;
};

enum class Outcome { kPassed, kFailed, kNotBuilt };

// JAX_FLASH_CHECK_SKIP_UNBUILT=1 (device_run.sh sets it for builds narrowed by JAX_FLASH_CUDA_HEAD_DIMS,
// JAX_FLASH_CUDA_SM90_HEAD_DIMS or JAX_FLASH_CUDA_FP16=OFF): a case the build left the kernel out for
// (build_refusal.h) is skipped and counted apart. Otherwise every refusal fails its case.
Outcome refused(const char* call, const std::string& err) {
  const char* skip = std::getenv("JAX_FLASH_CHECK_SKIP_UNBUILT");
  if (skip != nullptr && std::string(skip) == "1" && jax_flash::cuda::is_build_refusal(err)) {
    std::printf("    %s: %s  (skipped: not in this build)\n", call, err.c_str());
    return Outcome::kNotBuilt;
  }
  std::printf("    %s: %s  FAIL\n", call, err.c_str());
  return Outcome::kFailed;
}

Outcome run_case(const Case& c, std::mt19937& rng) {
  const ElementType t = c.type;
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, Hq = c.heads_q, Hkv = c.heads_kv, D = c.head_dim;
  const size_t nq = B * Sq * Hq * D, nk = B * Sk * Hkv * D, nstat = B * Hq * Sq;
  std::printf("%-34s b=%lld sq=%lld sk=%lld hq=%lld hkv=%lld d=%lld %s\n", c.name.c_str(), (long long)B,
              (long long)Sq, (long long)Sk, (long long)Hq, (long long)Hkv, (long long)D,
              t == ElementType::kBFloat16 ? "bf16" : "fp16");
  // Dense operands, bias/mask strides of a [1, Hq, 1, Sk] or [B, Hq, Sq, Sk] bias and a [B, 1, Sq, Sk] mask.
  jax_flash::BroadcastStrides bias_strides;
  if (c.bias == 1) bias_strides = {B * Hq * Sq * Sk, Hq * Sq * Sk, Sq * Sk, Sk, 1};
  if (c.bias == 2) bias_strides = {Hq * Sk, 0, Sk, 0, 1};
  const size_t bias_elements = c.bias ? bias_strides.outer : 0;
  std::vector<float> bias(bias_elements);
  for (auto& x : bias) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  const CaseMask case_mask_ = case_mask(c, rng);
  const std::vector<uint8_t>& dense_mask = case_mask_.elements;
  const int64_t mask_heads = case_mask_.heads, mask_rows = case_mask_.rows;
  // The summary of each (batch, mask head) slice, [B, mask_heads, blocks(mask_rows), blocks(Sk)].
  const std::vector<uint8_t> mask_summary = mask_block_summary(dense_mask, B * mask_heads, mask_rows, Sk);
  jax_flash::BroadcastStrides mask_summary_strides = summary_strides(B, mask_rows, Sk);
  if (mask_heads > 1) {
    const int64_t slice = jax_flash::mask_blocks_along(mask_rows) * jax_flash::mask_blocks_along(Sk);
    mask_summary_strides = {B * mask_heads * slice, mask_heads * slice, slice, mask_summary_strides.query,
                            mask_summary_strides.key};
  }
  std::vector<uint32_t> seeds(2 * B);
  for (auto& x : seeds) x = static_cast<uint32_t>(rng());
  HostTensor q = random_tensor(nq, t, c.input_scale, rng), k = random_tensor(nk, t, c.input_scale, rng),
             v = random_tensor(nk, t, 1.0f, rng), d_o = random_tensor(nq, t, 1.0f, rng);
  std::vector<float> d_lse(nstat);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (auto& x : d_lse) x = normal(rng);

  std::vector<float> alibi(B * Hq);
  std::vector<int32_t> q_lens(B), kv_lens(B), q_seg(B * Sq), kv_seg(B * Sk);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (auto& a : alibi) a = 0.05f + 0.2f * uniform(rng);
  for (int64_t b = 0; b < B; ++b) {
    q_lens[b] = static_cast<int32_t>(b == 0 ? Sq : std::max<int64_t>(0, Sq - 1 - (rng() % std::max<int64_t>(Sq, 1))));
    kv_lens[b] = static_cast<int32_t>(b == 0 ? Sk : std::max<int64_t>(1, Sk - (rng() % std::max<int64_t>(Sk, 1))));
    // Segments: a few contiguous runs per row, numbered in order on both sides.
    for (int64_t i = 0; i < Sq; ++i) q_seg[b * Sq + i] = static_cast<int32_t>((i * 3) / std::max<int64_t>(Sq, 1));
    for (int64_t j = 0; j < Sk; ++j) kv_seg[b * Sk + j] = static_cast<int32_t>((j * 3) / std::max<int64_t>(Sk, 1));
  }

  AttentionParams host{};
  host.batch = B;
  host.seqlen_q = Sq;
  host.seqlen_k = Sk;
  host.heads_q = Hq;
  host.heads_kv = Hkv;
  host.head_dim = D;
  host.element_type = t;
  host.softmax_scale = 1.0f / std::sqrt(float(D));
  host.softcap = c.softcap;
  host.causal = c.causal;
  host.align_to_sequence_end = c.align_to_sequence_end;
  host.diagonal_offset = c.diagonal_offset;
  host.window_left = c.window_left;
  host.window_right = c.window_right;
  if (c.alibi) host.alibi_slopes = alibi.data();
  if (c.seqlens) {
    host.q_seqlens = q_lens.data();
    host.kv_seqlens = kv_lens.data();
  }
  if (c.segments) {
    host.q_segment_ids = q_seg.data();
    host.kv_segment_ids = kv_seg.data();
  }
  host.inner_batch = B;
  host.outer_batch = 1;
  if (c.bias) {
    host.bias = bias.data();
    host.bias_strides = bias_strides;
  }
  if (c.dense_mask) {
    host.mask = reinterpret_cast<const bool*>(dense_mask.data());
    host.mask_strides = {B * mask_heads * mask_rows * Sk, mask_heads * mask_rows * Sk,
                         mask_heads > 1 ? mask_rows * Sk : 0, mask_rows > 1 ? Sk : 0, 1};
  }
  host.dropout_rate = c.dropout_rate;
  if (c.dropout_rate > 0.0f) host.dropout_seeds = seeds.data();
  const Reference ref = reference(c, host, q.values, k.values, v.values, d_o.values, d_lse, bias_elements);

  AttentionBackwardParams p{};
  static_cast<AttentionParams&>(p) = host;
  p.alibi_slopes = c.alibi ? to_device(alibi) : nullptr;
  p.q_seqlens = c.seqlens ? to_device(q_lens) : nullptr;
  p.kv_seqlens = c.seqlens ? to_device(kv_lens) : nullptr;
  p.q_segment_ids = c.segments ? to_device(q_seg) : nullptr;
  p.kv_segment_ids = c.segments ? to_device(kv_seg) : nullptr;
  p.bias = c.bias ? to_device(bias) : nullptr;
  p.mask = c.dense_mask ? reinterpret_cast<const bool*>(to_device(dense_mask)) : nullptr;
  p.mask_blocks = c.dense_mask ? to_device(mask_summary) : nullptr;
  p.mask_blocks_strides = mask_summary_strides;
  p.dropout_seeds = c.dropout_rate > 0.0f ? to_device(seeds) : nullptr;
  p.q = to_device(q.bits);
  p.k = to_device(k.bits);
  p.v = to_device(v.bits);
  p.o = poisoned<uint16_t>(nq);
  p.lse = poisoned<float>(nstat);
  std::optional<ScopedEnv> forced;
  if (sm90_dense_forward(c)) {
    forced.emplace("JAX_FLASH_CUDA_KERNEL", "sm90");
    std::printf("    [forward: sm90 dense form]\n");
  }
  std::string err = jax_flash::cuda::run_forward(p, nullptr);
  forced.reset();
  if (!err.empty()) return refused("run_forward", err);
  CHECK_CUDA(cudaDeviceSynchronize());
  bool ok = true;
  ok &= report("o", compare(ref.o, values_of(to_host(static_cast<uint16_t*>(p.o), nq), t)),
               t == ElementType::kBFloat16 ? 2e-2 : 4e-3);
  ok &= report_lse(ref.lse, to_host(p.lse, nstat));

  p.d_o = to_device(d_o.bits);
  p.d_lse = to_device(d_lse);
  p.deterministic = c.deterministic;
  std::vector<uint16_t> first_grads[3];
  std::vector<float> first_dbias;
  for (int run = 0; run < (c.deterministic ? 2 : 1); ++run) {
    p.dbias = c.bias ? poisoned<float>(bias_elements) : nullptr;
    p.dq = poisoned<uint16_t>(nq);
    p.dk = poisoned<uint16_t>(nk);
    p.dv = poisoned<uint16_t>(nk);
    p.softmax_d = poisoned<float>(nstat);
    // Poisoned: the fused-dQ path must zero it itself; deterministic calls must leave it alone.
    p.dq_accum = poisoned<float>(jax_flash::dq_workspace_elements(B, Sq, Hq, D));
    // Also poisoned: the sm80 fused pass zeroes the slots of a tail it splits (most small uniform cases here).
    p.dkdv_tail_floats = jax_flash::dkdv_tail_elements(B, Sk, Hkv);
    p.dkdv_tail = poisoned<float>(p.dkdv_tail_floats);
    err = jax_flash::cuda::run_backward(p, nullptr);
    if (!err.empty()) return refused("run_backward", err);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> grads[3] = {to_host(static_cast<uint16_t*>(p.dq), nq),
                                      to_host(static_cast<uint16_t*>(p.dk), nk),
                                      to_host(static_cast<uint16_t*>(p.dv), nk)};
    const std::vector<float> dbias = to_host(p.dbias, bias_elements);
    if (run == 0) {
      const double tol = t == ElementType::kBFloat16 ? 3e-2 : 6e-3;
      ok &= report("dq", compare(ref.dq, values_of(grads[0], t)), tol);
      ok &= report("dk", compare(ref.dk, values_of(grads[1], t)), tol);
      ok &= report("dv", compare(ref.dv, values_of(grads[2], t)), tol);
      if (c.bias) ok &= report("dbias", compare(ref.dbias, dbias), tol);
      for (int g = 0; g < 3; ++g) first_grads[g] = grads[g];
      first_dbias = dbias;
    } else {
      const bool same = grads[0] == first_grads[0] && grads[1] == first_grads[1] && grads[2] == first_grads[2] &&
                        dbias == first_dbias;
      std::printf("    deterministic rerun bit-identical: %s\n", same ? "ok" : "FAIL");
      ok &= same;
    }
    for (void* ptr : {p.dq, p.dk, p.dv}) CHECK_CUDA(cudaFree(ptr));
    if (p.dbias) CHECK_CUDA(cudaFree(p.dbias));
    CHECK_CUDA(cudaFree(p.softmax_d));
    CHECK_CUDA(cudaFree(p.dq_accum));
    CHECK_CUDA(cudaFree(p.dkdv_tail));
  }
  for (const void* ptr : {p.q, p.k, p.v, p.d_o, static_cast<const void*>(p.d_lse), static_cast<const void*>(p.lse),
                          static_cast<const void*>(p.o), static_cast<const void*>(p.alibi_slopes),
                          static_cast<const void*>(p.q_seqlens), static_cast<const void*>(p.kv_seqlens),
                          static_cast<const void*>(p.q_segment_ids), static_cast<const void*>(p.kv_segment_ids),
                          static_cast<const void*>(p.bias), static_cast<const void*>(p.mask),
                          static_cast<const void*>(p.mask_blocks), static_cast<const void*>(p.dropout_seeds)}) {
    if (ptr) CHECK_CUDA(cudaFree(const_cast<void*>(ptr)));
  }
  return ok ? Outcome::kPassed : Outcome::kFailed;
}

std::vector<Case> case_grid(bool small) {
  std::vector<Case> cases;
  auto add = [&](Case c) { cases.push_back(c); };
  add({.name = "basic"});
  add({.name = "seqlen 1", .seqlen_q = 1, .seqlen_k = 1});
  add({.name = "seqlen 17, d=40 causal", .seqlen_q = 17, .seqlen_k = 17, .head_dim = 40, .causal = true});
  add({.name = "unaligned d=33 (element path)", .seqlen_q = 70, .seqlen_k = 45, .head_dim = 33});
  add({.name = "GQA causal sq<sk", .batch = 2, .seqlen_q = 77, .seqlen_k = 150, .heads_q = 6, .heads_kv = 2,
       .causal = true});
  add({.name = "window + seqlens + segments + softcap + alibi", .batch = 3, .seqlen_q = 130, .seqlen_k = 200,
       .heads_q = 4, .heads_kv = 1, .window_left = 40, .window_right = 7, .softcap = 5.0f, .alibi = true,
       .seqlens = true, .segments = true, .input_scale = 2.0f});
  add({.name = "fp16 causal deterministic", .batch = 2, .seqlen_q = 100, .seqlen_k = 100, .heads_q = 4,
       .heads_kv = 2, .type = ElementType::kFloat16, .causal = true, .deterministic = true});
  add({.name = "full bias + mask + dropout GQA causal", .batch = 2, .seqlen_q = 77, .seqlen_k = 150, .heads_q = 4,
       .heads_kv = 2, .causal = true, .bias = 1, .dense_mask = true, .dropout_rate = 0.2f});
  add({.name = "broadcast bias atomics + seqlens", .batch = 2, .seqlen_q = 70, .seqlen_k = 90, .heads_q = 4,
       .heads_kv = 2, .seqlens = true, .bias = 2, .dropout_rate = 0.1f});
  add({.name = "broadcast bias deterministic fp16", .batch = 2, .seqlen_q = 70, .seqlen_k = 90, .heads_q = 4,
       .heads_kv = 2, .type = ElementType::kFloat16, .deterministic = true, .bias = 2, .dense_mask = true,
       .dropout_rate = 0.1f});
  add({.name = "mask blocks (skipped tiles) GQA", .batch = 2, .seqlen_q = 300, .seqlen_k = 333, .heads_q = 4,
       .heads_kv = 2, .dense_mask = true, .mask_blocks = true});
  // Bias and mask without dropout (the sm90 forward takes these unless JAX_FLASH_SM90_DENSE=0).
  add({.name = "full bias GQA d=128", .batch = 2, .seqlen_q = 300, .seqlen_k = 257, .heads_q = 4, .heads_kv = 2,
       .head_dim = 128, .bias = 1});
  add({.name = "broadcast bias + blind row blocks + seqlens", .batch = 2, .seqlen_q = 400, .seqlen_k = 333,
       .heads_q = 4, .heads_kv = 2, .seqlens = true, .bias = 2, .dense_mask = true, .mask_blocks = true,
       .blind_rows = 256});
  // seqlen_k > 2048: the Hopper forward's per-tile grid, at d=64 with its 192-row tile (kernel_traits.h).
  add({.name = "d=64 long keys (192-row tile) GQA causal", .batch = 1, .seqlen_q = 450, .seqlen_k = 2200,
       .heads_q = 4, .heads_kv = 2, .head_dim = 64, .causal = true});
  // At most 64 query rows: the Hopper forward's one-consumer tile (kernel_traits.h RowTile::kShort), on the per-tile
  // grid (seqlen_k > 2048) and on the persistent one.
  add({.name = "d=128 decoding rows (64-row tile) GQA seqlens", .batch = 2, .seqlen_q = 5, .seqlen_k = 2300,
       .heads_q = 8, .heads_kv = 2, .head_dim = 128, .seqlens = true});
  add({.name = "d=64 64 rows (64-row tile) causal fp16", .batch = 2, .seqlen_q = 64, .seqlen_k = 300, .heads_q = 4,
       .heads_kv = 2, .head_dim = 64, .type = ElementType::kFloat16, .causal = true});
  // Uniform key blocks, fewer than a wave: the sm80 fused pass cuts each into pieces adding into its tail slot
  // (sm80/dkdv_tail_plan.h; here 12 blocks of 20 items, 10 pieces each), a ragged last key block among them.
  add({.name = "fused dQ tail pieces GQA segments d=128", .batch = 2, .seqlen_q = 300, .seqlen_k = 333, .heads_q = 8,
       .heads_kv = 2, .head_dim = 128, .segments = true});
  if (small) return cases;
  add({.name = "d=64 long keys seqlens + window fp16", .batch = 2, .seqlen_q = 700, .seqlen_k = 2500, .heads_q = 3,
       .heads_kv = 1, .head_dim = 64, .type = ElementType::kFloat16, .window_left = 900, .window_right = 40,
       .seqlens = true});
  add({.name = "causal + mask + bias + softcap d=128 blind", .batch = 3, .seqlen_q = 640, .seqlen_k = 700,
       .heads_q = 4, .heads_kv = 1, .head_dim = 128, .causal = true, .softcap = 8.0f, .input_scale = 2.0f,
       .bias = 2, .dense_mask = true, .mask_blocks = true, .blind_rows = 384});
  add({.name = "full bias + mask d=256 fp16 window", .batch = 2, .seqlen_q = 300, .seqlen_k = 520, .heads_q = 2,
       .heads_kv = 1, .head_dim = 256, .type = ElementType::kFloat16, .window_left = 200, .window_right = 100,
       .bias = 1, .dense_mask = true, .mask_blocks = true, .blind_rows = 128});
  add({.name = "mask blocks d=128 causal fp16", .batch = 3, .seqlen_q = 520, .seqlen_k = 700, .heads_q = 2,
       .heads_kv = 1, .head_dim = 128, .type = ElementType::kFloat16, .causal = true, .dense_mask = true,
       .mask_blocks = true});
  add({.name = "mask blocks d=256 deterministic", .batch = 2, .seqlen_q = 300, .seqlen_k = 600, .heads_q = 2,
       .heads_kv = 2, .head_dim = 256, .deterministic = true, .dense_mask = true, .mask_blocks = true});
  add({.name = "mask blocks d=32 + bias + dropout", .batch = 2, .seqlen_q = 1000, .seqlen_k = 17, .heads_q = 2,
       .heads_kv = 2, .head_dim = 32, .bias = 1, .dense_mask = true, .mask_blocks = true, .dropout_rate = 0.1f});
  add({.name = "mask blocks d=96 window", .batch = 2, .seqlen_q = 640, .seqlen_k = 1000, .heads_q = 3,
       .heads_kv = 1, .head_dim = 96, .window_left = 300, .window_right = 50, .dense_mask = true,
       .mask_blocks = true});
  add({.name = "d=128 bias + mask + dropout + softcap", .batch = 2, .seqlen_q = 300, .seqlen_k = 257, .heads_q = 4,
       .heads_kv = 1, .head_dim = 128, .softcap = 5.0f, .bias = 1, .dense_mask = true, .dropout_rate = 0.3f});
  add({.name = "d=128 broadcast bias deterministic", .batch = 3, .seqlen_q = 200, .seqlen_k = 190, .heads_q = 2,
       .heads_kv = 2, .head_dim = 128, .causal = true, .deterministic = true, .bias = 2, .dropout_rate = 0.1f});
  for (int64_t d : {32, 64, 96, 128, 192, 256}) {
    add({.name = "head dim sweep causal", .batch = 1, .seqlen_q = 300, .seqlen_k = 300, .heads_q = 2, .heads_kv = 1,
         .head_dim = d, .causal = true});
    add({.name = "head dim sweep fp16 deterministic", .batch = 1, .seqlen_q = 200, .seqlen_k = 333, .heads_q = 2,
         .heads_kv = 2, .head_dim = d, .type = ElementType::kFloat16, .deterministic = true});
  }
  add({.name = "seqlen 1000 GQA causal d=128", .batch = 1, .seqlen_q = 1000, .seqlen_k = 1000, .heads_q = 4,
       .heads_kv = 2, .head_dim = 128, .causal = true});
  add({.name = "seqlen 1000 non-causal d=64", .batch = 1, .seqlen_q = 1000, .seqlen_k = 1000, .heads_q = 2,
       .heads_kv = 2, .head_dim = 64});
  add({.name = "top-left causal, offset -5", .seqlen_q = 90, .seqlen_k = 60, .causal = true,
       .align_to_sequence_end = false, .diagonal_offset = -5});
  add({.name = "window only (left 16, right 0)", .seqlen_q = 257, .seqlen_k = 257, .window_left = 16,
       .window_right = 0});
  add({.name = "seqlens (padded rows)", .batch = 3, .seqlen_q = 129, .seqlen_k = 140, .heads_q = 2, .heads_kv = 2,
       .causal = true, .seqlens = true});
  add({.name = "segments", .batch = 2, .seqlen_q = 150, .seqlen_k = 150, .segments = true});
  add({.name = "softcap large logits", .seqlen_q = 128, .seqlen_k = 190, .softcap = 10.0f, .input_scale = 3.0f});
  add({.name = "alibi causal", .seqlen_q = 200, .seqlen_k = 200, .heads_q = 4, .heads_kv = 4, .causal = true,
       .alibi = true});
  add({.name = "MQA d=256 bf16 deterministic", .batch = 2, .seqlen_q = 111, .seqlen_k = 222, .heads_q = 4,
       .heads_kv = 1, .head_dim = 256, .deterministic = true});
  add({.name = "all masked rows (window far right)", .seqlen_q = 64, .seqlen_k = 64, .diagonal_offset = 1000,
       .window_left = 0, .window_right = 0});
  // Causal, bottom-right aligned, sq > sk: the first row blocks see nothing, and longest-first order runs those
  // empty tiles last (a persistent CTA ends on empty tiles).
  add({.name = "causal sq>sk d=128 (empty row blocks)", .batch = 2, .seqlen_q = 700, .seqlen_k = 200, .heads_q = 4,
       .heads_kv = 2, .head_dim = 128, .causal = true});
  return cases;
}

// The Hopper backward's grid: its three kernel forms (common: masks by position, lengths and segments; transforms:
// also softcap and/or ALiBi, with per-head slopes that change along a GQA group; masked: a boolean mask, whose
// block summary has hidden, partial and visible blocks, key padding, per-head masks along a GQA group, row blocks
// and whole batch rows that see nothing), head dims that run on its d=64, d=128 and d=256 kernels (padded ones
// included; d=256 common form only), GQA/MQA group loops, many query/key tiles so that the pipelines wrap,
// ragged tile edges, rows and key tiles that see nothing, deterministic reruns (the separate dQ pass; d=128
// and d=64 non-deterministic cases take the fused dQ), and calls it refuses (a bias; a mask at d=256: sm80).
std::vector<Case> sm90_backward_grid(bool small) {
  std::vector<Case> cases;
  auto add = [&](Case c) { cases.push_back(c); };
  add({.name = "sm90 bwd basic d=64"});
  add({.name = "sm90 bwd d=128 causal GQA", .batch = 2, .seqlen_q = 200, .seqlen_k = 200, .heads_q = 4,
       .heads_kv = 2, .head_dim = 128, .causal = true});
  add({.name = "sm90 bwd d=40 (padded) sq<sk", .seqlen_q = 77, .seqlen_k = 150, .head_dim = 40, .causal = true});
  add({.name = "sm90 bwd seqlens + segments + window fp16", .batch = 3, .seqlen_q = 130, .seqlen_k = 200,
       .heads_q = 4, .heads_kv = 1, .head_dim = 128, .type = ElementType::kFloat16, .window_left = 40,
       .window_right = 7, .seqlens = true, .segments = true, .deterministic = true});
  add({.name = "sm90 bwd all masked rows", .seqlen_q = 64, .seqlen_k = 64, .diagonal_offset = 1000,
       .window_left = 0, .window_right = 0});
  add({.name = "sm90 bwd seqlen 1", .seqlen_q = 1, .seqlen_k = 1, .head_dim = 128});
  add({.name = "sm90 bwd d=256 causal GQA odd seqlens", .batch = 2, .seqlen_q = 77, .seqlen_k = 150, .heads_q = 4,
       .heads_kv = 2, .head_dim = 256, .causal = true});
  add({.name = "sm90 bwd softcap + alibi d=128 causal GQA", .batch = 2, .seqlen_q = 150, .seqlen_k = 170,
       .heads_q = 4, .heads_kv = 2, .head_dim = 128, .causal = true, .softcap = 5.0f, .alibi = true});
  add({.name = "sm90 bwd softcap + alibi d=64 odd", .seqlen_q = 100, .seqlen_k = 77, .softcap = 5.0f,
       .alibi = true});
  add({.name = "sm90 bwd mask blocks d=128 GQA (fused dQ)", .batch = 3, .seqlen_q = 600, .seqlen_k = 520,
       .heads_q = 4, .heads_kv = 2, .head_dim = 128, .dense_mask = true, .mask_blocks = true, .blind_rows = 128});
  add({.name = "sm90 bwd key padding d=64 deterministic", .batch = 3, .seqlen_q = 300, .seqlen_k = 333,
       .heads_q = 4, .heads_kv = 2, .deterministic = true, .dense_mask = true, .key_padding = true});
  if (small) return cases;
  for (int64_t d : {8, 64, 96, 128, 192, 256}) {
    for (ElementType t : {ElementType::kBFloat16, ElementType::kFloat16}) {
      add({.name = "sm90 bwd head dim sweep causal", .batch = 1, .seqlen_q = 300, .seqlen_k = 300, .heads_q = 2,
           .heads_kv = 1, .head_dim = d, .type = t, .causal = true});
      add({.name = "sm90 bwd head dim sweep deterministic", .batch = 2, .seqlen_q = 200, .seqlen_k = 333,
           .heads_q = 2, .heads_kv = 2, .head_dim = d, .type = t, .deterministic = true});
    }
  }
  add({.name = "sm90 bwd seqlen 1000 MQA causal d=128", .batch = 1, .seqlen_q = 1000, .seqlen_k = 1000,
       .heads_q = 8, .heads_kv = 1, .head_dim = 128, .causal = true});
  add({.name = "sm90 bwd seqlen 1000 non-causal d=64", .batch = 2, .seqlen_q = 1000, .seqlen_k = 1000, .heads_q = 2,
       .heads_kv = 2, .head_dim = 64, .deterministic = true});
  add({.name = "sm90 bwd sq>sk causal (empty rows)", .batch = 2, .seqlen_q = 300, .seqlen_k = 90, .heads_q = 4,
       .heads_kv = 2, .head_dim = 128, .causal = true});
  add({.name = "sm90 bwd top-left causal, offset -5", .seqlen_q = 190, .seqlen_k = 160, .causal = true,
       .align_to_sequence_end = false, .diagonal_offset = -5});
  add({.name = "sm90 bwd window only (left 16, right 0)", .seqlen_q = 257, .seqlen_k = 257, .head_dim = 128,
       .window_left = 16, .window_right = 0});
  add({.name = "sm90 bwd seqlens (padded rows)", .batch = 3, .seqlen_q = 129, .seqlen_k = 140, .heads_q = 2,
       .heads_kv = 2, .head_dim = 128, .causal = true, .seqlens = true});
  add({.name = "sm90 bwd segments", .batch = 2, .seqlen_q = 150, .seqlen_k = 150, .segments = true});
  add({.name = "sm90 bwd large logits", .seqlen_q = 128, .seqlen_k = 190, .head_dim = 128, .input_scale = 3.0f});
  // d=256: the split-head-dim dK/dV kernel (64-key CTAs, double-buffered P^T/dS^T) and the 32-key-tile dQ kernel.
  add({.name = "sm90 bwd d=256 seqlen 1000 MQA causal", .batch = 1, .seqlen_q = 1000, .seqlen_k = 1000,
       .heads_q = 4, .heads_kv = 1, .head_dim = 256, .causal = true});
  add({.name = "sm90 bwd d=256 non-causal fp16 deterministic", .batch = 2, .seqlen_q = 333, .seqlen_k = 517,
       .heads_q = 2, .heads_kv = 2, .head_dim = 256, .type = ElementType::kFloat16, .deterministic = true});
  add({.name = "sm90 bwd d=256 sq>sk causal (empty rows)", .batch = 2, .seqlen_q = 300, .seqlen_k = 90,
       .heads_q = 4, .heads_kv = 2, .head_dim = 256, .causal = true});
  add({.name = "sm90 bwd d=256 seqlens + segments + window fp16", .batch = 3, .seqlen_q = 130, .seqlen_k = 200,
       .heads_q = 4, .heads_kv = 1, .head_dim = 256, .type = ElementType::kFloat16, .window_left = 40,
       .window_right = 7, .seqlens = true, .segments = true, .deterministic = true});
  add({.name = "sm90 bwd d=256 top-left causal, offset -5", .seqlen_q = 190, .seqlen_k = 160, .head_dim = 256,
       .causal = true, .align_to_sequence_end = false, .diagonal_offset = -5});
  add({.name = "sm90 bwd d=256 window only (left 16, right 0)", .seqlen_q = 257, .seqlen_k = 257, .head_dim = 256,
       .window_left = 16, .window_right = 0});
  add({.name = "sm90 bwd d=256 all masked rows", .seqlen_q = 64, .seqlen_k = 64, .head_dim = 256,
       .diagonal_offset = 1000, .window_left = 0, .window_right = 0});
  add({.name = "sm90 bwd d=200 (padded to 256) large logits", .seqlen_q = 128, .seqlen_k = 190, .head_dim = 200,
       .input_scale = 3.0f});
  add({.name = "sm90 bwd falls back: softcap d=256 (sm80)", .seqlen_q = 100, .seqlen_k = 100, .head_dim = 256,
       .softcap = 5.0f});
  // The transforms form (softcap and/or ALiBi).
  for (int64_t d : {64, 128}) {
    add({.name = "sm90 bwd softcap causal GQA odd", .batch = 2, .seqlen_q = 333, .seqlen_k = 271, .heads_q = 4,
         .heads_kv = 2, .head_dim = d, .causal = true, .softcap = 8.0f, .input_scale = 2.0f});
    add({.name = "sm90 bwd alibi causal GQA odd", .batch = 2, .seqlen_q = 271, .seqlen_k = 333, .heads_q = 6,
         .heads_kv = 2, .head_dim = d, .causal = true, .alibi = true});
    add({.name = "sm90 bwd softcap + alibi GQA deterministic", .batch = 2, .seqlen_q = 200, .seqlen_k = 333,
         .heads_q = 4, .heads_kv = 1, .head_dim = d, .softcap = 5.0f, .alibi = true, .deterministic = true});
  }
  add({.name = "sm90 bwd softcap + alibi + window + seqlens + segments fp16", .batch = 3, .seqlen_q = 130,
       .seqlen_k = 200, .heads_q = 4, .heads_kv = 1, .head_dim = 128, .type = ElementType::kFloat16,
       .window_left = 40, .window_right = 7, .softcap = 5.0f, .alibi = true, .seqlens = true, .segments = true});
  add({.name = "sm90 bwd softcap + alibi seqlens causal d=128 deterministic", .batch = 3, .seqlen_q = 129,
       .seqlen_k = 140, .heads_q = 4, .heads_kv = 2, .head_dim = 128, .causal = true, .softcap = 4.0f,
       .alibi = true, .seqlens = true, .deterministic = true});
  add({.name = "sm90 bwd softcap large logits d=128", .seqlen_q = 128, .seqlen_k = 190, .head_dim = 128,
       .softcap = 10.0f, .input_scale = 3.0f});
  add({.name = "sm90 bwd alibi top-left causal, offset -5, sq>sk", .batch = 2, .seqlen_q = 190, .seqlen_k = 160,
       .heads_q = 4, .heads_kv = 2, .head_dim = 128, .causal = true, .align_to_sequence_end = false,
       .diagonal_offset = -5, .alibi = true});
  add({.name = "sm90 bwd alibi seqlen 1000 MQA d=128", .batch = 1, .seqlen_q = 1000, .seqlen_k = 1000, .heads_q = 8,
       .heads_kv = 1, .head_dim = 128, .alibi = true});
  add({.name = "sm90 bwd softcap d=40 (padded) sq<sk fp16", .seqlen_q = 77, .seqlen_k = 150, .head_dim = 40,
       .type = ElementType::kFloat16, .causal = true, .softcap = 3.0f});
  add({.name = "sm90 bwd softcap + alibi all masked rows", .seqlen_q = 64, .seqlen_k = 64, .diagonal_offset = 1000,
       .window_left = 0, .window_right = 0, .softcap = 5.0f, .alibi = true});
  add({.name = "sm90 bwd falls back: bias (sm80)", .seqlen_q = 100, .seqlen_k = 100, .softcap = 5.0f, .alibi = true,
       .bias = 1});
  // The masked form (a boolean mask; d <= 128). Non-deterministic cases take the fused dQ (standalone runs always
  // pass a workspace), deterministic ones the separate dQ pass.
  for (int64_t d : {64, 128}) {
    for (ElementType t : {ElementType::kBFloat16, ElementType::kFloat16}) {
      add({.name = "sm90 bwd mask blocks GQA blind rows", .batch = 3, .seqlen_q = 600, .seqlen_k = 520,
           .heads_q = 4, .heads_kv = 2, .head_dim = d, .type = t, .dense_mask = true, .mask_blocks = true,
           .blind_rows = 128});
      add({.name = "sm90 bwd mask blocks GQA deterministic", .batch = 3, .seqlen_q = 520, .seqlen_k = 600,
           .heads_q = 4, .heads_kv = 2, .head_dim = d, .type = t, .deterministic = true, .dense_mask = true,
           .mask_blocks = true, .blind_rows = 64});
      add({.name = "sm90 bwd key padding (a batch row sees nothing)", .batch = 3, .seqlen_q = 300, .seqlen_k = 333,
           .heads_q = 2, .heads_kv = 1, .head_dim = d, .type = t, .dense_mask = true, .key_padding = true});
    }
    add({.name = "sm90 bwd per-head mask blocks GQA", .batch = 2, .seqlen_q = 400, .seqlen_k = 400, .heads_q = 6,
         .heads_kv = 2, .head_dim = d, .dense_mask = true, .mask_blocks = true, .mask_per_head = true});
    add({.name = "sm90 bwd per-head mask blocks GQA deterministic", .batch = 2, .seqlen_q = 333, .seqlen_k = 271,
         .heads_q = 4, .heads_kv = 1, .head_dim = d, .type = ElementType::kFloat16, .deterministic = true,
         .dense_mask = true, .mask_blocks = true, .mask_per_head = true});
    add({.name = "sm90 bwd random mask causal", .batch = 2, .seqlen_q = 333, .seqlen_k = 300, .heads_q = 2,
         .heads_kv = 2, .head_dim = d, .causal = true, .dense_mask = true});
    add({.name = "sm90 bwd mask + softcap + alibi GQA", .batch = 2, .seqlen_q = 300, .seqlen_k = 333, .heads_q = 4,
         .heads_kv = 2, .head_dim = d, .softcap = 5.0f, .alibi = true, .dense_mask = true, .mask_blocks = true});
    add({.name = "sm90 bwd mask blocks whole batch row blind", .batch = 2, .seqlen_q = 260, .seqlen_k = 300,
         .heads_q = 2, .heads_kv = 2, .head_dim = d, .deterministic = true, .dense_mask = true,
         .mask_blocks = true, .blind_rows = 260});
  }
  add({.name = "sm90 bwd mask + seqlens + segments + window fp16", .batch = 3, .seqlen_q = 130, .seqlen_k = 200,
       .heads_q = 4, .heads_kv = 1, .head_dim = 64, .type = ElementType::kFloat16, .window_left = 40,
       .window_right = 7, .seqlens = true, .segments = true, .dense_mask = true, .mask_blocks = true});
  add({.name = "sm90 bwd mask causal seqlens d=128 deterministic", .batch = 3, .seqlen_q = 129, .seqlen_k = 140,
       .heads_q = 4, .heads_kv = 2, .head_dim = 128, .causal = true, .seqlens = true, .deterministic = true,
       .dense_mask = true, .mask_blocks = true});
  add({.name = "sm90 bwd key padding seqlen 1000 MQA d=128", .batch = 3, .seqlen_q = 1000, .seqlen_k = 1000,
       .heads_q = 8, .heads_kv = 1, .head_dim = 128, .dense_mask = true, .key_padding = true});
  add({.name = "sm90 bwd mask d=40 (padded) sq<sk", .seqlen_q = 77, .seqlen_k = 150, .head_dim = 40,
       .dense_mask = true});
  add({.name = "sm90 bwd mask seqlen 1", .seqlen_q = 1, .seqlen_k = 1, .head_dim = 128, .dense_mask = true});
  add({.name = "sm90 bwd falls back: mask d=256 (sm80)", .seqlen_q = 100, .seqlen_k = 130, .head_dim = 256,
       .dense_mask = true, .mask_blocks = true});
  return cases;
}

// Whether the Hopper backward takes this case (dispatch.cu sm90_backward_refusal, minus the device checks; the
// grid's ALiBi distances are far below its 2^30 bound).
bool sm90_backward_applies(const Case& c) {
  const bool per_element = c.softcap > 0.0f || c.alibi || c.dense_mask;  // the transforms and masked forms: d <= 128
  return c.bias == 0 && c.dropout_rate == 0.0f && c.head_dim % 8 == 0 && c.head_dim <= (per_element ? 128 : 256) &&
         c.seqlen_q > 0 && c.seqlen_k > 0;
}

// The benchmarks' problem: batch B of S queries and S keys, H heads of D (no GQA), bf16, scale 1/sqrt(D); the
// caller sets the buffers.
template <class Params>
Params square_bf16_problem(int64_t B, int64_t S, int64_t H, int64_t D, bool causal) {
  Params p{};
  p.batch = B;
  p.inner_batch = B;  // no vmap axes: the mask's batch stride applies (left at 1, batch row b read slice b * outer,
                      // past the mask and its summary)
  p.seqlen_q = p.seqlen_k = S;
  p.heads_q = p.heads_kv = H;
  p.head_dim = D;
  p.element_type = ElementType::kBFloat16;
  p.softmax_scale = 1.0f / std::sqrt(float(D));
  p.causal = causal;
  return p;
}

// The padding-mask forward timed with JAX_FLASH_SM90_DENSE=0 (sm80) and =1 (the default: the sm90 forward takes
// the mask); O and lse of both runs are compared.
template <class TimeMs>
void bench_dense_forward(const AttentionParams& p, double flops, TimeMs&& time_ms) {
  const size_t n = p.batch * p.seqlen_q * p.heads_q * p.head_dim, nstat = p.batch * p.heads_q * p.seqlen_q;
  const ScopedEnv dense_switch("JAX_FLASH_SM90_DENSE", "0");
  std::vector<uint16_t> o[2];
  std::vector<float> lse[2];
  std::string err;
  float ms[2] = {0.0f, 0.0f};
  for (int dense = 0; dense < 2 && err.empty(); ++dense) {
    dense_switch.set(dense ? "1" : "0");
    CHECK_CUDA(cudaMemset(p.o, 0xFF, n * sizeof(uint16_t)));
    err = jax_flash::cuda::run_forward(p, nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
    o[dense] = to_host(static_cast<const uint16_t*>(p.o), n);
    lse[dense] = to_host(p.lse, nstat);
    if (err.empty()) ms[dense] = time_ms([&] { return jax_flash::cuda::run_forward(p, nullptr); });
  }
  if (!err.empty()) {
    std::printf("bench padding-mask fwd, JAX_FLASH_SM90_DENSE=1: run_forward: %s\n", err.c_str());
    return;
  }
  // Different kernels (sm80 vs sm90): close, not bit-identical. Largest |difference| of O and of the finite lse.
  double o_diff = 0, lse_diff = 0;
  for (size_t i = 0; i < n; ++i) {
    const float diff = from_bits(o[0][i], p.element_type) - from_bits(o[1][i], p.element_type);
    o_diff = std::max(o_diff, double(std::fabs(diff)));
  }
  for (size_t i = 0; i < nstat; ++i) lse_diff = std::max(lse_diff, double(std::fabs(lse[0][i] - lse[1][i])));
  std::printf("bench d=%lld seqlen=4096 b=4 h=16 padding_mask=1 fwd: JAX_FLASH_SM90_DENSE=0 %.3f ms %.1f TFLOP/s, "
              "JAX_FLASH_SM90_DENSE=1 %.3f ms %.1f TFLOP/s (x%.2f); max |dO| %.2e, max |dlse| %.2e\n",
              (long long)p.head_dim, ms[0], flops / ms[0] * 1e-9, ms[1], flops / ms[1] * 1e-9, ms[0] / ms[1], o_diff,
              lse_diff);
}

// fwd/bwd TFLOP/s at head dim D, seqlen 4096, 16 heads, batch 4 (16k tokens), bf16: causal or not, non-causal with
// benchmarks/bench_attention.py's key-padding mask (batch row b keeps its first S * (1 - b / 2B) keys; the FLOPs
// are counted as without it), non-causal with softcap 50 (bench_attention.py's) and causal with ALiBi (the Hopper
// backward's transforms form, up to d=128).
void bench(int64_t D) {
  for (int row = 0; row < 5; ++row) {
    const bool causal = row == 1 || row == 4, padding_mask = row == 2, softcap = row == 3, alibi = row == 4;
    const int64_t B = 4, S = 4096, H = 16;
    const size_t n = B * S * H * D;
    AttentionBackwardParams p = square_bf16_problem<AttentionBackwardParams>(B, S, H, D, causal);
    std::mt19937 rng(1);
    HostTensor x = random_tensor(n, p.element_type, 1.0f, rng);
    p.q = to_device(x.bits);
    p.k = to_device(x.bits);
    p.v = to_device(x.bits);
    p.d_o = to_device(x.bits);
    p.o = poisoned<uint16_t>(n);
    p.dq = poisoned<uint16_t>(n);
    p.dk = poisoned<uint16_t>(n);
    p.dv = poisoned<uint16_t>(n);
    p.lse = poisoned<float>(B * H * S);
    p.d_lse = to_device(std::vector<float>(B * H * S, 0.0f));
    p.softmax_d = poisoned<float>(B * H * S);
    p.dq_accum = poisoned<float>(jax_flash::dq_workspace_elements(B, S, H, D));
    p.dkdv_tail_floats = jax_flash::dkdv_tail_elements(B, S, H);
    p.dkdv_tail = poisoned<float>(p.dkdv_tail_floats);
    std::vector<uint8_t> mask;
    for (int64_t b = 0; padding_mask && b < B; ++b) {
      for (int64_t j = 0; j < S; ++j) mask.push_back(j < S - S * b / (2 * B));
    }
    if (softcap) p.softcap = 50.0f;
    if (alibi) p.alibi_slopes = to_device(std::vector<float>(B * H, 0.0625f));
    if (padding_mask) {
      p.mask = reinterpret_cast<const bool*>(to_device(mask));
      p.mask_strides = {B * S, S, 0, 0, 1};
      p.mask_blocks = to_device(mask_block_summary(mask, B, 1, S));
      p.mask_blocks_strides = summary_strides(B, 1, S);
    }
    const double flops = 4.0 * B * H * S * S * D * (causal ? 0.5 : 1.0);
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    // fn returns run_*'s error string: a call that fails (e.g. a family forced onto a call it cannot run) is not
    // timed (NaN), instead of timing an immediate return.
    auto time_ms = [&](auto fn) -> float {
      if (std::string err = fn(); !err.empty()) {
        std::printf("    not timed: %s\n", err.c_str());
        return NAN;
      }
      for (int i = 0; i < 2; ++i) fn();
      CHECK_CUDA(cudaEventRecord(start));
      const int reps = 20;
      for (int i = 0; i < reps; ++i) fn();
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      return ms / reps;
    };
    const float fwd = time_ms([&] { return jax_flash::cuda::run_forward(p, nullptr); });
    // The backward with the dq_accum workspace (the default: both families fuse dQ into their dK/dV pass; sm80's
    // general variant, the padding-mask row, ignores it), without it (a dQ pass of its own), and deterministic.
    const float bwd_fused = time_ms([&] { return jax_flash::cuda::run_backward(p, nullptr); });
    float* dq_accum = p.dq_accum;
    float* dkdv_tail = p.dkdv_tail;
    p.dq_accum = nullptr;
    p.dkdv_tail = nullptr;
    const float bwd = time_ms([&] { return jax_flash::cuda::run_backward(p, nullptr); });
    p.deterministic = true;
    const float bwd_deterministic = time_ms([&] { return jax_flash::cuda::run_backward(p, nullptr); });
    p.deterministic = false;
    p.dq_accum = dq_accum;
    p.dkdv_tail = dkdv_tail;
    CHECK_CUDA(cudaGetLastError());
    if (padding_mask) bench_dense_forward(p, flops, time_ms);
    const double bwd_flops = 2.5 * flops * 1e-9;
    std::printf("bench d=%lld seqlen=4096 b=4 h=16 causal=%d padding_mask=%d softcap=%d alibi=%d: fwd %.3f ms %.1f "
                "TFLOP/s, bwd %.3f ms %.1f TFLOP/s, bwd with dq_accum %.3f ms %.1f TFLOP/s, bwd deterministic %.3f ms "
                "%.1f TFLOP/s\n",
                (long long)D, causal, padding_mask, softcap, alibi, fwd, flops / fwd * 1e-9, bwd, bwd_flops / bwd,
                bwd_fused,
                bwd_flops / bwd_fused, bwd_deterministic, bwd_flops / bwd_deterministic);
  }
}

// Forward only, bf16, 16k tokens per call, 16 heads: one CTA per tile against the persistent grid
// (JAX_FLASH_SM90_PERSISTENT=0 / 1, forced per call whatever the automatic choice would be;
// JAX_FLASH_SM90_PERSISTENT_CTAS is left as the caller set it).
// Both modes run the same tile code in the same order, so O and lse must be bit-identical.
bool bench_forward_persistent() {
  const ScopedEnv mode_switch("JAX_FLASH_SM90_PERSISTENT", "0");
  bool all_identical = true;
  const int64_t kTokens = 16384, H = 16;
  for (int64_t D : {64, 128, 256}) {
    // Every call below has kTokens * H rows of D elements: one random tensor serves as q, k and v of all of them.
    const size_t n = kTokens * H * D, nstat = kTokens * H;
    std::mt19937 rng(2);
    uint16_t* qkv = to_device(random_tensor(n, ElementType::kBFloat16, 1.0f, rng).bits);
    uint16_t* out = poisoned<uint16_t>(n);
    float* out_lse = poisoned<float>(nstat);
    for (int64_t S : {512, 1024, 2048, 8192}) {
      for (bool causal : {true, false}) {
        const int64_t B = kTokens / S;
        AttentionParams p = square_bf16_problem<AttentionParams>(B, S, H, D, causal);
        p.q = p.k = p.v = qkv;
        p.o = out;
        p.lse = out_lse;
        const double flops = 4.0 * B * H * S * S * D * (causal ? 0.5 : 1.0);
        float ms[2] = {0, 0};
        std::vector<uint16_t> o[2];
        std::vector<float> lse[2];
        std::string err;
        for (int mode = 0; mode < 2; ++mode) {
          mode_switch.set(mode ? "1" : "0");
          CHECK_CUDA(cudaMemset(p.o, 0xFF, n * sizeof(uint16_t)));
          CHECK_CUDA(cudaMemset(p.lse, 0xFF, nstat * sizeof(float)));
          err = jax_flash::cuda::run_forward(p, nullptr);
          if (!err.empty()) break;
          o[mode] = to_host(static_cast<const uint16_t*>(p.o), n);
          lse[mode] = to_host(p.lse, nstat);
          cudaEvent_t start, stop;
          CHECK_CUDA(cudaEventCreate(&start));
          CHECK_CUDA(cudaEventCreate(&stop));
          for (int i = 0; i < 3; ++i) jax_flash::cuda::run_forward(p, nullptr);
          const int reps = 20;
          CHECK_CUDA(cudaEventRecord(start));
          for (int i = 0; i < reps; ++i) jax_flash::cuda::run_forward(p, nullptr);
          CHECK_CUDA(cudaEventRecord(stop));
          CHECK_CUDA(cudaEventSynchronize(stop));
          CHECK_CUDA(cudaEventElapsedTime(&ms[mode], start, stop));
          ms[mode] /= reps;
          CHECK_CUDA(cudaEventDestroy(start));
          CHECK_CUDA(cudaEventDestroy(stop));
        }
        CHECK_CUDA(cudaGetLastError());
        if (!err.empty()) {
          std::printf("bench fwd d=%lld seqlen=%lld: run_forward: %s  FAIL\n", (long long)D, (long long)S, err.c_str());
          all_identical = false;
        } else {
          const bool identical = o[0] == o[1] && std::memcmp(lse[0].data(), lse[1].data(), nstat * sizeof(float)) == 0;
          all_identical &= identical;
          std::printf("bench fwd d=%lld seqlen=%lld b=%lld h=16 causal=%d: per-tile grid %.3f ms %.1f TFLOP/s, "
                      "persistent %.3f ms %.1f TFLOP/s (x%.3f), outputs bit-identical: %s\n",
                      (long long)D, (long long)S, (long long)B, causal, ms[0], flops / ms[0] * 1e-9, ms[1],
                      flops / ms[1] * 1e-9, ms[0] / ms[1], identical ? "yes" : "NO  FAIL");
        }
      }
    }
    CHECK_CUDA(cudaFree(qkv));
    CHECK_CUDA(cudaFree(out));
    CHECK_CUDA(cudaFree(out_lse));
  }
  std::printf("persistent forward bench: %s\n", all_identical ? "all outputs bit-identical" : "FAIL");
  return all_identical;
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false, bench_only = false, bench_persistent = false, sm90_backward = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    small |= arg == "--small";
    bench_only |= arg == "--bench";
    bench_persistent |= arg == "--bench-persistent";
    sm90_backward |= arg == "--sm90-backward";
  }
  if (bench_persistent) return bench_forward_persistent() ? 0 : 1;
  if (bench_only) {
    const char* backward = std::getenv("JAX_FLASH_CUDA_KERNEL_BACKWARD");
    std::printf("backward family: JAX_FLASH_CUDA_KERNEL_BACKWARD=%s\n", backward ? backward : "(unset: auto)");
    // JAX_FLASH_BENCH_HEAD_DIMS: the head dims to time, e.g. "64 128" (default "128 256").
    const char* head_dims = std::getenv("JAX_FLASH_BENCH_HEAD_DIMS");
    std::string list = head_dims && *head_dims ? head_dims : "128 256";
    for (char& ch : list) ch = ch == ',' ? ' ' : ch;
    for (size_t at = 0; at < list.size();) {
      const size_t end = std::min(list.find(' ', at), list.size());
      if (end > at) bench(std::stoll(list.substr(at, end - at)));
      at = end + 1;
    }
    return 0;
  }
  std::mt19937 rng(12345);
  int failures = 0, not_built = 0, total = 0;
  for (const Case& c : sm90_backward ? sm90_backward_grid(small) : case_grid(small)) {
    ++total;
    if (sm90_backward) {
      const char* family = sm90_backward_applies(c) ? "sm90" : "sm80";
      setenv("JAX_FLASH_CUDA_KERNEL_BACKWARD", family, 1);
      std::printf("[backward: %s] ", family);
    }
    const Outcome outcome = run_case(c, rng);
    failures += outcome == Outcome::kFailed;
    not_built += outcome == Outcome::kNotBuilt;
  }
  std::printf("%d of %d cases passed", total - failures - not_built, total - not_built);
  if (not_built > 0) std::printf(" (%d more skipped: not in this build)", not_built);
  std::printf("\n");
  return failures == 0 ? 0 : 1;
}
