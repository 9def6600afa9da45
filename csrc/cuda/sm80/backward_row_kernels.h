// The memory-bound pre-pass of the backward: softmax_d = rowsum(dO * O) - dlse.
#pragma once

#include <cstdint>

#include "../../common/attention_params.h"
#include "../../common/dq_workspace.h"
#include "../common/block_range.h"
#include "tensor_offsets.h"

namespace jax_flash::cuda::sm80 {

constexpr int kRowKernelWarps = 8;

// Rows are contiguous head_dim vectors in BSHD, read as 16-byte vectors of `width` elements where the call allows
// (softmax_d_vector_width), one element at a time otherwise. A row gets the fewest lanes that cover it in one
// vector each, rounded up to a power of two so that a row's lanes are an aligned group of the warp (its shuffle
// reduction stays inside the group), at most a warp (wider rows loop). d=128 bf16: 16 lanes, two rows per warp,
// so that each warp keeps twice the bytes in flight of a warp per row.
JF_HOST_DEVICE int softmax_d_lanes_per_row(int64_t head_dim, int width) {
  int lanes = 1;
  while (lanes < 32 && int64_t(lanes) * width < head_dim) lanes *= 2;
  return lanes;
}

template <class T>
JF_HOST_DEVICE int softmax_d_vector_width(const AttentionBackwardParams& p) {
  constexpr int kWidth = 16 / static_cast<int>(sizeof(T));
  const bool aligned = (reinterpret_cast<uintptr_t>(p.o) | reinterpret_cast<uintptr_t>(p.d_o)) % 16 == 0;
  return aligned && p.head_dim % kWidth == 0 ? kWidth : 1;
}

// Rows a lane group takes per CTA where one vector per lane covers a row (d <= 256 at 16 bits, <= 128 in float32):
// their loads are issued together, so that each thread has kRowsInFlight * 32 bytes in flight. With one row per
// group a CTA read 8 KiB and exited, and the pass ran at half the copy rate (71 us for 134 MB at d=128 on the H200).
constexpr int kRowsInFlight = 4;

template <class T>
JF_HOST_DEVICE int softmax_d_rows_per_group(const AttentionBackwardParams& p) {
  const int width = softmax_d_vector_width<T>(p);
  return width > 1 && int64_t(softmax_d_lanes_per_row(p.head_dim, width)) * width >= p.head_dim ? kRowsInFlight : 1;
}

// The grid of softmax_d_kernel (kRowKernelWarps warps per CTA), as the kernel divides the rows among its CTAs.
template <class T>
JF_HOST_DEVICE int64_t softmax_d_rows_per_block(const AttentionBackwardParams& p) {
  return kRowKernelWarps * 32 / softmax_d_lanes_per_row(p.head_dim, softmax_d_vector_width<T>(p)) *
         softmax_d_rows_per_group<T>(p);
}
template <class T>
JF_HOST_DEVICE int64_t softmax_d_blocks(const AttentionBackwardParams& p) {
  return ceil_div(p.batch * p.seqlen_q * p.heads_q, softmax_d_rows_per_block<T>(p));
}

// (batch, head, position) of BSHD row ((b * Sq) + i) * Hq + h. Two 32-bit divisions where the rows fit (always, in
// practice): 64-bit ones are long software sequences, and with one warp per row they were most of this pass's
// instructions (92 us at d=128 4k, 16k tokens and 16 heads under Nsight Compute; its 134 MB of reads take ~33 us at
// 4 TB/s).
struct RowCoord {
  int64_t batch, head, position;
};
JF_HOST_DEVICE RowCoord softmax_d_row_coord(const AttentionBackwardParams& p, int64_t row, int64_t rows) {
  if (rows <= int64_t(UINT32_MAX)) {
    const uint32_t r = static_cast<uint32_t>(row), heads = static_cast<uint32_t>(p.heads_q);
    const uint32_t batch_position = r / heads, seqlen = static_cast<uint32_t>(p.seqlen_q);
    const uint32_t batch = batch_position / seqlen;
    return {batch, r - batch_position * heads, batch_position - batch * seqlen};
  }
  return {row / (p.heads_q * p.seqlen_q), row % p.heads_q, (row / p.heads_q) % p.seqlen_q};
}

// Fused dQ of the sm90 family: the pre-pass also zeroes the dq_accum workspace that the dK/dV pass then adds into
// (common/dq_workspace_tile.h: [batch, heads_q, query tile, 64 * head_dim floats]; the order inside a chunk is the
// family's, so zeroing needs none of it): each row's lanes zero the head_dim floats at its position's offset in its
// chunk; in a partial last tile of n rows, row r also zeroes rows r + n, r + 2n, ... past seqlen_q (each once, the
// tile's rows sharing them instead of its last row zeroing all 64 - n). That saves a memset of the whole workspace
// (twice the bytes of dQ) as a pass of its own. Needs a 16-byte aligned workspace and head_dim % 4 == 0 (the sm90
// fused dQ's conditions).
__device__ __forceinline__ void zero_dq_accum_of_row(const AttentionBackwardParams& p, const RowCoord& at, int lane,
                                                     int lanes) {
  float* chunk = p.dq_accum + dq_workspace_tile_offset(at.batch, at.head, at.position / kDqWorkspaceTileRows,
                                                        p.heads_q, p.seqlen_q, p.head_dim);
  const int64_t tile_row = at.position % kDqWorkspaceTileRows;
  const int64_t rows_left = p.seqlen_q - (at.position - tile_row);
  const int64_t tile_rows = rows_left < kDqWorkspaceTileRows ? rows_left : kDqWorkspaceTileRows;
  for (int64_t row = tile_row; row < kDqWorkspaceTileRows; row += tile_rows) {
    for (int64_t f = row * p.head_dim + 4 * lane; f < (row + 1) * p.head_dim; f += 4 * lanes) {
      *reinterpret_cast<float4*>(chunk + f) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
}

// The CTA's rows: lane group g of G takes rows first + g + r * G, r < kRows (kRows > 1: one vector per lane covers
// a row, and the group's kRows loads of O and dO are issued before any arithmetic).
template <class T, int kWidth, int kRows, bool kZeroDqAccum>
__device__ __forceinline__ void softmax_d_rows_of_width(const AttentionBackwardParams& p) {
  struct alignas(kWidth * sizeof(T)) Vector { T v[kWidth]; };
  const int head_dim = static_cast<int>(p.head_dim);
  const int lanes = softmax_d_lanes_per_row(head_dim, kWidth);
  const int groups = kRowKernelWarps * 32 / lanes;
  const int64_t rows = p.batch * p.seqlen_q * p.heads_q;
  const int64_t first = int64_t(blockIdx.x) * groups * kRows + threadIdx.x / lanes;
  const int lane = threadIdx.x % lanes;
  const T* out = static_cast<const T*>(p.o);
  const T* d_out = static_cast<const T*>(p.d_o);
  float dot[kRows];
  if constexpr (kRows == 1) {
    dot[0] = 0.0f;
    if (first < rows) {  // lanes past the last row still take part in the shuffles below
      for (int c = lane * kWidth; c < head_dim; c += lanes * kWidth) {
        const Vector a = *reinterpret_cast<const Vector*>(out + first * head_dim + c);
        const Vector b = *reinterpret_cast<const Vector*>(d_out + first * head_dim + c);
        for (int k = 0; k < kWidth; ++k) dot[0] += float(a.v[k]) * float(b.v[k]);
      }
    }
  } else {
    const int c = lane * kWidth;
    Vector a[kRows] = {}, b[kRows] = {};  // zeros where a lane has no row or no columns: they add nothing
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = first + int64_t(r) * groups;
      if (row < rows && c < head_dim) {
        a[r] = *reinterpret_cast<const Vector*>(out + row * head_dim + c);
        b[r] = *reinterpret_cast<const Vector*>(d_out + row * head_dim + c);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      dot[r] = 0.0f;
      for (int k = 0; k < kWidth; ++k) dot[r] += float(a[r].v[k]) * float(b[r].v[k]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    for (int offset = lanes / 2; offset > 0; offset /= 2) dot[r] += __shfl_xor_sync(0xffffffff, dot[r], offset);
    const int64_t row = first + int64_t(r) * groups;
    if (row >= rows) continue;
    const RowCoord at = softmax_d_row_coord(p, row, rows);
    if constexpr (kZeroDqAccum) zero_dq_accum_of_row(p, at, lane, lanes);
    if (lane != 0) continue;
    const int64_t stat = row_stat_offset(p, at.batch, at.head, at.position);
    p.softmax_d[stat] = dot[r] - (p.d_lse != nullptr ? p.d_lse[stat] : 0.0f);
  }
}

// A device function so that each kernel family wraps it in a kernel of its own (a template kernel instantiated in
// translation units built for different architectures would be registered twice); its grid: softmax_d_blocks.
// kZeroDqAccum: zero_dq_accum_of_row above.
template <class T, bool kZeroDqAccum = false>
__device__ __forceinline__ void softmax_d_rows(const AttentionBackwardParams& p) {
  constexpr int kWidth = 16 / static_cast<int>(sizeof(T));
  if (softmax_d_vector_width<T>(p) != kWidth) {
    softmax_d_rows_of_width<T, 1, 1, kZeroDqAccum>(p);
  } else if (softmax_d_rows_per_group<T>(p) == kRowsInFlight) {
    softmax_d_rows_of_width<T, kWidth, kRowsInFlight, kZeroDqAccum>(p);
  } else {
    softmax_d_rows_of_width<T, kWidth, 1, kZeroDqAccum>(p);
  }
}

template <class T>
__global__ void __launch_bounds__(kRowKernelWarps * 32) softmax_d_kernel(const AttentionBackwardParams p) {
  softmax_d_rows<T>(p);
}

}  // namespace jax_flash::cuda::sm80
