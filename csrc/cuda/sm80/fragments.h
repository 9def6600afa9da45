// Register-fragment views for SM80 16x8x16 MMAs. An accumulator fragment is ((2,2), MMA_M, MMA_N): per atom a
// thread holds 2 adjacent columns in each of 2 rows 8 apart. Softmax wants it as rows x columns; the second
// GEMM wants it as an A operand ((2,2,2), MMA_M, MMA_K), whose k16 slice is two adjacent n8 accumulator tiles.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace jax_flash::cuda::sm80 {

using namespace cute;

// ((2,2), MMA_M, MMA_N) -> ((2, MMA_M), (2, MMA_N)): (row-half, m-atom) x (column-pair, n-atom).
template <class AccLayout>
__device__ constexpr auto rows_cols(AccLayout acc) {
  static_assert(decltype(rank(acc))::value == 3 && decltype(size<0>(acc))::value == 4);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

template <class Tensor>
__device__ auto as_rows_cols(Tensor&& t) {
  return make_tensor(t.data(), rows_cols(t.layout()));
}

// ((2,2), MMA_M, MMA_N) accumulator -> ((2,2,2), MMA_M, MMA_N/2) A operand of an m16n8k16 MMA.
template <class AccLayout>
__device__ constexpr auto accumulator_as_operand_a(AccLayout acc) {
  static_assert(decltype(size<2>(acc))::value % 2 == 0, "k16 slices pair two n8 accumulator tiles");
  auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split), get<2, 1>(split));
}

// Element-type conversion of a whole register fragment (packed cvt instructions, e.g. cvt.rn.bf16x2.f32).
template <class To, class Tensor>
__device__ auto converted(Tensor const& src) {
  using From = typename std::decay_t<Tensor>::value_type;
  constexpr int kSize = decltype(size(src))::value;
  auto dst = make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, kSize> convert;
  *reinterpret_cast<cutlass::Array<To, kSize>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, kSize>*>(src.data()));
  return dst;
}

// acc += A * B, both operands read from shared memory one k16 slice at a time (smem_a/smem_b: this thread's
// partitions; copy_a/copy_b: the tiled ldmatrix copies); the ldmatrix of slice k+1 is
// issued before the MMAs of slice k so shared-memory latency hides behind the tensor cores.
template <class TiledMma, class Acc, class RegA, class RegB, class SmemA, class SmemB, class CopyA, class CopyB>
__device__ void gemm_smem_smem(TiledMma const& mma, Acc& acc, RegA& reg_a, RegB& reg_b, SmemA const& smem_a,
                               SmemB const& smem_b, CopyA const& copy_a, CopyB const& copy_b) {
  auto reg_a_view = copy_a.get_thread_slice(threadIdx.x).retile_D(reg_a);
  auto reg_b_view = copy_b.get_thread_slice(threadIdx.x).retile_D(reg_b);
  constexpr int kSlices = decltype(size<2>(reg_a))::value;
  copy(copy_a, smem_a(_, _, 0), reg_a_view(_, _, 0));
  copy(copy_b, smem_b(_, _, 0), reg_b_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < kSlices; ++k) {
    if (k + 1 < kSlices) {
      copy(copy_a, smem_a(_, _, k + 1), reg_a_view(_, _, k + 1));
      copy(copy_b, smem_b(_, _, k + 1), reg_b_view(_, _, k + 1));
    }
    cute::gemm(mma, reg_a(_, _, k), reg_b(_, _, k), acc);
  }
}

// acc += A * B with A already in registers (softmax probabilities, dS) and B streamed from shared memory.
template <class TiledMma, class Acc, class RegA, class RegB, class SmemB, class CopyB>
__device__ void gemm_reg_smem(TiledMma const& mma, Acc& acc, RegA const& reg_a, RegB& reg_b,
                              SmemB const& smem_b, CopyB const& copy_b) {
  auto reg_b_view = copy_b.get_thread_slice(threadIdx.x).retile_D(reg_b);
  constexpr int kSlices = decltype(size<2>(reg_a))::value;
  copy(copy_b, smem_b(_, _, 0), reg_b_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < kSlices; ++k) {
    if (k + 1 < kSlices) copy(copy_b, smem_b(_, _, k + 1), reg_b_view(_, _, k + 1));
    cute::gemm(mma, reg_a(_, _, k), reg_b(_, _, k), acc);
  }
}

// Sum or max across the 4 threads of a quad, which together hold one accumulator row.
template <class Op>
__device__ __forceinline__ float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  return op(x, __shfl_xor_sync(0xffffffff, x, 2));
}

}  // namespace jax_flash::cuda::sm80
