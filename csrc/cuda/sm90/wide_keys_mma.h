// The Q K^T MMA atom of the 176-key forward tile (kernel_traits.h RowTile::kWideKeys): one 64 x 176 x 16 WGMMA per
// k step. CuTe's ss_op_selector picks that shape only with CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED and otherwise
// falls back to eleven 64 x 16 x 16 WGMMAs; the extended shapes' headers take ~7 s of every translation unit's
// front end, so only the units that instantiate the tile include this header (generate_instantiations.py), and
// without it kernel_traits.h's WideScoreMma stays incomplete: such a unit fails to compile instead of running the
// narrow atoms.
#pragma once

// CuTe's SM90 GMMA definitions first: the extended headers add to them in place.
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cute/atom/mma_traits_sm90_gmma_ext.hpp>
#include <cutlass/numeric_types.h>

#include "kernel_traits.h"

namespace jax_flash::cuda::sm90 {

template <>
struct WideScoreMma<cutlass::bfloat16_t> {
  using Atom = cute::SM90::GMMA::MMA_64x176x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>;
};

template <>
struct WideScoreMma<cutlass::half_t> {
  using Atom = cute::SM90::GMMA::MMA_64x176x16_F32F16F16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>;
};

}  // namespace jax_flash::cuda::sm90
