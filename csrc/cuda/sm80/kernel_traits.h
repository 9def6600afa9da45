// Every compile-time choice of the sm80 kernels, from one table per kernel keyed by head dim (bf16 and fp16
// share tiles: same width, same MMA shape). Shared-memory totals stay under the A100's 163 KiB per block so
// the family runs on every sm_80+ part; the comments give bytes at bf16/fp16.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace jax_flash::cuda::sm80 {

struct ForwardTile {
  int block_m;  // query rows per CTA
  int block_n;  // keys per main-loop step
  int warps;    // all along M: each warp owns whole score rows, so row reductions stay inside a quad
  int stages;   // K/V shared-memory buffers in the cp.async pipeline
};

// Forward. smem = (block_m + stages * 2 * block_n) * head_dim * 2 bytes.
constexpr ForwardTile forward_tile(int head_dim) {
  switch (head_dim) {
    case 32: return {128, 128, 4, 2};   //  40 KiB
    case 64: return {128, 128, 4, 2};   //  80 KiB
    case 96: return {128, 64, 4, 2};    //  72 KiB
    case 128: return {128, 64, 4, 2};   //  96 KiB: two CTAs per SM
    case 192: return {128, 64, 8, 2};   // 144 KiB
    default: return {128, 32, 8, 2};    // 256: 128 KiB (a 64-key step with two stages would need 192 KiB)
  }
}

struct BackwardTile {
  int block_m;   // query rows per inner step
  int block_n;   // keys per CTA: dK and dV of these stay in registers for the whole CTA
  int warps;
  int stages;    // Q/dO shared-memory buffers
};

// dK/dV pass. Warp grids (fixed, see BackwardTraits): S/dP (and the fused dQ) 2x4, dK/dV 4x2, so block_m and
// block_n are multiples of 64; the fused dQ needs no shared memory of its own.
// smem = (stages * 2 * block_m + 2 * block_n) * head_dim * 2 + 2 * block_m * block_n * 2.
constexpr BackwardTile backward_tile(int head_dim) {
  switch (head_dim) {
    case 32: return {64, 128, 8, 2};    //  64 KiB
    case 64: return {64, 128, 8, 2};    //  96 KiB
    case 96: return {64, 128, 8, 2};    // 128 KiB
    case 128: return {64, 128, 8, 2};   // 160 KiB
    case 192: return {64, 64, 8, 2};    // 160 KiB
    default: return {64, 64, 8, 1};     // 256: 144 KiB; two Q/dO stages would need 208 KiB
  }
}

// dQ pass: rows of Q and dO stay resident, K/V stream. smem = (2 * block_m + stages * 2 * block_n)
// * head_dim * 2 bytes.
constexpr ForwardTile dq_tile(int head_dim) {
  return head_dim <= 128 ? ForwardTile{64, 64, 4, 2}    // d=128: 96 KiB
                         : ForwardTile{64, 32, 4, 2};   // d=256: 128 KiB
}

using namespace cute;

template <class Element>
using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>,
                                   MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>,
                                   MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>>;

// A warp grid of warps_m x warps_n MMA atoms; each warp covers 16 columns so one ldmatrix.x4 feeds two atoms.
template <class Element, int kWarpsM, int kWarpsN>
using TiledMmaFor = TiledMMA<MmaAtom<Element>, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                             Tile<Int<16 * kWarpsM>, Int<16 * kWarpsN>, _16>>;

// Row-major tile [rows, cols] in shared memory, XOR-swizzled in 16-byte chunks so that both the row-wise
// cp.async stores and the column-wise ldmatrix reads of 8 rows hit 8 different bank groups.
template <int kRows, int kCols>
constexpr auto swizzled_smem_layout() {
  constexpr int kAtomCols = kCols % 64 == 0 ? 64 : 32;
  constexpr int kSwizzleBits = kAtomCols == 64 ? 3 : 2;
  using Atom = decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                                    Layout<Shape<_8, Int<kAtomCols>>, Stride<Int<kAtomCols>, _1>>{}));
  return tile_to_shape(Atom{}, Shape<Int<kRows>, Int<kCols>>{});
}

