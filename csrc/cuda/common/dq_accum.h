// dQ summed in a float32 workspace (AttentionBackwardParams::dq_accum; its size: common/dq_workspace.h), shared by
// the sm80 and sm90 backward: a fused dK/dV pass adds each (query tile, key tile) item's dS K to it with
// reductions in L2, then one pass scales and converts it into dq. Sums of float adds in whatever order the CTAs
// arrive: not bit-reproducible, so deterministic calls keep each family's separate dQ pass.
// Both families add into whole 64-row query tiles (common/dq_workspace_tile.h), each in its own order inside the
// tile: sm90 in WGMMA fragment order (sm90/dq_staging.h), sm80 in column groups (dq_column_group_offset below).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../../common/attention_params.h"
#include "../sm80/launch_common.h"
#include "../sm80/tensor_offsets.h"
#include "async_proxy_fence.h"
#include "block_range.h"
#include "bulk_reduce.h"
#include "dq_workspace_tile.h"

namespace jax_flash::cuda {

// *address += a, *(address + 1) += b, without reading the result back. One 8-byte vector reduction where the
// target has it (sm_90) and the pair is 8-byte aligned; two scalar reductions otherwise.
__device__ __forceinline__ void reduce_add_pair(float* address, float a, float b, bool pair_aligned) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pair_aligned) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(a), "f"(b) : "memory");
    return;
  }
#endif
  atomicAdd(address, a);
  atomicAdd(address + 1, b);
}

// sm80's order inside a chunk (head_dim a multiple of 4: the launchers send other head dims to the dQ pass):
// column-group major, [column group of 4 columns][row 0..63, swizzled][4 columns], so that
//  - a chunk holds exactly 64 * head_dim floats, and the groups of [0, head_dim) are a prefix of the order over any
//    wider tile: a kernel can stage its whole (padded) tile without column tests and add only the chunk's prefix;
//  - the conversion reads 16 contiguous bytes for the 4 columns of a group in one row;
//  - a warp's float2 stores of an mma.sync accumulator are free of bank conflicts: each half-warp stores rows
//    r..r+3 of two adjacent groups, which would both start at bank 0; odd groups hold their rows in the order
//    row ^ 4, so that the second lands on banks 16-31. (Pairs of one thread lie multiples of 8 rows and 8 columns
//    apart, so the swizzle keeps the offsets between them constant.)
// Rows past seqlen_q of the last tile, and rows past a shorter q length, are summed from fully masked scores (zero
// dS) and never converted.
constexpr int kDqGroupWidth = 4;

__host__ __device__ constexpr int dq_column_group_offset(int row, int col) {
  const int group = col / kDqGroupWidth;
  const int stored_row = row ^ ((group & 1) << 2);
  return group * kDqGroupWidth * static_cast<int>(kDqWorkspaceTileRows) + stored_row * kDqGroupWidth +
         col % kDqGroupWidth;
}

// Whether the order maps the 64 x head_dim tile one to one onto [0, 64 * head_dim) (so the groups of a narrower
// head_dim are a prefix of a wider one's).
constexpr bool dq_column_groups_fill_chunk(int head_dim) {
  constexpr int kRows = static_cast<int>(kDqWorkspaceTileRows);
  bool seen[kRows * 256] = {};
  for (int row = 0; row < kRows; ++row) {
    for (int col = 0; col < head_dim; ++col) {
      const int offset = dq_column_group_offset(row, col);
      if (offset < 0 || offset >= kRows * head_dim || seen[offset]) return false;
      seen[offset] = true;
    }
  }
  return true;
}
static_assert(dq_column_groups_fill_chunk(4) && dq_column_groups_fill_chunk(36) && dq_column_groups_fill_chunk(128));

