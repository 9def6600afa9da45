// Host launcher of the Hopper forward kernel for one (head dim, element type); instantiated once per generated
// .cu (sm_90a only). Picks the kernel form the call needs (forward_variant.h) and builds the three TMA descriptors
// for this call's pointers and shapes.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>

#include "../../common/attention_params.h"
#include "../common/block_range.h"
#include "../sm80/launch_common.h"
#include "forward_dispatch.h"
#include "forward_kernel.h"
#include "forward_variant.h"
#include "kernel_traits.h"
#include "tf32_v_transpose.h"
#include "tma_shapes.h"

namespace jax_flash::cuda::sm90 {

// A contiguous BSHD array as the TMA descriptors see it: shape (seqlen, head_dim, heads, batch), from tma_shapes.h
// (query_tma_shape / key_tma_shape, the shapes the kernels slice the descriptors' tensors with).
template <class Traits, class Shape4>
auto bshd_tensor(const void* data, const Shape4& shape) {
  using namespace cute;
  using T = typename Traits::Element;
  const int64_t seqlen = get<0>(shape), head_dim = get<1>(shape), heads = get<2>(shape);
  const auto stride = make_stride(heads * head_dim, _1{}, head_dim, seqlen * heads * head_dim);
  return make_tensor(make_gmem_ptr(static_cast<const T*>(data)), make_layout(shape, stride));
}

// The TMA descriptors of Q's tile and K's stages over a BSHD array shaped like q / k at `data` (q and k themselves,
// or split TF32's parts of them).
template <class Traits>
auto make_tma_q(const AttentionParams& p, const void* data) {
  using namespace cute;
  return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor<Traits>(data, query_tma_shape(p)), typename Traits::SmemLayoutQ{},
                       Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, _1{});
}
template <class Traits>
auto make_tma_k(const AttentionParams& p, const void* data) {
  using namespace cute;
  return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor<Traits>(data, key_tma_shape(p)),
                       take<0, 2>(typename Traits::SmemLayoutKV{}), Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{},
                       _1{});
}

// The TMA descriptor of V's stages: V itself, or for TF32 the V^T workspace at `tf32_vt` as (head_dim, keys,
// heads_kv, batch).
template <class Traits>
auto make_tma_v(const AttentionParams& p, const float* tf32_vt) {
  using namespace cute;
  using T = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  if constexpr (Traits::kTf32) {
    const int64_t keys = tf32_vt_keys(p.seqlen_k);
    const auto shape = make_shape(int32_t(kHeadDim), int32_t(keys), int32_t(p.heads_kv), int32_t(p.batch));
    const auto stride = make_stride(keys, _1{}, kHeadDim * keys, p.heads_kv * kHeadDim * keys);
    return make_tma_copy(SM90_TMA_LOAD{},
                         make_tensor(make_gmem_ptr(reinterpret_cast<const T*>(tf32_vt)), make_layout(shape, stride)),
                         take<0, 2>(typename Traits::SmemLayoutVt{}), Shape<Int<kHeadDim>, Int<Traits::kBlockN>>{},
                         _1{});
  } else {
    return make_tma_k<Traits>(p, p.v);
  }
}

// The TMA store descriptor of O where the tile writes O that way (Traits::kTmaStoreO); otherwise an unused default.
template <class Traits>
typename Traits::TmaO make_tma_o(const AttentionParams& p) {
  using namespace cute;
  if constexpr (Traits::kTmaStoreO) {
    return make_tma_copy(SM90_TMA_STORE{}, bshd_tensor<Traits>(p.o, query_tma_shape(p)),
                         typename Traits::SmemLayoutORows{}, Shape<_64, Int<Traits::kHeadDim>>{}, _1{});
  } else {
    return {};
  }
}

// The persistent grid is the default for key sequences up to this length. Measured on the H200 (standalone
// --bench-persistent, d = 64/128/256, causal and not, 16k tokens: benchmarks/results/
// sm90_persistent_forward_bench_h200.log), it ran 1.01-1.21x as fast as one CTA per tile at seqlen 512-2048 (most
// at 512-1024, where tiles are short and a CTA's next tile loads under the current tile's tail) but only
// 0.94-1.02x at 8k.
constexpr int64_t kPersistentMaxSeqlenK = 2048;
// The common form's 16-bit d=128 calls (its standard tile) stay persistent up to 4096 keys. On the H100 (jax
// 0.11.2, bench_env_ab.py three rounds, results/env_ab_NVIDIA_H100_80GB_HBM3_2026-12-06_persist128_s49.json) the
// persistent grid ran 4k 2.3% (non-causal) and 1.4% (causal) faster than one CTA per tile; Nsight Compute kernel
// times 831 against 856 us and 466 against 484 us (NOTES, forty-ninth session). At 8192 keys (the wide-keys tile)
// causal ran 7.3% slower, so that stays per tile.
constexpr int64_t kPersistentMaxSeqlenKD128 = 4096;

