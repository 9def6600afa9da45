// Split TF32 on the Hopper tensor cores (common/tf32_workspace.h): a float32 x is carried as hi = tf32(x) and
// lo = tf32(x - hi), and a product x * y as lo_x * hi_y + hi_x * lo_y + hi_x * hi_y, the lo * lo term (about 2^-22
// of it) left out. Each part keeps 11 significant bits, so the three products are exact in the float32
// accumulator's range, and what is lost is the rounding of lo (2^-11 of lo, i.e. ~2^-22 of x) and the lo * lo term:
// about 2^-21 of each product (a few float32 ulps) before the accumulation's own rounding, at three TF32 WGMMAs
// per GEMM.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "../sm80/fragments.h"
#include "fragments.h"

namespace jax_flash::cuda::sm90 {

// x rounded to TF32, its low 13 bits cleared: exactly the value the tensor cores read, so that x - hi is exact.
__device__ __forceinline__ float tf32_high_part(float x) {
  return __uint_as_float(__float_as_uint(round_to_tf32(x)) & 0xffffe000u);
}

// (hi, lo) of x: hi + lo equals x to within 2^-22 of |x|. Near FLT_MAX rounding would carry hi to infinity (and lo
// to -infinity, so products would turn NaN): there hi is x truncated instead, and lo the (exact) rest.
__device__ __forceinline__ void split_to_tf32(float x, float& hi, float& lo) {
  hi = tf32_high_part(x);
  if (isinf(hi) && isfinite(x)) hi = __uint_as_float(__float_as_uint(x) & 0xffffe000u);
  lo = tf32_high_part(x - hi);
}

// x as hi + lo in the parts' type, one overload set for the pre-pass (split_tf32_prepass.h: float or float16 parts in
// the workspace) and the register splits below (TF32 or float16 parts):
// - split TF32 (split_to_tf32), as float32 bits, or as tfloat32_t register operands;
// - float16 parts (the float16-parts backward, float16_parts_backward_launch.h): hi = fp16(x), lo = fp16(x - hi),
//   x - hi exact in float32. Its operands are scaled so that every x stays below float16's largest and the elements
//   that matter above ~2^-3, under which lo is a float16 subnormal with fewer bits (jax_flash/_half_operands.py
//   FLOAT16_PARTS). Beyond float16's range hi is infinite and lo 0 (not -inf, whose products with hi would be NaN).
__device__ __forceinline__ void split_into_parts(float x, float& hi, float& lo) { split_to_tf32(x, hi, lo); }
__device__ __forceinline__ void split_into_parts(float x, cutlass::tfloat32_t& hi, cutlass::tfloat32_t& lo) {
  float h, l;
  split_to_tf32(x, h, l);
  hi = cutlass::tfloat32_t::bitcast(__float_as_uint(h));
  lo = cutlass::tfloat32_t::bitcast(__float_as_uint(l));
}
__device__ __forceinline__ void split_into_parts(float x, cutlass::half_t& hi, cutlass::half_t& lo) {
  hi = cutlass::half_t(x);
  const float rest = x - float(hi);
  lo = cutlass::half_t(isinf(rest) ? 0.0f : rest);
}

// Register operand parts from float32 accumulators (the probabilities of P V, the float16 parts' P^T, dS^T and dS):
// hi and lo share acc's layout, TF32 or float16 parts by their element type.
template <class Acc, class Part>
__device__ __forceinline__ void split_registers(Acc const& acc, Part& hi, Part& lo) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); ++i) split_into_parts(acc(i), hi(i), lo(i));
}

