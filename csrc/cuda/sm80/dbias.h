// dbias, the gradient of the additive bias: dS = P (dropout(dP) - D) summed over the axes the bias is broadcast
// along. How it is formed (backward_launch.h picks):
//   - no dbias element is shared by two score elements (the bias has the full shape, or broadcasts only along
//     axes of extent 1): the dQ pass stores each dS, no atomics, deterministic;
//   - shared elements, deterministic=False: the dQ pass adds each dS with a float32 atomicAdd;
//   - shared elements, deterministic=True: dbias_kernel below. One CTA owns one block of dbias (a query tile x
//     key tile of one non-broadcast (batch, head) slice) and loops over every score tile that sums into it, in
//     a fixed order, recomputing S and dP (two small GEMMs per tile), accumulating dS in registers; a fixed-order
//     pass over shared memory then sums rows/columns along a broadcast query/key axis. No atomics, so the
//     result is bit-identical run to run.
// Elements no visible score reaches stay 0 (the dispatcher zero-fills dbias first).
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../common/block_range.h"
#include "../common/dbias_plan.h"
#include "fragments.h"
#include "gmem_tile.h"
#include "kernel_traits.h"
#include "row_stats.h"
#include "score_tile.h"
#include "tensor_offsets.h"

namespace jax_flash::cuda::sm80 {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    dbias_kernel(const AttentionBackwardParams p, bool vectorized, DbiasGrid grid) {
  using namespace cute;
  using T = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  using QTile = TileCopy<T, kBlockM, kHeadDim, kThreads, typename Traits::SmemLayoutQ>;
  using KVTile = TileCopy<T, kBlockN, kHeadDim, kThreads, typename Traits::SmemLayoutKV>;

  extern __shared__ __align__(128) char smem_bytes[];
  T* smem_q = reinterpret_cast<T*>(smem_bytes);
  T* smem_do = smem_q + Traits::kQElems;
  T* smem_k = smem_do + Traits::kQElems;
  T* smem_v = smem_k + Traits::kKVElems;

  const DbiasBlock owned = decode_dbias_block(grid, blockIdx.x);
  const int n_tile = owned.n_tile;
  const int m_tile = owned.m_tile;
  const int64_t slice_head = owned.slice_head;
  const int64_t slice_batch = owned.slice_batch;
  const int64_t outer = owned.outer;
  const DbiasBroadcast bc = grid.broadcast;

  const int tid = threadIdx.x;
  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  auto copy_a = make_tiled_copy_A(Copy_Atom<LdsmCopy, T>{}, mma);
  auto copy_b = make_tiled_copy_B(Copy_Atom<LdsmCopy, T>{}, mma);
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor frag_q = thr_mma.partition_fragment_A(sQ);
  Tensor frag_do = thr_mma.partition_fragment_A(sdO);
  Tensor frag_k = thr_mma.partition_fragment_B(sK);
  Tensor frag_v = thr_mma.partition_fragment_B(sV);
  Tensor smem_q_part = copy_a.get_thread_slice(tid).partition_S(sQ);
  Tensor smem_do_part = copy_a.get_thread_slice(tid).partition_S(sdO);
  Tensor smem_k_part = copy_b.get_thread_slice(tid).partition_S(sK);
  Tensor smem_v_part = copy_b.get_thread_slice(tid).partition_S(sV);

  Tensor coords = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kRowsPerThread = decltype(size<0>(rows_cols(coords.layout())))::value;
  Tensor acc_dbias = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
  clear(acc_dbias);
  auto dbias_rc = as_rows_cols(acc_dbias);