// The key length up to which a kernel form with this head dim and element type is persistent by default.
template <int kHeadDim, class Element, ForwardVariant kVariant>
constexpr int64_t persistent_max_seqlen_k() {
  const bool measured = kHeadDim == 128 && sizeof(Element) == 2 && kVariant == ForwardVariant::kCommon;
  return measured ? kPersistentMaxSeqlenKD128 : kPersistentMaxSeqlenK;
}

// A switch read at every call: unset, "" or "auto" sets *on to `automatic`, "1" to true, "0" to false; anything
// else is an error naming the variable.
inline std::string on_off_auto_switch(const char* variable, bool automatic, bool* on) {
  const char* env = std::getenv(variable);
  const std::string value = env ? env : "";
  if (value == "" || value == "auto") {
    *on = automatic;
  } else if (value == "0" || value == "1") {
    *on = value == "1";
  } else {
    return std::string(variable) + " must be 0, 1 or auto, not '" + value + "'";
  }
  return {};
}

// A cap on a persistent grid (read at every call): unset or "" sets *max_ctas to 0 (no cap), N >= 1 to N; anything
// else is an error naming the variable.
inline std::string cta_cap_switch(const char* variable, int64_t* max_ctas) {
  *max_ctas = 0;
  const char* cap = std::getenv(variable);
  if (cap != nullptr && *cap != '\0') {
    char* end = nullptr;
    const long long n = std::strtoll(cap, &end, 10);
    if (*end != '\0' || n < 1) return std::string(variable) + " must be a positive integer, not '" + cap + "'";
    *max_ctas = n;
  }
  return {};
}

// JAX_FLASH_SM90_PERSISTENT (read at every call): unset, "" or "auto" launches a persistent grid (forward_kernel.h:
// each CTA loops over tiles blockIdx.x, + gridDim.x, ...) when seqlen_k <= automatic_max_seqlen_k (the tile's
// limit: persistent_max_seqlen_k, or kThreePerSmPersistentMaxSeqlenK) and one CTA per tile otherwise; "1" forces the
// persistent grid, "0" one CTA per tile. *max_ctas > 0 caps the persistent grid: JAX_FLASH_SM90_PERSISTENT_CTAS=N,
// for tests, makes small problems loop over many tiles too.
inline std::string persistent_switch(int64_t seqlen_k, bool* persistent, int64_t* max_ctas,
                                     int64_t automatic_max_seqlen_k = kPersistentMaxSeqlenK) {
  if (std::string err = on_off_auto_switch("JAX_FLASH_SM90_PERSISTENT", seqlen_k <= automatic_max_seqlen_k, persistent);
      !err.empty()) {
    return err;
  }
  return cta_cap_switch("JAX_FLASH_SM90_PERSISTENT_CTAS", max_ctas);
}

// The causal order's band (forward_kernel.h split_tile): the slices whose K/V together take about this many bytes,
// so that a slice's row blocks, run within its band, find its K/V in L2 (50 MB on the H100/H200) rather than each
// reading it from DRAM again. Measured on the H200 (benchmarks/bench_env_ab.py, bf16, d = 64 / 128 / 256, 512-16k
// keys; benchmarks/results/env_ab_NVIDIA_H200_2026-12-02_bands.json): on the persistent grid (<= 2048 keys) 4 MiB
// bands ran d=128 3-14% and d=256 7-19% faster than no bands (d=64 unchanged), while 8 and 16 MiB ran slower there
// (their bands mix long and short tiles in every pass of the static schedule); on the per-tile grid (4k-16k keys,
// the hardware schedules the CTAs) 16 MiB ran d=128 5-8% and d=256 2-5% faster at 4k-8k (16k: -1% to +5%, two
// runs), and 4 MiB mostly slower (to -8%).
constexpr int64_t kPersistentCausalBandBytes = int64_t(4) << 20;
constexpr int64_t kPerTileCausalBandBytes = int64_t(16) << 20;

