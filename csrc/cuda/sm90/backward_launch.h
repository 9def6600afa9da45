// Host launchers of the Hopper backward's two GEMM passes for one (head dim, element type, kernel form); each form
// is instantiated in a translation unit of its own (instantiations/backward_hdim{D}_{type}_{form}.cu, sm_90a only).
// backward_dispatch.h runs the rest of the backward around them (softmax_d first; with the fused dQ, the workspace
// zeroing and the conversion after) and picks the form:
//   fused_dq (has_fused_dq: d=64, d=128): the dK/dV pass (backward_dkdv_kernel.h; at d=256 with
//     backward_dkdv_split_consumer.h), one CTA per key tile and KV head, also sums dQ into the dq_accum workspace
//     (one bulk reduction per item, dq_staging.h);
//   otherwise: the dK/dV pass, then the dQ pass (backward_dq_kernel.h), one CTA per query tile and head, which
//     recomputes S and dP: no atomics anywhere, bit-reproducible.
#pragma once

#include <algorithm>
#include <string>

#include "../../common/attention_params.h"
#include "../../common/tf32_workspace.h"
#include "../common/block_range.h"
#include "../sm80/launch_common.h"
#include "backward_dkdv_kernel.h"
#include "backward_dq_kernel.h"
#include "backward_traits.h"
#include "forward_launch.h"  // bshd_tensor, band_mib_switch

namespace jax_flash::cuda::sm90 {

// The parts workspace of a backward call whose kernels read their operands in parts (common/tf32_workspace.h
// backward_operand_parts), as the kernels' element type: split TF32's (float32) or the float16 parts'.
template <class Traits>
typename Traits::Element* parts_workspace(const AttentionBackwardParams& p) {
  using T = typename Traits::Element;
  if constexpr (Traits::kTf32) {
    return reinterpret_cast<T*>(p.tf32_vt);
  } else {
    return static_cast<T*>(p.float16_parts);
  }
}

// The four TMA descriptors of a backward kernel: Q and dO tiles of TmaQ's box, K and V tiles of TmaKV's box.
template <class Traits, class QLayout, class KVLayout, int kQRows, int kKVRows>
BackwardArgs<Traits> backward_args(const AttentionBackwardParams& p) {
  using namespace cute;
  constexpr int kHeadDim = Traits::kHeadDim;
  auto q_tma = [&](const void* data) {
    return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor<Traits>(data, query_tma_shape(p)),
                         QLayout{}, Shape<Int<kQRows>, Int<kHeadDim>>{}, _1{});
  };
  auto kv_tma = [&](const void* data) {
    return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor<Traits>(data, key_tma_shape(p)),
                         KVLayout{}, Shape<Int<kKVRows>, Int<kHeadDim>>{}, _1{});
  };
  if constexpr (Traits::kLowParts) {  // the hi and lo parts the pre-pass wrote (split_tf32_backward_launch.h,
                                      // float16_parts_backward_launch.h)
    const auto parts = backward_operand_parts(parts_workspace<Traits>(p), p.batch, p.seqlen_q, p.seqlen_k, p.heads_q,
                                              p.heads_kv, p.head_dim);
    return {p,  q_tma(parts.q.hi), q_tma(parts.d_o.hi), kv_tma(parts.k.hi), kv_tma(parts.v.hi),
            {q_tma(parts.q.lo), q_tma(parts.d_o.lo), kv_tma(parts.k.lo), kv_tma(parts.v.lo)}};
  } else {
    return {p, q_tma(p.q), q_tma(p.d_o), kv_tma(p.k), kv_tma(p.v), {}};
  }
}

// Causal calls order the dK/dV kernel's CTAs in bands of slices, longest key blocks first within each
// (backward_key_block.h banded_block_coord), the bands sized so that their Q, dO and float32 dQ rows take about
// 32 MiB, by default in the fused-dQ kernels (d=64 / d=128), where it was measured: on the H200 (bf16, causal,
// bench_env_ab.py, results/env_ab_NVIDIA_H200_2026-12-03_bwdbands_s23.json) 32 MiB bands ran the backward between
// 0.3% slower and 4.5% faster than the slice-by-slice order (d=128: 1k +2%, 2k +3%, 4k +4.5%; 16k -0.3%; d=64 0
// to +2%), 8 MiB about the same; one band over all slices (4096 MiB) 1.5-21% slower, its concurrent CTAs reading Q
// and dO and adding dQ rows of as many different slices. The other dK/dV kernels (d=96/192/256, TF32, separate dQ)
// keep the slice order unless the switch asks for bands.
constexpr int64_t kCausalBandBytes = int64_t(32) << 20;

