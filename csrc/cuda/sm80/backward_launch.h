// Host launcher of the backward for one (head dim, element type); instantiated once per generated .cu.
//   1. softmax_d pre-pass
//   2. dK/dV pass (one CTA per key tile and KV head)
//   3. dQ pass (one CTA per query tile and head)
//   4. only for a deterministic dbias of a broadcast bias: the dbias kernel (dbias.h)
// No atomics for dQ/dK/dV, so they are bit-identical run to run; dbias uses atomics only when the bias is
// broadcast and deterministic is False.
// Fused dQ instead of step 3 where the call gives a dq_accum workspace (the default of non-deterministic
// common-variant calls, jax_flash/_ffi_calls.py; JAX_FLASH_FUSED_DQ=0 turns it off) and runs the common variant:
// the workspace is zeroed, the dK/dV pass also adds each item's dS K into its tile of it, and one elementwise pass
// converts it (common/dq_accum.h; d=128 4k on the H200: 253 vs 224 TFLOP/s in the eighth session). The general
// variant keeps the dQ pass, which also forms dbias. Where every key block has the same items, the fused form also
// splits its last wave across every SM (dkdv_tail_plan.h) when the call gives a dkdv_tail workspace: its slots are
// zeroed before the pass and converted into dk / dv after it.
#pragma once

#include <cstdlib>
#include <string>

#include "../../common/attention_params.h"
#include "../common/block_range.h"
#include "../common/dq_accum.h"
#include "backward_dkdv_kernel.h"
#include "dbias.h"
#include "backward_dq_kernel.h"
#include "backward_row_kernels.h"
#include "dkdv_tail.h"
#include "kernel_traits.h"
#include "launch_common.h"
#include "score_tile.h"
#include "softmax_d_launch.h"

namespace jax_flash::cuda::sm80 {

inline bool backward_rows_are_16b_aligned(const AttentionBackwardParams& p) {
  return rows_are_16b_aligned(p) && aligned16(p.d_o) && aligned16(p.dq) && aligned16(p.dk) && aligned16(p.dv);
}

template <class T>
__global__ void __launch_bounds__(kDqConvertThreads) dq_from_column_groups_kernel(const AttentionBackwardParams p) {
  dq_from_column_groups<T>(p);
}

template <class T, int kBlockN, int kHeadDim>
__global__ void __launch_bounds__(kDqConvertThreads)
    dkdv_from_tail_slots_kernel(const AttentionBackwardParams p, const DkdvTail tail) {
  dkdv_from_tail_slots<T, kBlockN, kHeadDim>(p, tail);
}

// Whether every key block of the call sees the same query tiles (no causal, window or sequence lengths), so that
// its items split evenly (query_tiles_for_keys).
inline bool key_blocks_see_every_query_tile(const AttentionParams& p) {
  return !p.causal && p.window_left < 0 && p.window_right < 0 && p.q_seqlens == nullptr && p.kv_seqlens == nullptr;
}

// The fused form's tail split for `blocks` key blocks, or none (dkdv_tail_plan.h): also none where the workspace is
// not 16-byte aligned (the slots' float4 reads and pair reductions) or the piece kernel cannot get its shared memory,
// so that nothing is queued before the split is known to run.
// The wave is that of the whole-block kernel, dkdv_kernel<Traits, false, true> (the fused form; its shared memory,
// smem_bytes, is the same at every call on a device).
template <class Traits, class PieceKernel>
DkdvTail plan_fused_tail(const AttentionBackwardParams& p, PieceKernel piece_kernel, int smem_bytes, int64_t blocks) {
  if (p.dkdv_tail == nullptr || !key_blocks_see_every_query_tile(p) || !aligned16(p.dkdv_tail)) {
    return whole_dkdv_blocks(blocks);
  }
  int64_t wave = 0;
  if (!allow_dynamic_smem(piece_kernel, smem_bytes).empty() ||
      !resident_ctas<dkdv_kernel<Traits, false, true>>(Traits::kThreads, smem_bytes, &wave).empty()) {
    return whole_dkdv_blocks(blocks);  // the pass runs unsplit
  }
  // Every block's items, as the kernel counts them (query_tiles_for_keys: all query tiles, given the test above).
  const int64_t items = (p.heads_q / p.heads_kv) * ceil_div(p.seqlen_q, Traits::kBlockM);
  return plan_dkdv_tail(blocks, items, wave,
                        p.dkdv_tail_floats / dkdv_tail_slot_floats<Traits::kBlockN, Traits::kHeadDim>(), p.dkdv_tail);
}

// JAX_FLASH_SM80_TAIL_OVERLAP (read at every call): unset, "" or "1" lets the tail's pieces start on the SMs the last
// whole blocks free where the launcher can (`possible`: programmatic dependent launch, compute capability 9.0, and
// whole blocks to follow); "0" starts them after the whole blocks, as on older devices.
inline std::string tail_overlap_switch(bool possible, bool* overlap) {
  const char* env = std::getenv("JAX_FLASH_SM80_TAIL_OVERLAP");
  const std::string value = env ? env : "";
  if (value != "" && value != "0" && value != "1") {
    return "JAX_FLASH_SM80_TAIL_OVERLAP must be 0 or 1, not '" + value + "'";
  }
  *overlap = possible && value != "0";
  return {};
}

// The piece kernel, as a dependent grid of the whole blocks' where `overlap` (the kernel waits for them before its
// CTAs exit: backward_dkdv_kernel.h).
template <class Kernel>
std::string launch_pieces(Kernel kernel, unsigned pieces, int threads, int smem_bytes, bool overlap,
                          cudaStream_t stream, const AttentionBackwardParams& p, bool vectorized, const DkdvTail& tail) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(pieces);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = overlap ? &attribute : nullptr;
  config.numAttrs = overlap ? 1 : 0;
  if (const cudaError_t err = cudaLaunchKernelEx(&config, kernel, p, vectorized, tail); err != cudaSuccess) {
    return std::string("sm80 dK/dV tail piece kernel launch: ") + cudaGetErrorString(err);
  }
  return last_launch_error("sm80 dK/dV tail piece kernel launch");
}

