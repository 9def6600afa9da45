// The pre-pass of the Hopper TF32 forward: V [batch, seqlen_k, heads_kv, head_dim] float32 -> the V^T workspace
// [batch, heads_kv, kHeadDim, tf32_vt_keys(seqlen_k)] (common/tf32_workspace.h), rounded to TF32 (nearest, ties
// away: cvt.rna), zero past seqlen_k and past head_dim. Within each 8-key chunk, position q < 4 holds key 2q and
// position q + 4 key 2q + 1: the order in which the probabilities' registers feed the TF32 P V (fragments.h
// accumulator_as_tf32_operand_a). A 32-key x 32-dim tile per CTA goes through shared memory, so that both the
// reads (along head_dim) and the writes (along keys) are coalesced. Split TF32 (vt_lo not null) writes V^T's hi part
// there and its lo part to vt_lo (split_tf32_mma.h split_to_tf32).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "../../common/attention_params.h"
#include "../../common/tf32_workspace.h"
#include "fragments.h"  // round_to_tf32
#include "split_tf32_mma.h"

namespace jax_flash::cuda::sm90 {

constexpr int kTransposeTile = 32;  // keys and head-dim columns per CTA
constexpr int kTransposeRows = 8;   // warps per CTA: each thread moves 32 / 8 elements each way

// Key stored at position `pos` (0..31) of a 32-key tile: the TF32 P V order within each 8-key chunk.
__device__ __forceinline__ int tf32_chunk_key(int pos) {
  const int in_chunk = pos % 8;
  return pos - in_chunk + (in_chunk < 4 ? 2 * in_chunk : 2 * (in_chunk - 4) + 1);
}

// CTA c covers key tile c % key_tiles, head-dim tile (c / key_tiles) % dim_tiles of slice c / (key_tiles *
// dim_tiles) = batch * heads_kv + head. A template (one per kernel head dim) so that the header can be included by
// several translation units.
template <int kKernelHeadDim>
__global__ void __launch_bounds__(kTransposeTile * kTransposeRows)
    tf32_v_transpose_kernel(const float* v, float* vt, float* vt_lo, int64_t seqlen_k, int64_t keys_padded,
                            int64_t heads_kv,
                            int64_t head_dim, int64_t key_tiles, int64_t dim_tiles) {
  constexpr int64_t kernel_head_dim = kKernelHeadDim;
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];  // [key][dim]; +1: conflict-free column reads
  const int64_t cta = blockIdx.x;
  const int64_t key0 = (cta % key_tiles) * kTransposeTile;
  const int64_t dim0 = ((cta / key_tiles) % dim_tiles) * kTransposeTile;
  const int64_t slice = cta / (key_tiles * dim_tiles);
  const int64_t batch = slice / heads_kv, head = slice % heads_kv;
  const int lane = int(threadIdx.x) % kTransposeTile, row = int(threadIdx.x) / kTransposeTile;
  for (int r = row; r < kTransposeTile; r += kTransposeRows) {
    const int64_t key = key0 + r, dim = dim0 + lane;
    tile[r][lane] = key < seqlen_k && dim < head_dim ? v[((batch * seqlen_k + key) * heads_kv + head) * head_dim + dim]
                                                     : 0.0f;
  }
  __syncthreads();
  const int64_t pos = key0 + lane;
  for (int r = row; r < kTransposeTile; r += kTransposeRows) {
    const int64_t dim = dim0 + r;
    if (pos < keys_padded && dim < kernel_head_dim) {
      const int64_t at = (slice * kernel_head_dim + dim) * keys_padded + pos;
      const float x = tile[tf32_chunk_key(lane)][r];
      if (vt_lo == nullptr) {
        vt[at] = round_to_tf32(x);
      } else {
        split_to_tf32(x, vt[at], vt_lo[at]);
      }
    }
  }
}

// Fills p.tf32_vt from p.v for the TF32 kernel of head dim kHeadDim, on `stream` (and vt_lo, if given, with the lo
// parts).
template <int kHeadDim>
std::string launch_tf32_v_transpose(const AttentionParams& p, cudaStream_t stream, float* vt_lo = nullptr) {
  static_assert(kHeadDim % kTransposeTile == 0);
  const int64_t keys_padded = tf32_vt_keys(p.seqlen_k);
  const int64_t key_tiles = (keys_padded + kTransposeTile - 1) / kTransposeTile;
  const int64_t dim_tiles = kHeadDim / kTransposeTile;
  const int64_t ctas = key_tiles * dim_tiles * p.batch * p.heads_kv;
  if (ctas == 0) return {};
  if (ctas > INT32_MAX) return "sm90 TF32 forward: V is too large for the V^T pre-pass grid";
  tf32_v_transpose_kernel<kHeadDim><<<static_cast<unsigned>(ctas), kTransposeTile * kTransposeRows, 0, stream>>>(
      static_cast<const float*>(p.v), p.tf32_vt, vt_lo, p.seqlen_k, keys_padded, p.heads_kv, p.head_dim, key_tiles,
      dim_tiles);
  if (cudaGetLastError() != cudaSuccess) return "sm90 TF32 forward: launch of the V^T pre-pass failed";
  return {};
}

}  // namespace jax_flash::cuda::sm90