// A band-size switch (read at every call): unset, "" or "auto" leaves *bytes at its default; N sets N MiB (0: no
// bands, as the caller reads it); anything else is an error naming the variable.
inline std::string band_mib_switch(const char* variable, int64_t* bytes) {
  const char* env = std::getenv(variable);
  const std::string value = env ? env : "";
  if (value == "" || value == "auto") return {};
  char* end = nullptr;
  const long long mib = std::strtoll(value.c_str(), &end, 10);
  if (*end != '\0' || mib < 0 || mib > (int64_t(1) << 20)) {
    return std::string(variable) + " must be auto or a whole number of MiB (0: no bands), not '" + value + "'";
  }
  *bytes = int64_t(mib) << 20;
  return {};
}

// JAX_FLASH_SM90_CAUSAL_BAND_MIB (band_mib_switch): "auto" sizes the bands as above; "0" makes one band of every
// slice (the longest-first order over all slices, as before the bands); N > 0 sizes them at N MiB.
// Slices of one KV head (GQA) count its K/V once.
inline std::string causal_band(const AttentionParams& p, bool persistent, int64_t element_bytes, uint32_t slices,
                               uint32_t* band) {
  int64_t budget = persistent ? kPersistentCausalBandBytes : kPerTileCausalBandBytes;
  if (std::string err = band_mib_switch("JAX_FLASH_SM90_CAUSAL_BAND_MIB", &budget); !err.empty()) return err;
  const int64_t kv_bytes_per_slice = 2 * p.seqlen_k * p.head_dim * element_bytes / (p.heads_q / p.heads_kv);
  *band = budget == 0 ? slices
                      : static_cast<uint32_t>(std::clamp<int64_t>(budget / std::max<int64_t>(1, kv_bytes_per_slice),
                                                                  1, slices));
  return {};
}

// The two-CTAs-per-SM tile (kernel_traits.h RowTile::kTwoPerSm, d=64) pays where a tile's serial parts are a large
// share of it: short key sequences, and causal calls, whose diagonal tiles are mostly serial. On the H200 (bf16,
// 16k tokens, 32 heads; bench_env_ab.py, results/env_ab_*_twopersm_s22.json) it ran 5-9% faster at 512-2048 keys
// both ways and 3% at 4096 causal; 5% slower at 4096 non-causal, 13-16% at 8k-16k, 3-4% at 8k-16k causal, where
// most tiles are long and two 64-row CTAs read each K/V tile that one 128-row CTA's two consumers share.
constexpr int64_t kTwoPerSmMaxSeqlenK = 2048;
constexpr int64_t kTwoPerSmMaxSeqlenKCausal = 4096;

// JAX_FLASH_SM90_TWO_PER_SM (read at every call) picks that tile where the head dim has one and the call has more
// than 64 query rows: unset, "" or "auto" by the key lengths above, "1" always, "0" never.
inline std::string two_per_sm_switch(const AttentionParams& p, bool* two_per_sm) {
  return on_off_auto_switch("JAX_FLASH_SM90_TWO_PER_SM",
                            p.seqlen_k <= (p.causal ? kTwoPerSmMaxSeqlenKCausal : kTwoPerSmMaxSeqlenK), two_per_sm);
}

// Where the two-per-SM tile runs, the three-per-SM one (RowTile::kThreePerSm: 64-key stages) shortens a tile's
// serial chain further, but each 64-row CTA reads K/V in twice as many steps. On the H200 (bf16, 16k tokens, 32
// heads; bench_env_ab.py), against two per SM: in the twenty-sixth session (results/env_ab_NVIDIA_H200_2026-12-03_
// threepersm_s26.json) causal 512 keys +10.7%, 1k +3.5%, 2k -3.4%, 4k -3.3%; non-causal 1k -7%, 2k -13%, 4k -0.5%.
// Since the lazy scorer and the TMA store of O (which shortened its tiles most; results/env_ab_NVIDIA_H200_2026-12-
// 04_three_s32.json and _three2_s32.json, two calls of three rounds) causal 2k +1.6% / +5.0%, 4k +3.8% / +10.8%, so
// it takes the causal calls the two-per-SM tile does.
constexpr int64_t kThreePerSmMaxSeqlenKCausal = kTwoPerSmMaxSeqlenKCausal;
// Three 64-row CTAs per SM keep the SMs busy with short tiles on their own, and at 2048 causal keys the per-tile
// grid ran it 4.4% faster than the persistent one (results/env_ab_NVIDIA_H200_2026-12-04_persist3_s32.json, three
// rounds; 1024 not measured: it stays persistent, where the twenty-sixth session measured this tile's gain there).
constexpr int64_t kThreePerSmPersistentMaxSeqlenK = 1024;