// fused_dq: the common variant's fused-dQ form (the caller checked that the call runs the common variant).
// on_sm90: the device is compute capability 9.x.
// The fused form with a split tail (dkdv_tail_plan.h): zero the slots, the whole blocks, the pieces, then the slots'
// conversion.
template <int kHeadDim, class Element>
std::string launch_dkdv(const AttentionBackwardParams& p, bool vectorized, bool fused_dq, bool on_sm90,
                        cudaStream_t stream) {
  using Traits = BackwardTraits<kHeadDim, Element>;
  auto kernel = fused_dq                   ? dkdv_kernel<Traits, false, true>
                : needs_general_variant(p) ? dkdv_kernel<Traits, true, false>
                                           : dkdv_kernel<Traits, false, false>;
  // On compute capability 9.x the fused form runs its sm_90 build, which stages dQ for bulk reductions (the
  // kernel's kBulkDq): a superset of what the sm_80 build uses, so it also fits a build without sm_90a.
  const int smem_bytes = Traits::kSmemBytes + (fused_dq && on_sm90 ? Traits::kDqStagingBytes : 0);
  if (std::string err = allow_dynamic_smem(kernel, smem_bytes); !err.empty()) return err;
  unsigned blocks = 0;
  if (std::string err = grid_size(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch, &blocks); !err.empty()) {
    return err;
  }
  if (blocks == 0) return {};
  auto piece_kernel = dkdv_kernel<Traits, false, true, true>;
  const DkdvTail tail =
      fused_dq ? plan_fused_tail<Traits>(p, piece_kernel, smem_bytes, blocks) : whole_dkdv_blocks(blocks);
  if (tail.tail_blocks > 0) {
    const size_t bytes = tail.tail_blocks * dkdv_tail_slot_floats<Traits::kBlockN, Traits::kHeadDim>() * sizeof(float);
    if (const cudaError_t err = cudaMemsetAsync(tail.slots, 0, bytes, stream); err != cudaSuccess) {
      return std::string("sm80 backward: zeroing dkdv_tail: ") + cudaGetErrorString(err);
    }
  }
  if (tail.full_blocks > 0) {
    // The whole blocks; `tail` is unused there (so is its default, full_blocks = 2^31 - 1).
    kernel<<<static_cast<unsigned>(tail.full_blocks), Traits::kThreads, smem_bytes, stream>>>(p, vectorized, {});
    if (std::string err = last_launch_error("sm80 dK/dV kernel launch"); !err.empty()) return err;
  }
  if (tail.tail_blocks == 0) return {};
  const int64_t pieces = int64_t(tail.tail_blocks) * tail.pieces_per_block;
  bool overlap = false;
  // Only behind whole blocks: their start orders the zeroed slots and softmax_d before the pieces.
  if (std::string err = tail_overlap_switch(on_sm90 && tail.full_blocks > 0, &overlap); !err.empty()) return err;
  if (std::string err = launch_pieces(piece_kernel, static_cast<unsigned>(pieces), Traits::kThreads, smem_bytes,
                                      overlap, stream, p, vectorized, tail);
      !err.empty()) {
    return err;
  }
  const int64_t groups = tail.tail_blocks * Traits::kBlockN * (p.head_dim / 4);
  dkdv_from_tail_slots_kernel<Element, Traits::kBlockN, Traits::kHeadDim>
      <<<static_cast<unsigned>(std::min<int64_t>(ceil_div(groups, kDqConvertThreads), 65536)), kDqConvertThreads, 0,
         stream>>>(p, tail);
  return last_launch_error("sm80 dK/dV tail conversion kernel launch");
}

