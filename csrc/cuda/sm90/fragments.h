// Register-fragment views of WGMMA accumulators and the warpgroup GEMM issue sequence.
// A 64xN fp32 accumulator fragment is ((2, 2, N/8), MMA_M, MMA_N): per thread 2 adjacent columns, in 2 rows
// 8 apart, repeated every 8 columns. That is the sm80 m16n8 pattern with the n8 tiles in the value mode, so the
// sm80 score pipeline and row reductions (a row lives in one quad of lanes) apply once the n8 tiles move out.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "../common/async_proxy_fence.h"
#include "../common/named_barrier.h"

namespace jax_flash::cuda::sm90 {

using namespace cute;

// ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2), MMA_M, (N/8, MMA_N)): the sm80 accumulator shape (sm80/fragments.h).
template <class AccLayout>
__device__ constexpr auto as_sm80_accumulator(AccLayout acc) {
  static_assert(decltype(rank<0>(acc))::value == 3);
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc)), get<1>(acc),
                     make_layout(get<0, 2>(acc), get<2>(acc)));
}

template <class Tensor>
__device__ auto sm80_view(Tensor&& t) {
  return make_tensor(t.data(), as_sm80_accumulator(t.layout()));
}

// stmatrix (SM90_U32x4_STSM_N) as a tiled copy of `mma`'s accumulator tile of 16-bit values T; store_accumulators'
// copy, which csrc/cuda/tests/stmatrix_store_check.cu replays on the CPU for every destination of the kernels.
template <class T, class TiledMma>
CUTE_HOST_DEVICE auto accumulator_stmatrix_copy(TiledMma const& mma) {
  return make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, T>{}, mma);
}

// Stores `frag` (16-bit values in the shape of `mma`'s accumulators, e.g. sm80::converted of them) into `dst`, the
// shared-memory tile of the whole MMA (thread `thread` of it), with stmatrix: 8x8 blocks of 16-byte rows, one 32-bit
// shared address per row. An element-wise copy compiles to one generic 32-bit store per adjacent pair instead, each
// with its own 64-bit address and swizzle arithmetic (at d=64: 107 instructions per warp for a 64 x 64 dS^T tile,
// the backward consumers' largest per-item cost; Nsight Compute, benchmarks/NOTES.md, 27th session). dst must hold
// each row's columns (the MMA's N) in contiguous 16-byte runs: the K-major O, dK and dV tiles, the (key, query) dS^T.
template <class TiledMma, class Frag, class Dst>
__device__ __forceinline__ void store_accumulators(TiledMma const& mma, int thread, Frag const& frag, Dst&& dst) {
  using T = typename std::decay_t<Frag>::value_type;
  static_assert(sizeof(T) == 2, "stmatrix moves 16-bit values");
  // CuTe applies a shared-memory swizzle to the byte address and would not notice one that moves pieces smaller than
  // a 16-byte row (the copy's recast ignores it): the GMMA swizzles move 16-byte units or more.
  using DstSwizzle = get_swizzle_t<std::remove_cv_t<std::remove_reference_t<Dst>>>;
  static_assert(DstSwizzle::num_bits == 0 || DstSwizzle::num_base >= 4, "stmatrix writes whole 16-byte rows");
  auto tiled_copy = accumulator_stmatrix_copy<T>(mma);
  auto thread_copy = tiled_copy.get_thread_slice(thread);
  copy(tiled_copy, thread_copy.retile_S(frag), thread_copy.partition_D(dst));
}

// ((2, 2, N/8), MMA_M, MMA_N) accumulator -> ((2, 2, 2), MMA_M, N/16 * MMA_N): the register A operand of a
// 64xKx16 RS WGMMA, whose k16 slice is two adjacent n8 column groups of the accumulator.
template <class AccLayout>
__device__ constexpr auto accumulator_as_operand_a(AccLayout acc) {
  static_assert(decltype(size<0, 2>(acc))::value % 2 == 0);
  auto n8 = logical_divide(get<0, 2>(acc), Shape<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(n8)), get<1>(acc),
                     coalesce(make_layout(get<0, 1>(n8), get<2>(acc))));
}