// The three-per-SM tile's wide-keys form (RowTile::kThreePerSmWideKeys: two 96-key stages where it had three of 64)
// spreads each key tile's fixed costs (waits, row reductions, the O rescale) over half as many keys again, and pays
// once a row block walks enough key tiles. Kernel time on one H100 (Nsight Compute, B A B against the 64-key form;
// results/checks_h100_2026-12-07_session52.log): d=64 causal 1k 234.7 / 222.7 / 230.3 us, 2k 358.5 / 360.0 / 355.9,
// 4k 616.2 / 631.1 / 615.5 (cuDNN 629-631 there).
constexpr int64_t kThreePerSmWideKeysMinSeqlenK = 1025;

// JAX_FLASH_SM90_THREE_PER_SM (read at every call), among the calls that take the two-per-SM tile: unset, "" or
// "auto" causal calls up to the key length above, "1" always, "0" never.
inline std::string three_per_sm_switch(const AttentionParams& p, bool* three_per_sm) {
  return on_off_auto_switch("JAX_FLASH_SM90_THREE_PER_SM", p.causal && p.seqlen_k <= kThreePerSmMaxSeqlenKCausal,
                            three_per_sm);
}

// The wide-keys tiles (kernel_traits.h RowTile::kWideKeys: 176/112/80 keys per stage at d=128/192/256 against 128)
// halve the softmax rescales and WGMMA issues per key but hold two K/V stages, so they pay once a row tile walks
// many key tiles. On the H200 (bf16, 16k tokens, 2048 = heads * head_dim; bench_env_ab.py,
// results/env_ab_NVIDIA_H200_2026-12-04_widekeys_s29.json), wide against standard: d=128 non-causal 1k..16k 0.90,
// 0.94, 0.97, 1.01, 1.03, causal 0.87, 0.94, 0.98, 0.99, 1.04; d=192 non-causal 0.97, 1.04, 1.10, 1.07, 1.14, causal
// 0.98, 1.03, 1.07, 1.09, 1.08; d=256 non-causal 1.00, 1.04, 1.04, 1.03, 1.07, causal 0.98, 1.00, 1.03, 1.05, 1.01;
// d=64 (192-key stages) 0.89-1.01, mostly below: never by default there. At d=128 8k the thirty-third session's
// same-process A/Bs (env_ab_NVIDIA_H200_2026-12-04_widekeys128_s33*.json, three rounds each) had wide against auto
// (then standard) non-causal 1.085, 1.045, 1.025 and causal 1.015, so d=128 takes it from 8192 keys.
constexpr bool wide_keys_by_default(int head_dim, int64_t seqlen_k) {
  if (head_dim == 128) return seqlen_k >= 8192;
  return (head_dim == 192 || head_dim == 256) && seqlen_k >= 2048;
}

// JAX_FLASH_SM90_WIDE_KEYS (read at every call) picks the wide-keys tiles (and at d=64 kTwoPerSmWideKeys where the
// two-per-SM tile runs) for common-form calls of a head dim that has them and more than 64 query rows: unset, "" or
// "auto" from the key lengths above, "1" always (at d=64 also in place of the long-rows tile), "0" never. Where the
// three-per-SM tile runs (`three_per_sm`), the same switch picks its wide-keys form, by default from
// kThreePerSmWideKeysMinSeqlenK keys. Each dispatch path reads it once, where it picks a tile or its wide form.
// kernel_head_dim is the tile's (a narrowed build runs d=96 calls on the d=128 kernels).
inline std::string wide_keys_switch(int kernel_head_dim, const AttentionParams& p, bool* wide_keys,
                                    bool three_per_sm = false) {
  const bool by_default = three_per_sm ? p.seqlen_k >= kThreePerSmWideKeysMinSeqlenK
                                       : wide_keys_by_default(kernel_head_dim, p.seqlen_k);
  return on_off_auto_switch("JAX_FLASH_SM90_WIDE_KEYS", by_default, wide_keys);
}