template <int kHeadDim, class Element>
std::string launch_dq(const AttentionBackwardParams& p, bool vectorized, DbiasMode dbias_mode, cudaStream_t stream) {
  using Traits = DqTraits<kHeadDim, Element>;
  constexpr int kSmemBytes = (2 * Traits::kQElems + 2 * Traits::kStages * Traits::kKVElems) * int(sizeof(Element));
  auto kernel = needs_general_variant(p) ? dq_kernel<Traits, true> : dq_kernel<Traits, false>;
  if (std::string err = allow_dynamic_smem(kernel, kSmemBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = grid_size(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch, &grid); !err.empty()) {
    return err;
  }
  if (grid == 0) return {};
  kernel<<<grid, Traits::kThreads, kSmemBytes, stream>>>(p, vectorized, dbias_mode);
  return last_launch_error("sm80 dQ kernel launch");
}

// The deterministic dbias of a broadcast bias (dbias.h).
template <int kHeadDim, class Element>
std::string launch_dbias(const AttentionBackwardParams& p, bool vectorized, DbiasBroadcast broadcast,
                         cudaStream_t stream) {
  using Traits = DqTraits<kHeadDim, Element>;
  constexpr int kTileBytes = (2 * Traits::kQElems + 2 * Traits::kKVElems) * int(sizeof(Element));
  constexpr int kSumBytes = Traits::kBlockM * Traits::kBlockN * int(sizeof(float));
  constexpr int kSmemBytes = kTileBytes > kSumBytes ? kTileBytes : kSumBytes;
  auto kernel = dbias_kernel<Traits>;
  if (std::string err = allow_dynamic_smem(kernel, kSmemBytes); !err.empty()) return err;
  const DbiasGrid grid = make_dbias_grid(p, broadcast, Traits::kBlockM, Traits::kBlockN);
  unsigned blocks = 0;
  if (std::string err = grid_size(int64_t(grid.m_tiles) * grid.n_tiles, grid.slice_heads,
                                  p.outer_batch * grid.slice_batches, &blocks);
      !err.empty()) {
    return err;
  }
  if (blocks == 0) return {};
  kernel<<<blocks, Traits::kThreads, kSmemBytes, stream>>>(p, vectorized, grid);
  return last_launch_error("sm80 dbias kernel launch");
}

template <int kHeadDim, class Element>
std::string launch_backward(const AttentionBackwardParams& p, cudaStream_t stream) {
  if (std::string err = check_dense_strides(p); !err.empty()) return err;
  const bool vectorized = backward_rows_are_16b_aligned(p);
  if (std::string err = launch_softmax_d<Element>(p, softmax_d_kernel<Element>, stream, "sm80"); !err.empty()) {
    return err;
  }
  // The fused form adds pairs of columns in groups of 4 (common/dq_accum.h; its sm_90 build whole tiles with bulk
  // reductions, 16-byte multiples): a head_dim that is not a multiple of 4 (rare: it runs on a wider kernel) takes
  // the dQ pass instead.
  const bool on_sm90 = current_device_major() == 9;
  const bool fused_dq_fits = p.head_dim % 4 == 0;
  if (p.dq_accum != nullptr && !p.deterministic && !needs_general_variant(p) && fused_dq_fits) {
    const int64_t count = dq_workspace_elements(p.batch, p.seqlen_q, p.heads_q, p.head_dim);
    return run_fused_dq(
        p, stream, count, [&] { return launch_dkdv<kHeadDim, Element>(p, vectorized, true, on_sm90, stream); },
        dq_from_column_groups_kernel<Element>, dq_workspace_chunks(p), "sm80");
  }
  if (std::string err = launch_dkdv<kHeadDim, Element>(p, vectorized, false, on_sm90, stream); !err.empty()) {
    return err;
  }
  // dbias (zero-filled by the dispatcher): stores, atomics or its own deterministic kernel (dbias.h).
  const DbiasPlan dbias = plan_dbias(p);
  if (std::string err = launch_dq<kHeadDim, Element>(p, vectorized, dbias.dq_mode, stream); !err.empty()) return err;
  if (dbias.separate_kernel && p.seqlen_q > 0 && p.seqlen_k > 0) {
    return launch_dbias<kHeadDim, Element>(p, vectorized, dbias.broadcast, stream);
  }
  return {};
}

}  // namespace jax_flash::cuda::sm80