// issue_wgmma (fragments.h) of A * B; with kSplit the three partial products, the two small ones first, as one
// committed batch, so that the caller's warpgroup_wait<N> counts GEMMs as before. a_lo / b_lo are ignored when
// !kSplit (callers pass the hi parts there).
template <bool kZeroInit, bool kSplit, class TiledMma, class A, class B, class Acc>
__device__ __forceinline__ void issue_wgmma_parts(TiledMma& mma, A& a_hi, A& a_lo, B const& b_hi, B const& b_lo,
                                                  Acc& acc) {
  using namespace cute;
  if constexpr (!kSplit) {
    issue_wgmma<kZeroInit>(mma, a_hi, b_hi, acc);
  } else {
    constexpr bool kRegisterA =
        std::is_same_v<std::remove_cv_t<typename A::value_type>, typename TiledMma::ValTypeA>;
    if constexpr (kRegisterA) {
      warpgroup_fence_operand(a_hi);
      warpgroup_fence_operand(a_lo);
    }
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a_hi); ++k) {
      cute::gemm(mma, a_lo(_, _, k), b_hi(_, _, k), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a_hi); ++k) cute::gemm(mma, a_hi(_, _, k), b_lo(_, _, k), acc);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a_hi); ++k) cute::gemm(mma, a_hi(_, _, k), b_hi(_, _, k), acc);
    warpgroup_commit_batch();
    warpgroup_fence_operand(acc);
    if constexpr (kRegisterA) {
      warpgroup_fence_operand(a_hi);
      warpgroup_fence_operand(a_lo);
    }
  }
}

// The lo parts of a kernel's shared operands, named like its hi parts: with kSplit the storage's `low`
// (backward_traits.h WithLowParts), else the storage itself, so that code naming them compiles for every kernel.
template <bool kSplit, class Storage>
__device__ __forceinline__ auto& low_parts(Storage& smem) {
  if constexpr (kSplit) {
    return smem.low;
  } else {
    return smem;
  }
}

// Float32 accumulators stored as a shared TF32 operand: rounded to TF32, or with kSplit as hi and lo parts.
template <bool kSplit, class Acc, class Hi, class Lo>
__device__ __forceinline__ void store_operand_parts(Acc const& acc, Hi&& hi, Lo&& lo) {
  using T = cutlass::tfloat32_t;
  if constexpr (kSplit) {
    auto hi_part = cute::make_tensor_like<T>(acc);
    auto lo_part = cute::make_tensor_like<T>(acc);
    split_registers(acc, hi_part, lo_part);
    cute::copy(hi_part, hi);
    cute::copy(lo_part, lo);
  } else {
    cute::copy(sm80::converted<T>(acc), hi);
  }
}

// A register operand loaded from shared memory: rounded to TF32 in registers, or with kSplit its two parts (TF32
// numbers already, written by the pre-pass).
template <bool kSplit, class SrcHi, class SrcLo, class Regs>
__device__ __forceinline__ void load_operand_parts(SrcHi const& hi, SrcLo const& lo, Regs& regs_hi, Regs& regs_lo) {
  cute::copy(hi, regs_hi);
  if constexpr (kSplit) {
    cute::copy(lo, regs_lo);
  } else {
    round_tf32_registers(regs_hi);
  }
}

// Split TF32's GEMMs whose K runs over the whole sequence (dK, dV over the queries, dQ and the d=64 forward's P V
// over the keys) sum each item's (or key tile's) products in `partial`, a fresh accumulator, and add it to the
// running total here with float32 adds, which round to nearest. Accumulating in the tensor cores instead adds every
// k-step's products into the float32 accumulator with a rounding toward zero (Fasi et al., "Numerical behavior of
// NVIDIA tensor cores", 2021, measured this truncation on V100 to A100), each losing up to an ulp of the total in
// the same direction: after the few hundred WGMMAs of a 1000-query key block the total is ~1e-5 low, past the exact
// mode's bound (benchmarks/emulate_split_products.py --accumulate models both; NOTES, thirty-sixth session, has the
// failing H200 cases this explains). Within an item the chain is short and the partial small.
template <class Total, class Partial>
__device__ __forceinline__ void add_partial_sums(Total& total, Partial& partial) {
  cute::warpgroup_fence_operand(partial);  // read after the WGMMA that wrote it has retired
  CUTE_UNROLL
  for (int i = 0; i < cute::size(total); ++i) total(i) += partial(i);
}

// Where an item's GEMM accumulates: with kPartials `partial` (zero-initialised by the GEMM, added to the total
// afterwards by add_partial_sums), else the total itself.
template <bool kPartials, class Acc>
__device__ __forceinline__ Acc& gemm_target(Acc& total, Acc& partial) {
  if constexpr (kPartials) {
    return partial;
  } else {
    return total;
  }
}

}  // namespace jax_flash::cuda::sm90