  const BshdShape q_shape = query_shape(p);
  const BshdShape kv_shape = key_shape(p);
  const int64_t group = p.heads_q / p.heads_kv;
  // Members in a fixed order: batch rows, heads, query tiles, key tiles (each only along a broadcast axis).
  for (int64_t mb = 0; mb < (bc.batch ? p.inner_batch : 1); ++mb) {
    const int64_t batch = outer * p.inner_batch + (bc.batch ? mb : slice_batch);
    for (int64_t mh = 0; mh < (bc.head ? p.heads_q : 1); ++mh) {
      const int64_t head = bc.head ? mh : slice_head;
      const ScoreTile<true> scorer = ScoreTile<true>::make(p, batch, head);
      const SliceMask& mask = scorer.mask;
      for (int mm = 0; mm < (bc.query ? grid.m_total : 1); ++mm) {
        const int64_t m0 = int64_t(bc.query ? mm : m_tile) * kBlockM;
        const TileSpan key_tiles = key_tiles_for_rows(mask, m0, kBlockM, kBlockN);
        for (int nn = 0; nn < (bc.key ? grid.n_total : 1); ++nn) {
          const int n_block = bc.key ? nn : n_tile;
          if (n_block < key_tiles.begin || n_block >= key_tiles.end) continue;  // nothing visible
          const int64_t n0 = int64_t(n_block) * kBlockN;
          const int q_rows = static_cast<int>(max(int64_t(0), min(int64_t(kBlockM), mask.valid_q - m0)));
          const int k_rows = static_cast<int>(max(int64_t(0), min(int64_t(kBlockN), mask.valid_k - n0)));
          const int64_t q_offset = q_shape.offset(batch, m0, head);
          const int64_t kv_offset = kv_shape.offset(batch, n0, head / group);
          QTile::load(smem_q, static_cast<const T*>(p.q) + q_offset, q_shape.row_stride(), q_rows, p.head_dim,
                      vectorized);
          QTile::load(smem_do, static_cast<const T*>(p.d_o) + q_offset, q_shape.row_stride(), q_rows,
                      p.head_dim, vectorized);
          KVTile::load(smem_k, static_cast<const T*>(p.k) + kv_offset, kv_shape.row_stride(), k_rows, p.head_dim,
                       vectorized);
          KVTile::load(smem_v, static_cast<const T*>(p.v) + kv_offset, kv_shape.row_stride(), k_rows, p.head_dim,
                       vectorized);
          cp_async_fence();
          RowStats<kRowsPerThread> stats;
          stats.load(p, batch, head, m0, coords);
          cp_async_wait<0>();
          __syncthreads();

          Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
          Tensor acc_dp = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
          KeepBitsFor<decltype(coords)> keep;
          backward_keep_bits(keep, p, batch, head, coords, m0, n0);
          clear(acc_s);
          clear(acc_dp);
          gemm_smem_smem(mma, acc_s, frag_q, frag_k, smem_q_part, smem_k_part, copy_a, copy_b);
          gemm_smem_smem(mma, acc_dp, frag_do, frag_v, smem_do_part, smem_v_part, copy_a, copy_b);
          backward_scores<true, true>(scorer, p, keep, acc_s, acc_dp, coords, stats, m0, n0, kLog2e,
                                      [&](int r, int c, int64_t, int64_t, float dscore) { dbias_rc(r, c) += dscore; });
          __syncthreads();  // everyone is done with the tiles before the next member's loads
        }
      }
    }
  }

  // Stage the block in shared memory, then sum along the broadcast query/key axes in a fixed order.
  float* block_sums = reinterpret_cast<float*>(smem_bytes);
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dbias); ++i) {
    block_sums[get<0>(coords(i)) * kBlockN + get<1>(coords(i))] = acc_dbias(i);
  }
  __syncthreads();
  const int64_t m0 = bc.query ? 0 : int64_t(m_tile) * kBlockM;
  const int64_t n0 = bc.key ? 0 : int64_t(n_tile) * kBlockN;
  const int rows_out = bc.query ? 1 : static_cast<int>(min(int64_t(kBlockM), p.seqlen_q - m0));
  const int cols_out = bc.key ? 1 : static_cast<int>(min(int64_t(kBlockN), p.seqlen_k - n0));
  const int rows_summed = bc.query ? kBlockM : 1;
  const int cols_summed = bc.key ? kBlockN : 1;
  float* dbias = p.dbias + outer * p.bias_strides.outer + (bc.batch ? 0 : slice_batch) * p.bias_strides.batch +
                 (bc.head ? 0 : slice_head) * p.bias_strides.head;
  for (int o = tid; o < rows_out * cols_out; o += kThreads) {
    const int row = o / cols_out;
    const int col = o % cols_out;
    float sum = 0.0f;
    for (int r = 0; r < rows_summed; ++r) {
      for (int c = 0; c < cols_summed; ++c) sum += block_sums[(row + r) * kBlockN + col + c];
    }
    dbias[(m0 + row) * p.bias_strides.query + (n0 + col) * p.bias_strides.key] = sum;
  }
}

}  // namespace jax_flash::cuda::sm80
