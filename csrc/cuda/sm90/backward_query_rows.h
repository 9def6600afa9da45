// The store of a Hopper dQ pass's rows (both of its consumer forms: backward_dq_kernel.h and
// backward_dq_tf32_consumer.h).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../sm80/tensor_offsets.h"
#include "forward_kernel.h"  // RowBlock

namespace jax_flash::cuda::sm90 {

// Stores rows [row_begin, row_end) of the [kBlockM, kHeadDim] dQ tile of Traits::OutElement staged in `staged`
// (16-byte chunks: 8 bf16/fp16, 4 float32), or zeros when null.
template <class Traits, class Staged>
__device__ void store_query_rows(const AttentionBackwardParams& p, const RowBlock& rb, Staged const* staged,
                                 int row_begin, int row_end, int thread, int threads) {
  using T = typename Traits::OutElement;
  constexpr int kChunk = 16 / int(sizeof(T));
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  constexpr int kChunksPerRow = Traits::kHeadDim / kChunk;
  const int chunks_in_bounds = static_cast<int>(p.head_dim / kChunk);
  const int rows = min(row_end, rb.rows_in_bounds) - row_begin;
  for (int i = thread; i < rows * kChunksPerRow; i += threads) {
    const int row = row_begin + i / kChunksPerRow, chunk = i % kChunksPerRow;
    if (chunk < chunks_in_bounds) {
      T* dst = static_cast<T*>(p.dq) + q_shape.offset(rb.batch, rb.m0 + row, rb.head) + chunk * kChunk;
      *reinterpret_cast<uint4*>(dst) =
          staged ? *reinterpret_cast<const uint4*>(&(*staged)(row, chunk * kChunk)) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Stores the float32 dQ accumulator tile `acc` (the fragment of `mma`, whose tile is [kRows, kCols]: the row block's
// rows, held by its thread `thread`) straight into p.dq, leaving out rows past rows_in_bounds and columns past
// head_dim: float32 gradients of float16 operands (backward_key_block.h store_float_key_rows says why and how).
template <int kRows, int kCols, class TiledMma, class Acc>
__device__ __forceinline__ void store_float_query_rows(const AttentionBackwardParams& p, const RowBlock& rb,
                                                       TiledMma const& mma, int thread, Acc const& acc) {
  using namespace cute;
  const sm80::BshdShape q_shape = sm80::query_shape(p);
  Tensor coords = mma.get_thread_slice(thread).partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
  float* base = static_cast<float*>(p.dq) + q_shape.offset(rb.batch, rb.m0, rb.head);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int row = get<0>(coords(i)), col = get<1>(coords(i));
    if (row < rb.rows_in_bounds && col < p.head_dim) base[row * q_shape.row_stride() + col] = acc(i);
  }
}

}  // namespace jax_flash::cuda::sm90