// The lazy rescale (forward_kernel.h lazy_rescale, online_softmax.h step): a row keeps its reference maximum until a
// key tile's maximum exceeds it by more than this (log2 units), so its probabilities stay below 2^8 = 256, in range
// for bf16, float16 and float32 sums, and O is rescaled only on the rare tiles that raise a row's maximum that much.
constexpr float kLazyRescaleSlackLog2 = 8.0f;

// JAX_FLASH_SM90_LAZY_RESCALE (read at every call), for the kernels that have the lazy rescale (16-bit, d >= 128):
// unset, "", "auto" or "1" keeps a row's reference within the slack above, "0" uses the running maximum (still
// skipping the rescale where no row of a warp raised its maximum). Other kernels accept the switch and ignore it.
template <class Traits>
std::string rescale_slack_log2(float* slack_log2) {
  bool lazy = false;
  if (std::string err = on_off_auto_switch("JAX_FLASH_SM90_LAZY_RESCALE", true, &lazy); !err.empty()) return err;
  *slack_log2 = lazy && lazy_rescale<Traits>() ? kLazyRescaleSlackLog2 : 0.0f;
  return {};
}

// CTAs of forward_kernel<Traits, kVariant> that fit on the current GPU at once (sm80/launch_common.h).
template <class Traits, ForwardVariant kVariant>
std::string resident_ctas(int64_t* ctas) {
  if (std::string err = sm80::resident_ctas<forward_kernel<Traits, kVariant>>(Traits::kThreads, Traits::kSmemBytes,
                                                                            ctas);
      !err.empty()) {
    return "sm90 forward: sizing the persistent grid: " + err;
  }
  return {};
}

// One kernel form with one tile, on the per-tile or the persistent grid.
template <class Traits, ForwardVariant kVariant>
std::string launch_tiles(const AttentionParams& p, bool persistent, int64_t max_ctas, cudaStream_t stream) {
  ForwardKernelArgs<Traits> args{{p,
                                  TileGrid{},
                                  make_tma_q<Traits>(p, p.q),
                                  make_tma_k<Traits>(p, p.k),
                                  make_tma_v<Traits>(p, p.tf32_vt),
                                  make_tma_o<Traits>(p),
                                  {}}};
  if constexpr (Traits::kSplit) {  // split_tf32_launch.h: p.q and p.k are the hi parts already
    const SplitTf32Parts parts =
        split_tf32_parts(p.tf32_vt, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim);
    args.tma_lo = {make_tma_q<Traits>(p, parts.q.lo), make_tma_k<Traits>(p, parts.k.lo),
                   make_tma_v<Traits>(p, parts.vt.lo)};
  }
  if (std::string err = rescale_slack_log2<Traits>(&args.rescale_slack_log2); !err.empty()) return err;
  const auto kernel = forward_kernel<Traits, kVariant>;
  if (std::string err = sm80::allow_dynamic_smem(kernel, Traits::kSmemBytes); !err.empty()) return err;
  unsigned grid = 0;  // one CTA per tile
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch, &grid);
      !err.empty()) {
    return err;
  }
  if (grid == 0) return {};
  const auto row_blocks = static_cast<uint32_t>(ceil_div(p.seqlen_q, Traits::kBlockM));
  const uint32_t slices = grid / row_blocks;
  uint32_t band = slices;  // every slice in one band: the causal order's default
  if (p.causal) {
    if (std::string err = causal_band(p, persistent, sizeof(typename Traits::Element), slices, &band);
        !err.empty()) {
      return err;
    }
  }
  args.grid = TileGrid::make(grid, row_blocks, static_cast<uint32_t>(p.heads_q),
                             static_cast<uint32_t>(p.heads_q / p.heads_kv), band);
  if (persistent) {
    int64_t ctas = 0;
    if (std::string err = resident_ctas<Traits, kVariant>(&ctas); !err.empty()) return err;
    if (max_ctas > 0) ctas = std::min(ctas, max_ctas);
    grid = static_cast<unsigned>(std::min<int64_t>(grid, ctas));
  }
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return sm80::last_launch_error("sm90 forward kernel launch");
}