// Offsets of an accumulator's pairs. They lie whole groups apart, so each pair's offset is the first pair's (per
// thread) plus a constant (dq_pair_delta). The first is returned through an opaque copy: the compiler then cannot
// hoist the 16 per-pair addresses (chunk or staging plus offset) out of the caller's item loop, where at 255
// registers they would spill (as the q-layout reductions' did, NOTES.md eighth session); one base register and
// immediate offsets instead.
template <class Coords>
__device__ __forceinline__ int dq_first_pair_offset(const Coords& coords) {
  int offset = dq_column_group_offset(cute::get<0>(coords(0)), cute::get<1>(coords(0)));
  asm volatile("" : "+r"(offset));
  return offset;
}
template <class Coords>
__device__ __forceinline__ int dq_pair_delta(const Coords& coords, int i) {
  return (cute::get<1>(coords(i)) - cute::get<1>(coords(0))) * static_cast<int>(kDqWorkspaceTileRows) +
         (cute::get<0>(coords(i)) - cute::get<0>(coords(0))) * kDqGroupWidth;
}

// Adds a (64 query rows x head-dim columns) dQ accumulator to its chunk, built for targets without bulk
// reductions: one 8-byte aligned reduction per pair of adjacent columns below head_dim (a multiple of 4: the
// launchers send other head dims to the dQ pass). `coords` is the identity tensor partitioned like `acc`;
// mma.sync accumulators hold two adjacent columns of one row (the first even) in consecutive registers.
// kSkipColumns: the tile is wider than head_dim (a smaller head dim on this kernel, or its accumulator padded past
// kHeadDim).
template <bool kSkipColumns, class Acc, class Coords>
__device__ __forceinline__ void add_dq_columns(float* chunk, const Acc& acc, const Coords& coords, int head_dim) {
  asm volatile("" : "+r"(head_dim));  // the column tests made here, not hoisted as live predicates
  float* first = chunk + dq_first_pair_offset(coords);
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    if (!kSkipColumns || cute::get<1>(coords(i)) < head_dim) {
      reduce_add_pair(first + dq_pair_delta(coords, i), acc(i), acc(i + 1), true);
    }
  }
}

// The whole (64 x tile width) accumulator staged in shared memory in the chunk order over the tile (`staging`: 64 x
// tile width floats), for one bulk reduction of the chunk's prefix of 64 * head_dim floats (reduce_dq_tile, head_dim
// a multiple of 4) once every thread has staged its part: no column tests, one 8-byte store per pair. Fenced for the
// async proxy; the caller's next CTA barrier orders the stores before the bulk copy is issued.
template <class Acc, class Coords>
__device__ __forceinline__ void stage_dq_columns(float* staging, const Acc& acc, const Coords& coords) {
  float* first = staging + dq_first_pair_offset(coords);
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    *reinterpret_cast<float2*>(first + dq_pair_delta(coords, i)) = make_float2(acc(i), acc(i + 1));
  }
  fence_stores_for_async_proxy();
}

constexpr int kDqConvertThreads = 256;

