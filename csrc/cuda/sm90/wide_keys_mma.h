// The Q K^T MMA atoms of the wide-keys forward tiles (kernel_traits.h RowTile::kWideKeys: 176, 112 and 80 keys), one
// 64 x kBlockN x 16 WGMMA per k step. CuTe defines these shapes only in its extended headers, which its
// ss_op_selector uses under CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED and otherwise covers such a width with narrow
// WGMMAs (eleven 64 x 16 x 16 for 176 keys, and 26/40 bytes of spills at d=128). The extended headers take ~7 s of
// each translation unit's front end, so only the units that instantiate these tiles include this header
// (generate_instantiations.py: the common forms of d=128, 192 and 256); elsewhere WideScoreMma stays incomplete, and
// a unit that instantiated a wide tile without it would fail to compile rather than run the narrow atoms.
#pragma once

// CuTe's SM90 GMMA definitions first: the extended headers add to them in place.
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cute/atom/mma_traits_sm90_gmma_ext.hpp>
#include <cutlass/numeric_types.h>

#include "kernel_traits.h"

namespace jax_flash::cuda::sm90 {

// Both operands K-major (Q and K rows in shared memory), float accumulators.
template <class Element, int kBlockN>
constexpr auto wide_score_atom() {
  using cute::GMMA::Major;
  namespace gmma = cute::SM90::GMMA;
  constexpr bool kBf16 = std::is_same_v<Element, cutlass::bfloat16_t>;
  static_assert(kBf16 || std::is_same_v<Element, cutlass::half_t>, "16-bit operands");
  if constexpr (kBlockN == 176) {
    if constexpr (kBf16) return gmma::MMA_64x176x16_F32BF16BF16_SS<Major::K, Major::K>{};
    else return gmma::MMA_64x176x16_F32F16F16_SS<Major::K, Major::K>{};
  } else if constexpr (kBlockN == 112) {
    if constexpr (kBf16) return gmma::MMA_64x112x16_F32BF16BF16_SS<Major::K, Major::K>{};
    else return gmma::MMA_64x112x16_F32F16F16_SS<Major::K, Major::K>{};
  } else {
    static_assert(kBlockN == 80, "a wide-keys width of kernel_traits.h forward_tile");
    if constexpr (kBf16) return gmma::MMA_64x80x16_F32BF16BF16_SS<Major::K, Major::K>{};
    else return gmma::MMA_64x80x16_F32F16F16_SS<Major::K, Major::K>{};
  }
}

template <class Element, int kBlockN>
struct WideScoreMma {
  using Atom = decltype(wide_score_atom<Element, kBlockN>());
};

}  // namespace jax_flash::cuda::sm90
