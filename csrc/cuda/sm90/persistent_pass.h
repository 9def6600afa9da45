// The persistent grids' tile order (forward_kernel.h, backward_dkdv_kernel.h): a grid of `ctas` CTAs walks its
// `tiles` tiles (or key blocks) in passes of ctas each.
#pragma once

#include <cstdint>

namespace jax_flash::cuda::sm90 {

// The tile that CTA `cta` of a `ctas`-CTA grid runs in pass `pass` (tiles pass * ctas .. + ctas - 1; the CTA takes
// part while pass * ctas + cta < tiles): position cta of the pass on even passes, the mirror position on odd ones.
// Causal tiles get shorter along the order, so a CTA that drew one of a pass's long tiles draws one of the next
// pass's short ones. Bands narrower than the grid (split_tile) mix long and short tiles inside one pass, and the
// plain stride hands the same CTAs the long tiles pass after pass. Measured on the H200 (benchmarks/results/
// env_ab_NVIDIA_H200_2026-12-02_bands{_unmirrored,}.json): with the default 4 MiB bands, mirrored against plain
// stride, -3% to +5% (d=256 2048 keys 496 against 473 TFLOP/s); it does not rescue wider bands (16 MiB, d=256 at
// 512-2048 keys: still 6-23% slower than no bands). The per-tile grid has a single pass: tile = cta.
__device__ __forceinline__ uint32_t pass_tile(uint32_t pass, uint32_t cta, uint32_t ctas, uint32_t tiles) {
  const uint32_t first = pass * ctas;
  const uint32_t in_pass = min(ctas, tiles - first);
  return first + ((pass & 1) ? in_pass - 1 - cta : cta);
}

}  // namespace jax_flash::cuda::sm90