// sm80's conversion: dq = dq_accum * softmax_scale (the scale of S = scale * Q K^T, left out of dS) in dq's element
// type. CTAs stride over the chunks (query tiles, dq_workspace_chunks of them) and their threads over a chunk's rows
// in dq's order, 4 columns (one column group: 16 contiguous bytes of the chunk) per thread where the workspace is
// 16-byte aligned, so that a warp's stores are contiguous; two such reads in flight per thread. The chunk's
// coordinates are divided out once per CTA: per element, 64-bit index arithmetic was most of this pass's
// instructions (116 us at d=128 4k, 16k tokens and 16 heads under Nsight Compute; its 200 MB take ~50 us at 4 TB/s).
// Rows past seqlen_q are skipped. A device function so that each family wraps it in a kernel of its own (see
// sm80/backward_launch.h: a template kernel instantiated in translation units built for different architectures
// would be registered twice).
template <class T>
__device__ __forceinline__ void dq_from_column_groups(const AttentionBackwardParams& p) {
  struct alignas(kDqGroupWidth * sizeof(T)) Group { T v[kDqGroupWidth]; };
  constexpr int kRows = static_cast<int>(kDqWorkspaceTileRows);
  const int head_dim = static_cast<int>(p.head_dim);
  // One group per thread needs 16-byte reads of the workspace and 4-element stores into dq.
  const bool by_group = reinterpret_cast<uintptr_t>(p.dq_accum) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(p.dq) % sizeof(Group) == 0;
  const int width = by_group ? kDqGroupWidth : 1;
  const int items_per_row = head_dim / width;
  const int64_t tiles = dq_workspace_query_tiles(p.seqlen_q);
  const int64_t chunks = dq_workspace_chunks(p);
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  const int64_t row_stride = q_shape.row_stride();
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const int64_t m0 = chunk % tiles * kRows;
    const int64_t head = chunk / tiles % p.heads_q, batch = chunk / tiles / p.heads_q;
    const float* sums = p.dq_accum + chunk * kRows * head_dim;
    T* dq = static_cast<T*>(p.dq) + q_shape.offset(batch, m0, head);
    const int items = static_cast<int>(min(int64_t(kRows), p.seqlen_q - m0)) * items_per_row;
    auto column = [&](int item, int* row) {
      *row = item / items_per_row;
      return (item - *row * items_per_row) * width;
    };
    if (!by_group) {
      for (int item = threadIdx.x; item < items; item += blockDim.x) {
        int row;
        const int col = column(item, &row);
        dq[row * row_stride + col] = T(sums[dq_column_group_offset(row, col)] * p.softmax_scale);
      }
      continue;
    }
    auto read = [&](int item) {
      int row;
      const int col = column(item, &row);
      return *reinterpret_cast<const float4*>(sums + dq_column_group_offset(row, col));
    };
    auto write = [&](int item, float4 sum) {
      int row;
      const int col = column(item, &row);
      const float s = p.softmax_scale;
      *reinterpret_cast<Group*>(dq + row * row_stride + col) =
          Group{{T(sum.x * s), T(sum.y * s), T(sum.z * s), T(sum.w * s)}};
    };
    for (int item = threadIdx.x; item < items; item += 2 * blockDim.x) {
      const int second = item + blockDim.x;
      const float4 first_sum = read(item);
      const float4 second_sum = second < items ? read(second) : float4{};
      write(item, first_sum);
      if (second < items) write(second, second_sum);
    }
  }
}

// The dQ part of a fused backward, after softmax_d: zero the first `count` floats of the workspace (what the family's
// layout uses; none where the pre-pass zeroed it), run the family's fused dK/dV pass (launch_fused_dkdv(), which adds
// into it), then its conversion kernel of kDqConvertThreads threads (dq_from_column_groups or sm90's dq_from_tiles;
// both stride over the chunks, so the grid is `convert_blocks`, the number of CTAs the work asks for, capped at
// 65536).
template <class LaunchFusedDkdv>
std::string run_fused_dq(const AttentionBackwardParams& p, cudaStream_t stream, int64_t count,
                         LaunchFusedDkdv launch_fused_dkdv, void (*convert_kernel)(const AttentionBackwardParams),
                         int64_t convert_blocks, const char* family) {
  if (count > 0 && cudaMemsetAsync(p.dq_accum, 0, count * sizeof(float), stream) != cudaSuccess) {
    return sm80::last_launch_error((std::string(family) + " backward: zeroing dq_accum").c_str());
  }
  if (std::string err = launch_fused_dkdv(); !err.empty()) return err;
  const int64_t blocks = std::min<int64_t>(convert_blocks, 65536);
  if (blocks == 0) return {};
  convert_kernel<<<static_cast<unsigned>(blocks), kDqConvertThreads, 0, stream>>>(p);
  return sm80::last_launch_error((std::string(family) + " dQ conversion kernel launch").c_str());
}

}  // namespace jax_flash::cuda