// The same smem bytes seen as the transposed tile [cols, rows], for ldmatrix.trans operands.
template <class SmemLayout>
constexpr auto transposed_view(SmemLayout layout) {
  constexpr int kRows = size<0>(SmemLayout{});
  constexpr int kCols = size<1>(SmemLayout{});
  return composition(layout, make_layout(Shape<Int<kCols>, Int<kRows>>{}, GenRowMajor{}));
}

using LdsmCopy = SM75_U32x4_LDSM_N;           // operand stored K-major: rows are the MMA's M or N
using LdsmTransposedCopy = SM75_U16x8_LDSM_T; // operand stored MN-major, e.g. V for P*V

// Kernels that own a block of query rows and stream key tiles (forward, deterministic dQ).
template <int kHeadDim_, class Element_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_>
struct RowBlockTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = kWarps * 32;

  using TiledMma = TiledMmaFor<Element, kWarps, 1>;
  using SmemLayoutQ = decltype(swizzled_smem_layout<kBlockM, kHeadDim>());  // also dO
  using SmemLayoutKV = decltype(swizzled_smem_layout<kBlockN, kHeadDim>());
  using SmemLayoutKVt = decltype(transposed_view(SmemLayoutKV{}));

  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kKVElems = kBlockN * kHeadDim;
  static_assert(kBlockM % (16 * kWarps) == 0 && kBlockN % 16 == 0);
};

template <int kHeadDim, class Element>
using ForwardTraits = RowBlockTraits<kHeadDim, Element, forward_tile(kHeadDim).block_m,
                                     forward_tile(kHeadDim).block_n, forward_tile(kHeadDim).warps,
                                     forward_tile(kHeadDim).stages>;

template <int kHeadDim, class Element>
using DqTraits = RowBlockTraits<kHeadDim, Element, dq_tile(kHeadDim).block_m, dq_tile(kHeadDim).block_n,
                                dq_tile(kHeadDim).warps, dq_tile(kHeadDim).stages>;

template <int kHeadDim_, class Element_>
struct BackwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BackwardTile kTile = backward_tile(kHeadDim);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kWarps = kTile.warps;
  static constexpr int kStages = kTile.stages;
  static constexpr int kThreads = kWarps * 32;
  static_assert(kWarps == 8, "the warp grids below assume 8 warps");

  using TiledMmaSdP = TiledMmaFor<Element, 2, 4>;  // [block_m, block_n] scores and dP
  using TiledMmadKV = TiledMmaFor<Element, 4, 2>;  // [block_n, head_dim] dK and dV

  using SmemLayoutQ = decltype(swizzled_smem_layout<kBlockM, kHeadDim>());  // also dO
  using SmemLayoutQt = decltype(transposed_view(SmemLayoutQ{}));
  using SmemLayoutKV = decltype(swizzled_smem_layout<kBlockN, kHeadDim>());
  using SmemLayoutKt = decltype(transposed_view(SmemLayoutKV{}));  // K as the B operand of the fused dQ = dS K
  using SmemLayoutP = decltype(swizzled_smem_layout<kBlockM, kBlockN>());  // also dS
  using SmemLayoutPt = decltype(transposed_view(SmemLayoutP{}));

  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kKVElems = kBlockN * kHeadDim;
  static constexpr int kPElems = kBlockM * kBlockN;
  static constexpr int kSmemBytes =
      (2 * kStages * kQElems + 2 * kKVElems + 2 * kPElems) * int(sizeof(Element));
  static_assert(kBlockM % 64 == 0 && kBlockN % 64 == 0 && kHeadDim % 32 == 0);

  // Fused dQ: its accumulator spans whole S/dP warp grids (kGridCols columns each), so it is padded past the head
  // dim unless the grid's columns divide it (kDqTileExact).
  static constexpr int kGridCols = int(cute::tile_size<1>(TiledMmaSdP{}));
  static constexpr bool kDqTileExact = kHeadDim % kGridCols == 0;
  static constexpr int kDqTileCols = (kHeadDim + kGridCols - 1) / kGridCols * kGridCols;
  // Fused dQ built for sm_90: that (padded) accumulator staged in the workspace chunk's order (common/dq_accum.h)
  // for its bulk reduction, after kSmemBytes.
  static constexpr int kDqStagingBytes = kBlockM * kDqTileCols * int(sizeof(float));
};

}  // namespace jax_flash::cuda::sm80