// One kernel form (forward_variant.h); forward_dispatch.h picks it per call. In the common form, calls with at most
// 64 query rows take the short-rows tile, and long key sequences on the per-tile grid the long-rows tile, where the
// head dim has them (kernel_traits.h forward_tile).
// TF32 (float32 q/k/v/o; kernel_traits.h tf32_forward_tile, head dims 64 and 128) runs its V^T pre-pass first, on
// the same stream, and has one tile per head dim; dispatch.cu checks that the call fits (sm90_float32_refusal).
template <int kHeadDim, class Element, ForwardVariant kVariant>
std::string launch_forward_variant(const AttentionParams& p, cudaStream_t stream) {
  bool persistent = false;
  int64_t max_ctas = 0;
  if (std::string err = persistent_switch(p.seqlen_k, &persistent, &max_ctas,
                                         persistent_max_seqlen_k<kHeadDim, Element, kVariant>());
      !err.empty()) {
    return err;
  }
  if constexpr (is_tf32<Element>) {
    static_assert(kHeadDim == 64 || kHeadDim == 128, "the TF32 tiles and the workspace's head dims");
    if (p.tf32_vt == nullptr) return "sm90 TF32 forward: no V^T workspace";
    if (std::string err = launch_tf32_v_transpose<kHeadDim>(p, stream); !err.empty()) return err;
  } else {
    if constexpr (kVariant == ForwardVariant::kCommon && has_row_tile(kHeadDim, RowTile::kShort)) {
      if (p.seqlen_q <= forward_tile(kHeadDim, RowTile::kShort).block_m) {
        using Short = ForwardTraits<kHeadDim, Element, RowTile::kShort>;
        return launch_tiles<Short, kVariant>(p, persistent, max_ctas, stream);
      }
    }
    if constexpr (kVariant == ForwardVariant::kCommon && has_row_tile(kHeadDim, RowTile::kTwoPerSm)) {
      bool two_per_sm = false;
      if (std::string err = two_per_sm_switch(p, &two_per_sm); !err.empty()) return err;
      if (two_per_sm) {
        bool three_per_sm = false;
        if (std::string err = three_per_sm_switch(p, &three_per_sm); !err.empty()) return err;
        if (three_per_sm) {
          if (std::string err = persistent_switch(p.seqlen_k, &persistent, &max_ctas, kThreePerSmPersistentMaxSeqlenK);
              !err.empty()) {
            return err;
          }
          if constexpr (has_row_tile(kHeadDim, RowTile::kThreePerSmWideKeys)) {
            bool three_wide = false;
            if (std::string err = wide_keys_switch(kHeadDim, p, &three_wide, true); !err.empty()) return err;
            if (three_wide) {
              return launch_tiles<ForwardTraits<kHeadDim, Element, RowTile::kThreePerSmWideKeys>, kVariant>(
                  p, persistent, max_ctas, stream);
            }
          }
          return launch_tiles<ForwardTraits<kHeadDim, Element, RowTile::kThreePerSm>, kVariant>(p, persistent,
                                                                                              max_ctas, stream);
        }
        if constexpr (has_row_tile(kHeadDim, RowTile::kTwoPerSmWideKeys)) {
          bool wide_keys = false;
          if (std::string err = wide_keys_switch(kHeadDim, p, &wide_keys); !err.empty()) return err;
          if (wide_keys) {
            return launch_tiles<ForwardTraits<kHeadDim, Element, RowTile::kTwoPerSmWideKeys>, kVariant>(
                p, persistent, max_ctas, stream);
          }
        }
        return launch_tiles<ForwardTraits<kHeadDim, Element, RowTile::kTwoPerSm>, kVariant>(p, persistent, max_ctas,
                                                                                          stream);
      }
    }
    if constexpr (kVariant == ForwardVariant::kCommon && has_row_tile(kHeadDim, RowTile::kWideKeys)) {
      bool wide_keys = false;
      if (std::string err = wide_keys_switch(kHeadDim, p, &wide_keys); !err.empty()) return err;
      if (wide_keys) {
        return launch_tiles<ForwardTraits<kHeadDim, Element, RowTile::kWideKeys>, kVariant>(p, persistent, max_ctas,
                                                                                          stream);
      }
    }
    if constexpr (kVariant == ForwardVariant::kCommon && has_row_tile(kHeadDim, RowTile::kLong)) {
      if (!persistent && p.seqlen_k > kPersistentMaxSeqlenK) {
        using Long = ForwardTraits<kHeadDim, Element, RowTile::kLong>;
        return launch_tiles<Long, kVariant>(p, persistent, max_ctas, stream);
      }
    }
  }
  return launch_tiles<ForwardTraits<kHeadDim, Element>, kVariant>(p, persistent, max_ctas, stream);
}

}  // namespace jax_flash::cuda::sm90