// JAX_FLASH_SM90_BWD_CAUSAL_BAND_MIB (forward_launch.h band_mib_switch): "auto" the default above, except on the
// persistent grid (below: bands break its static schedule's balance); "0" the slice-by-slice order; N > 0 bands
// of about N MiB (every dK/dV kernel).
inline std::string causal_band_slices(const AttentionBackwardParams& p, int64_t element_bytes, bool fused_dq,
                                      bool persistent, int64_t* band) {
  *band = 0;
  int64_t budget = fused_dq && !persistent ? kCausalBandBytes : 0;
  if (std::string err = band_mib_switch("JAX_FLASH_SM90_BWD_CAUSAL_BAND_MIB", &budget); !err.empty()) return err;
  if (!p.causal || budget == 0) return {};
  const int64_t slices = p.batch * p.heads_kv;
  const int64_t bytes_per_slice = (p.heads_q / p.heads_kv) * p.seqlen_q * p.head_dim * (2 * element_bytes + 4);
  *band = std::clamp<int64_t>(budget / std::max<int64_t>(1, bytes_per_slice), 1, slices);
  return {};
}

// JAX_FLASH_SM90_BWD_PERSISTENT (read at every call; forward_launch.h on_off_auto_switch): "1" runs the dK/dV
// kernels that can (dkdv_runs_persistent: d=64 and d=96, not the masked form; not d=128, 192, 256 or TF32) on a
// persistent grid, one CTA per SM looping over key blocks, so that a CTA's next block's K/V and first Q/dO tiles
// load under its current block's last items and epilogue instead of after a new CTA's start; "0" one CTA per key
// block; unset or "auto" persistent for the d=64 common form up to kBwdPersistentMaxSeqlenK keys, where it was
// measured. On the H200 (bf16, 16k tokens, 32 heads, bench_env_ab.py, results/env_ab_NVIDIA_H200_2026-12-03_
// bwdpersist{,_noband}_s26.json), against one CTA per block: non-causal 1k +3.2%, 2k +1.7%, 4k +1.0%, 8k -0.5%,
// 16k -0.2%; causal with the bands -5% to -16% (bands of long-first blocks, walked pass by pass, hand some CTAs
// long blocks pass after pass), without them (both grids) 1k +5.3%, 2k +3.1%, 4k +1.7%, 16k -2.8%. So the
// persistent grid runs without bands unless JAX_FLASH_SM90_BWD_CAUSAL_BAND_MIB asks for them.
// JAX_FLASH_SM90_BWD_PERSISTENT_CTAS=N (tests) caps that grid at N CTAs, so that small problems take several key
// blocks per CTA too.
constexpr int64_t kBwdPersistentMaxSeqlenK = 4096;

template <class Traits, BackwardForm kForm>
std::string dkdv_persistent_switch(const AttentionBackwardParams& p, bool* persistent, int64_t* max_ctas) {
  const bool automatic =
      Traits::kHeadDim == 64 && kForm == BackwardForm::kCommon && p.seqlen_k <= kBwdPersistentMaxSeqlenK;
  if (std::string err = on_off_auto_switch("JAX_FLASH_SM90_BWD_PERSISTENT", automatic, persistent); !err.empty()) {
    return err;
  }
  return cta_cap_switch("JAX_FLASH_SM90_BWD_PERSISTENT_CTAS", max_ctas);
}

