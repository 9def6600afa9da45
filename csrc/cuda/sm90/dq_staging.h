// The sm90 fused dK/dV pass's way into the float32 dQ workspace (common/dq_accum.h has the zero/fuse/convert
// sequence and why deterministic calls do not use it; common/dq_workspace.h its size): a staged shared tile, one
// bulk reduction per item, and the conversion that undoes the tile order.
//
// Workspace layout (common/dq_workspace_tile.h): [batch, heads_q, query tile, chunk], a chunk being one item's
// 64 x head_dim dQ tile, here in fragment order:
//   [column group of 8 (head_dim / 8 of them)][consumer thread 0..127][4 floats],
// the 4 floats being what that thread's WGMMA accumulator holds in those 8 columns (fragment indices 4j..4j+3 of
// a consumer whose column slice starts at group g * kGroupsPerConsumer, j = column group - that). So:
//  - each consumer thread stores 16 contiguous bytes per column group, thread-linear: no bank conflicts, no padding;
//  - the column groups of [0, head_dim) are a prefix of the staged tile (head_dim is a multiple of 8 here), so
//    one cp.reduce.async.bulk of 64 * head_dim floats adds the whole item, even when a smaller head_dim runs on a
//    wider kernel (zero columns past head_dim are neither added nor stored);
//  - rows past seqlen_q of the last tile are summed into the chunk and never converted.
// The conversion maps a chunk position back to (row, column) by partitioning an identity tensor with the
// consumers' own TiledMma and thread index, so the two cannot drift apart.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/dq_workspace.h"
#include "../common/bulk_reduce.h"
#include "../common/dq_accum.h"  // kDqConvertThreads
#include "../common/dq_workspace_tile.h"
#include "../sm80/tensor_offsets.h"

namespace jax_flash::cuda::sm90 {

constexpr int kDqGroupColumns = 8;      // columns per column group
constexpr int kDqGroupFloats = 4;       // floats a consumer thread holds per column group
constexpr int kDqStagingThreads = 128;  // threads of one consumer warpgroup

// Whether a consumer's TiledMma is one WGMMA atom covering its whole kRows x kCols slice, with the WGMMA accumulator
// layout: per thread, values (2 adjacent columns) x (rows r, r + 8) x (kCols / 8 column groups), so that values
// 4j..4j+3 lie in column group j and values 2k, 2k + 1 are adjacent columns of one row. That is what the staged
// order and the conversion's paired stores assume (the conversion takes the actual coordinates from the
// TiledMma). Checked on the types: evaluating the layout for every (thread, value) is past what nvcc folds.
template <class TiledMma, int kRows, int kCols>
constexpr bool dq_fragments_are_column_grouped() {
  using AtomShape = typename TiledMma::AtomShape_MNK;
  return cute::is_same_v<typename TiledMma::AtomLayoutC_TV, cute::GMMA::CLayout_64xN<kCols>> &&
         kRows == 64 && int(cute::size<0>(AtomShape{})) == kRows && int(cute::size<1>(AtomShape{})) == kCols &&
         int(cute::size(TiledMma{})) == kDqStagingThreads &&
         int(cute::tile_size<0>(TiledMma{})) == kRows && int(cute::tile_size<1>(TiledMma{})) == kCols;
}

// Float offset in the staged tile (and in the workspace chunk) of accumulator value i of consumer `group`'s thread
// `thread`, the consumer's slice holding kGroupsPerConsumer column groups.
template <int kGroupsPerConsumer>
__host__ __device__ constexpr int dq_chunk_offset(int group, int thread, int i) {
  return ((group * kGroupsPerConsumer + i / kDqGroupFloats) * kDqStagingThreads + thread) * kDqGroupFloats +
         i % kDqGroupFloats;
}

// The inverse of dq_chunk_offset for the first float of a column group: which consumer, thread and first
// accumulator value the float4 at `vector` (= offset / 4) of a chunk holds.
struct DqChunkSlot {
  int group, thread, first_value;
};
template <int kGroupsPerConsumer>
__host__ __device__ constexpr DqChunkSlot dq_chunk_slot(int vector) {
  const int column_group = vector / kDqStagingThreads;
  return {column_group / kGroupsPerConsumer, vector % kDqStagingThreads,
          column_group % kGroupsPerConsumer * kDqGroupFloats};
}
template <int kGroupsPerConsumer>
constexpr bool dq_chunk_slot_inverts_offset(int vector) {
  const DqChunkSlot slot = dq_chunk_slot<kGroupsPerConsumer>(vector);
  return dq_chunk_offset<kGroupsPerConsumer>(slot.group, slot.thread, slot.first_value) == vector * kDqGroupFloats;
}
static_assert(dq_chunk_slot_inverts_offset<8>(0) && dq_chunk_slot_inverts_offset<8>(1234) &&
              dq_chunk_slot_inverts_offset<8>(2047) && dq_chunk_slot_inverts_offset<4>(1023) &&
              dq_chunk_slot_inverts_offset<4>(517));

// Stores a consumer's dQ accumulator into the staged tile: one 16-byte store per column group.
template <int kGroupsPerConsumer, class Acc>
__device__ __forceinline__ void stage_dq_tile(float* tile, const Acc& acc, int group, int thread) {
  static_assert(cute::size(Acc{}) == kGroupsPerConsumer * kDqGroupFloats);
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); i += kDqGroupFloats) {
    *reinterpret_cast<float4*>(tile + dq_chunk_offset<kGroupsPerConsumer>(group, thread, i)) =
        make_float4(acc(i), acc(i + 1), acc(i + 2), acc(i + 3));
  }
}