// ((2, 2, N/8), MMA_M, MMA_N) accumulator -> ((2, 2), MMA_M, N/8 * MMA_N): the register A operand of a 64xKx8 TF32
// RS WGMMA, one n8 column group per k8 slice. The atom's A values are (row, row + 8) x (k-slot q, q + 4) of the lane
// (q = lane % 4), the accumulator's (column 2q, 2q + 1) x (row, row + 8): with the two modes swapped, k-slot q holds
// column 2q and k-slot q + 4 column 2q + 1. So B must hold, in each 8-key chunk, key 2q at k = q and key 2q + 1 at
// k = q + 4 (tf32_v_transpose.h writes V^T in that order); no register moves.
template <class AccLayout>
__device__ constexpr auto accumulator_as_tf32_operand_a(AccLayout acc) {
  static_assert(decltype(rank<0>(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<0, 0>(acc)), get<1>(acc),
                     coalesce(make_layout(get<0, 2>(acc), get<2>(acc))));
}

// Rounds to TF32 (10 mantissa bits, to nearest, ties away: cvt.rna). The tensor cores would truncate the low bits
// of a float32 operand instead, a bias toward zero that sums up over long reductions.
__device__ __forceinline__ float round_to_tf32(float x) {
  uint32_t bits;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
  return __uint_as_float(bits);
}

// Rounds a register operand of TF32 bit patterns (copied raw from float32 tiles) to nearest in place. From the raw
// bits: tfloat32_t's conversion to float clears the low 13 bits first, i.e. truncates.
template <class Registers>
__device__ __forceinline__ void round_tf32_registers(Registers& regs) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(regs); ++i) {
    regs(i) = cutlass::tfloat32_t::bitcast(__float_as_uint(round_to_tf32(__uint_as_float(regs(i).raw()))));
  }
}

// Rounds two float32 shared-memory tiles of `elems` floats each to TF32 in place, the work spread over `threads`
// threads (this one is `thread`), then fences the stores for the WGMMAs (async proxy) and meets the others at named
// barrier `barrier_id`: tiles a CTA keeps for its whole life, rounded once instead of truncated by the tensor cores.
__device__ __forceinline__ void round_tiles_to_tf32(float* a, float* b, int elems, int thread, int threads,
                                                    int barrier_id) {
  for (float* tile : {a, b}) {
    for (int i = thread; i < elems; i += threads) tile[i] = round_to_tf32(tile[i]);
  }
  fence_stores_for_async_proxy();
  named_barrier_sync(barrier_id, threads);
}

// x as lane 0 of the warp has it: a value ptxas knows to be the same in every lane. WGMMA takes its shared-memory
// descriptors in uniform registers; built from a per-thread value (the thread index, a pipeline stage, a buffer
// index), which ptxas cannot prove uniform, each descriptor is computed in every thread's registers and moved over
// (R2UR) before every issue. Built from warp_uniform values, the arithmetic stays in the uniform datapath.
// Every lane must call it with the warp converged.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// A kernel's SharedStorage, reached through its 32-bit shared-window address, computed once and hidden from the
// optimiser; every barrier address and WGMMA descriptor derives from it. Through the extern array itself, ptxas
// rebuilt the window base (an S2UR of SR_CgaCtaId and a ULEA) wherever one was needed: 5-8 times per forward kernel,
// once at the head of every key tile's loop (d=64 three-per-SM tile: 2.3% of that loop's stall samples, forty-seventh
// session). Now the CTA id is read once. (The backward kernels keep the array: pinned, the d=128 dQ kernel grew by
// 40 instructions.)
template <class SharedStorage>
__device__ __forceinline__ SharedStorage& pinned_shared_storage(char* smem_bytes) {
  uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem_bytes));
  asm volatile("" : "+r"(address));
  return *static_cast<SharedStorage*>(__cvta_shared_to_generic(address));
}

// Issues acc (+)= A * B over every k slice as one committed WGMMA batch; the caller waits with
// warpgroup_wait<N>() (N = batches allowed to stay in flight). kZeroInit overwrites acc instead of adding.
template <bool kZeroInit, class TiledMma, class A, class B, class Acc>
__device__ __forceinline__ void issue_wgmma(TiledMma& mma, A& a, B const& b, Acc& acc) {
  // A from registers (P) rather than a shared-memory descriptor: its registers must be fenced too.
  constexpr bool kRegisterA =
      std::is_same_v<std::remove_cv_t<typename A::value_type>, typename TiledMma::ValTypeA>;
  if constexpr (kRegisterA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
  if constexpr (kRegisterA) warpgroup_fence_operand(a);
}

}  // namespace jax_flash::cuda::sm90