// The dK/dV kernel of traits Traits (one CTA per key tile and KV head, or the persistent grid above).
template <class Traits, BackwardForm kForm, bool kFusedDq>
std::string launch_dkdv_kernel(const AttentionBackwardParams& p, cudaStream_t stream, const char* what) {
  using namespace cute;
  BackwardArgs<Traits> args =
      backward_args<Traits, decltype(take<0, 2>(typename Traits::SmemLayoutQ{})), typename Traits::SmemLayoutKV,
                    Traits::kBlockM, Traits::kBlockN>(p);
  constexpr auto kernel = dkdv_kernel<Traits, kForm, kFusedDq>;
  if (std::string err = sm80::allow_dynamic_smem(kernel, Traits::kSmemBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch, &grid);
      !err.empty()) {
    return err;
  }
  if (grid == 0) return {};
  args.key_blocks = grid;
  bool persistent = false;
  int64_t max_ctas = 0;
  if constexpr (dkdv_runs_persistent<Traits, kForm>()) {
    if (std::string err = dkdv_persistent_switch<Traits, kForm>(p, &persistent, &max_ctas); !err.empty()) return err;
  }
  if (std::string err =
          causal_band_slices(p, sizeof(typename Traits::Element), kFusedDq, persistent, &args.band_slices);
      !err.empty()) {
    return err;
  }
  if (persistent) {
    int64_t ctas = 0;
    if (std::string err = sm80::resident_ctas<kernel>(Traits::kThreads, Traits::kSmemBytes, &ctas); !err.empty()) {
      return "sm90 backward: sizing the persistent dK/dV grid: " + err;
    }
    if (max_ctas > 0) ctas = std::min(ctas, max_ctas);
    grid = static_cast<unsigned>(std::min<int64_t>(grid, ctas));
  }
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return sm80::last_launch_error(what);
}

template <int kHeadDim, class Element, BackwardForm kForm, bool kFusedDq, class OutElement>
std::string launch_dkdv(const AttentionBackwardParams& p, cudaStream_t stream) {
  return launch_dkdv_kernel<DkdvTraitsFor<kHeadDim, Element, OutElement>, kForm, kFusedDq>(
      p, stream, "sm90 dK/dV kernel launch");
}

// The dQ kernel of traits Traits (one CTA per query tile and head).
template <class Traits, BackwardForm kForm>
std::string launch_dq_kernel(const AttentionBackwardParams& p, cudaStream_t stream, const char* what) {
  using namespace cute;
  const BackwardArgs<Traits> args =
      backward_args<Traits, typename Traits::SmemLayoutQ, decltype(take<0, 2>(typename Traits::SmemLayoutKV{})),
                    Traits::kBlockM, Traits::kBlockN>(p);
  auto kernel = dq_kernel<Traits, kForm>;
  if (std::string err = sm80::allow_dynamic_smem(kernel, Traits::kSmemBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch, &grid);
      !err.empty()) {
    return err;
  }
  if (grid == 0) return {};
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return sm80::last_launch_error(what);
}

template <int kHeadDim, class Element, BackwardForm kForm, class OutElement>
std::string launch_dq(const AttentionBackwardParams& p, cudaStream_t stream) {
  return launch_dq_kernel<DqTraits<kHeadDim, Element, OutElement>, kForm>(p, stream, "sm90 dQ kernel launch");
}

// The TF32 dK/dV pass of a float32 call (Tf32DkdvTraits, the common form); f32/launch.h runs the softmax_d pre-pass
// before it and hands the dQ pass to launch_tf32_dq.
template <int kHeadDim>
std::string launch_tf32_dkdv(const AttentionBackwardParams& p, cudaStream_t stream) {
  return launch_dkdv_kernel<Tf32DkdvTraits<kHeadDim>, BackwardForm::kCommon, false>(p, stream,
                                                                                  "sm90 TF32 dK/dV kernel launch");
}

// The TF32 dQ pass of a float32 call (Tf32DqTraits, the common form), after the dK/dV pass.
template <int kHeadDim>
std::string launch_tf32_dq(const AttentionBackwardParams& p, cudaStream_t stream) {
  return launch_dq_kernel<Tf32DqTraits<kHeadDim>, BackwardForm::kCommon>(p, stream, "sm90 TF32 dQ kernel launch");
}

// The GEMM passes of one call in kernel form kForm (backward_form.h): with fused_dq, the dK/dV pass that also
// adds dQ into the (zeroed) dq_accum workspace; otherwise the dK/dV pass and the dQ pass.
template <int kHeadDim, class Element, BackwardForm kForm, class OutElement>
std::string launch_backward_form(const AttentionBackwardParams& p, bool fused_dq, cudaStream_t stream) {
  if (fused_dq) {
    if constexpr (has_fused_dq(kHeadDim)) {
      return launch_dkdv<kHeadDim, Element, kForm, true, OutElement>(p, stream);
    } else {
      return "sm90 backward: no fused dQ form for this head dim";
    }
  }
  if (std::string err = launch_dkdv<kHeadDim, Element, kForm, false, OutElement>(p, stream); !err.empty()) {
    return err;
  }
  return launch_dq<kHeadDim, Element, kForm, OutElement>(p, stream);
}

}  // namespace jax_flash::cuda::sm90