// dq = dq_accum * softmax_scale from the tile-major workspace. CTAs stride over the chunks (query tiles). A chunk
// goes through a row-major shared tile: its float4s are read coalesced (one column group of one consumer thread
// each, every load of a thread issued before the first is used), mapped back to (row, column) by partitioning an
// identity tensor with the consumers' TiledMmaDq and thread index, scaled, converted and stored as pairs of adjacent
// columns; then the rows in bounds go to dq in 16-byte pieces, contiguous along each row. Stored into dq straight
// from the fragment order instead, a warp's stores were 4-byte pieces of 8 different rows, and the pass took twice
// as long as cuDNN's conversion of the same bytes (H200, Nsight Compute, d=64/128 1k causal, 16k tokens: 105/125 us
// against 58/58; staged, 59/51 us); the backward ran 0.2-10% faster so (benchmarks/NOTES.md, twenty-fifth session;
// most at 1k-2k, where the pass is the larger share). The shared rows are padded by 16 bytes: a warp's pair stores
// (8 rows x 4 pairs) then hit 32 different banks. A device function: the family's kernel wraps it.
template <class Traits>
__device__ __forceinline__ void dq_from_tiles(const AttentionBackwardParams& p) {
  using namespace cute;
  using T = typename Traits::OutElement;  // q's type, or float32 (AttentionBackwardParams::float32_gradients)
  struct alignas(2 * sizeof(T)) Pair { T first, second; };
  constexpr int kRows = Traits::kBlockM, kCols = Traits::kDqCols, kHeadDim = Traits::kHeadDim;
  constexpr int kGroupsPerConsumer = kCols / kDqGroupColumns;
  constexpr int kPieceElements = 16 / int(sizeof(T));  // elements of one 16-byte store into dq
  constexpr int kTileStride = kHeadDim + kPieceElements;
  constexpr int kVectorsPerThread = kHeadDim / kDqGroupColumns * kDqStagingThreads / kDqConvertThreads;
  static_assert(kRows == kDqWorkspaceTileRows);
  static_assert(dq_fragments_are_column_grouped<typename Traits::TiledMmaDq, kRows, kCols>());
  static_assert(kHeadDim / kDqGroupColumns * kDqStagingThreads % kDqConvertThreads == 0);
  __shared__ alignas(16) T tile[kRows * kTileStride];
  // head_dim <= kHeadDim, a multiple of 8 (dispatch.cu): whole column groups and whole 16-byte pieces.
  const int head_dim = static_cast<int>(p.head_dim);
  const int vectors_per_chunk = head_dim / kDqGroupColumns * kDqStagingThreads;
  const int pieces_per_row = head_dim / kPieceElements;
  const int64_t tiles = dq_workspace_query_tiles(p.seqlen_q);
  const int64_t chunks = dq_workspace_chunks(p);
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  typename Traits::TiledMmaDq mma_dq;
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const int64_t m0 = chunk % tiles * kRows;
    const int64_t head = chunk / tiles % p.heads_q, batch = chunk / tiles / p.heads_q;
    const float4* accum4 = reinterpret_cast<const float4*>(p.dq_accum) + chunk * vectors_per_chunk;
    float4 sums[kVectorsPerThread];
    CUTE_UNROLL
    for (int i = 0; i < kVectorsPerThread; ++i) {
      const int v = threadIdx.x + i * kDqConvertThreads;
      if (v < vectors_per_chunk) sums[i] = accum4[v];
    }
    CUTE_UNROLL
    for (int i = 0; i < kVectorsPerThread; ++i) {
      const int v = threadIdx.x + i * kDqConvertThreads;
      if (v >= vectors_per_chunk) break;
      const DqChunkSlot slot = dq_chunk_slot<kGroupsPerConsumer>(v);
      Tensor coords =
          mma_dq.get_thread_slice(slot.thread).partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
      const float values[kDqGroupFloats] = {sums[i].x, sums[i].y, sums[i].z, sums[i].w};
      CUTE_UNROLL
      for (int k = 0; k < kDqGroupFloats; k += 2) {
        const int row = get<0>(coords(slot.first_value + k));
        const int col = slot.group * kCols + get<1>(coords(slot.first_value + k));
        *reinterpret_cast<Pair*>(&tile[row * kTileStride + col]) =
            Pair{T(values[k] * p.softmax_scale), T(values[k + 1] * p.softmax_scale)};
      }
    }
    __syncthreads();
    T* dq = static_cast<T*>(p.dq) + q_shape.offset(batch, m0, head);
    const int pieces = static_cast<int>(min(int64_t(kRows), p.seqlen_q - m0)) * pieces_per_row;  // rows in bounds
    for (int piece = threadIdx.x; piece < pieces; piece += kDqConvertThreads) {
      const int row = piece / pieces_per_row, col = (piece - row * pieces_per_row) * kPieceElements;
      // 16-byte aligned: dq is, and so are its rows and heads (head_dim % 8 == 0).
      *reinterpret_cast<uint4*>(dq + row * q_shape.row_stride() + col) =
          *reinterpret_cast<const uint4*>(&tile[row * kTileStride + col]);
    }
    __syncthreads();  // the tile is read before the next chunk overwrites it
  }
}

}  // namespace jax_flash::cuda::sm90
