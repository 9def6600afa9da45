// fully_visible_query_tiles (csrc/cuda/common/block_range.h: the closed form the Hopper dK/dV consumers use once per
// key block) names exactly the query tiles that tile_fully_visible (the per-tile definition) accepts, for random
// slice masks: causal offsets, windows, GQA row packing, lengths on and off the tile grid, segment ids, and the
// tile shapes of the kernels. Runs on the CPU (g++ -std=c++17 -Icsrc); prints ALL OK and exits 0 when they agree.
#include <cstdint>
#include <cstdio>
#include <random>

#include "cuda/common/block_range.h"

using jax_flash::SliceMask;
using jax_flash::cuda::TileSpan;

namespace {

int failures = 0;
int64_t compared = 0;
int64_t visible = 0;

void compare(const SliceMask& mask, int64_t key_begin, int keys, int block_m, int64_t seqlen_q) {
  const TileSpan span = jax_flash::cuda::fully_visible_query_tiles(mask, key_begin, keys, block_m);
  for (int64_t m = 0; m * block_m < seqlen_q + 2 * block_m; ++m) {
    const bool want = jax_flash::cuda::tile_fully_visible(mask, m * block_m, block_m, key_begin, keys);
    const bool got = m >= span.begin && m < span.end;
    ++compared;
    visible += want;
    if (want != got && ++failures <= 10) {
      std::printf("FAIL valid_q %lld valid_k %lld shift %lld window %lld/%lld position_shift %d segments %d "
                  "keys [%lld, +%d) block_m %d tile %lld: want %d got %d (span [%d, %d))\n",
                  (long long)mask.valid_q, (long long)mask.valid_k, (long long)mask.diagonal_shift,
                  (long long)mask.window_left, (long long)mask.window_right, mask.position_shift,
                  mask.q_segment_ids != nullptr, (long long)key_begin, keys, block_m, (long long)m, want, got,
                  span.begin, span.end);
    }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(2027);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  static const int32_t segment_ids[1] = {0};
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t seqlen_q = uniform(1, 700), seqlen_k = uniform(1, 700);
    SliceMask mask;
    mask.valid_q = uniform(0, 3) == 0 ? uniform(0, seqlen_q) : seqlen_q;
    mask.valid_k = uniform(0, 3) == 0 ? uniform(0, seqlen_k) : seqlen_k;
    mask.position_shift = static_cast<int32_t>(uniform(0, 4) == 0 ? uniform(1, 3) : 0);
    const int64_t positions = ((seqlen_q - 1) >> mask.position_shift) + 1;
    // Causal with the bottom-right offset, or any shift; windows unbounded, causal (0), or of random widths.
    mask.diagonal_shift = uniform(0, 1) ? seqlen_k - positions : uniform(-400, 400);
    const int kind = static_cast<int>(uniform(0, 3));
    mask.window_right = kind == 0 ? -1 : kind == 1 ? 0 : uniform(0, 300);
    mask.window_left = uniform(0, 2) == 0 ? uniform(0, 300) : -1;
    mask.q_segment_ids = uniform(0, 9) == 0 ? segment_ids : nullptr;
    mask.kv_segment_ids = mask.q_segment_ids;
    for (int keys : {64, 128}) {
      for (int block_m : {32, 64, 128}) {  // 32: the TF32 dK/dV consumer at d=128
        for (int64_t key_begin = 0; key_begin < seqlen_k + keys; key_begin += keys) {
          compare(mask, key_begin, keys, block_m, seqlen_q);
        }
      }
    }
  }
  std::printf("%lld tiles compared (%lld fully visible), %d failures\n", (long long)compared, (long long)visible,
              failures);
  if (failures == 0) std::printf("ALL OK\n");
  return failures == 0 ? 0 : 1;
}
