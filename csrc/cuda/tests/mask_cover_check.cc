// QueryTileMaskBlocks::cover (the sm90 forward's key-tile walk: one summary row per query tile, 32-bit offsets)
// says exactly what SliceMaskBlocks::cover says (the sm80 kernels' definition), for random block summaries of every
// broadcast layout, sequence lengths on and off the 64-element block grid, and the tile shapes the kernels use.
// Runs on the CPU (g++ -std=c++17 -Icsrc); prints ALL OK and exits 0 when every cover agrees.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "common/mask_blocks.h"

using jax_flash::AttentionParams;
using jax_flash::MaskCover;

namespace {

int failures = 0;
int64_t compared = 0;

// Every (batch, head, query tile, key tile) of one call: kRows x kCols tiles.
template <int kRows, int kCols>
void compare_tiles(const AttentionParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const jax_flash::SliceMaskBlocks slice = jax_flash::make_slice_mask_blocks(p, b, h);
      for (int64_t row0 = 0; row0 < p.seqlen_q; row0 += kRows) {
        const jax_flash::QueryTileMaskBlocks tile =
            jax_flash::QueryTileMaskBlocks::make<kRows>(p, b, h, row0);
        for (int64_t col0 = 0; col0 < p.seqlen_k; col0 += kCols) {
          const MaskCover want = slice.cover<kRows, kCols>(row0, col0);
          const MaskCover got = tile.cover<kCols>(p, col0);
          ++compared;
          if (want != got && failures++ < 10) {
            std::printf("MISMATCH %dx%d sq=%lld sk=%lld b=%lld h=%lld row0=%lld col0=%lld: want %d got %d\n", kRows,
                        kCols, (long long)p.seqlen_q, (long long)p.seqlen_k, (long long)b, (long long)h,
                        (long long)row0, (long long)col0, int(want), int(got));
          }
        }
      }
    }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  const bool dummy_mask = true;
  for (int trial = 0; trial < 400; ++trial) {
    AttentionParams p{};
    p.batch = 1 + rng() % 3;
    p.heads_q = 1 + rng() % 3;
    const int64_t lengths[] = {1, 17, 64, 65, 127, 128, 129, 200, 256, 300, 513};
    p.seqlen_q = lengths[rng() % 11];
    p.seqlen_k = lengths[rng() % 11];
    p.inner_batch = p.batch;
    p.outer_batch = 1;
    p.mask = &dummy_mask;  // only its presence matters to the summary
    // The summary's axes: batch, head, query and key each full or broadcast (size 1).
    const bool full_b = rng() % 2, full_h = rng() % 2, full_q = rng() % 3 != 0, full_k = rng() % 3 != 0;
    const int64_t nb = full_b ? p.batch : 1, nh = full_h ? p.heads_q : 1;
    const int64_t nq = full_q ? jax_flash::mask_blocks_along(p.seqlen_q) : 1;
    const int64_t nk = full_k ? jax_flash::mask_blocks_along(p.seqlen_k) : 1;
    std::vector<uint8_t> summary(nb * nh * nq * nk);
    const int style = rng() % 3;  // uniform random, mostly visible, mostly hidden
    for (auto& x : summary) {
      const unsigned r = rng() % 10;
      x = style == 0 ? r % 3 : style == 1 ? (r < 8 ? 2 : r % 2) : (r < 8 ? 0 : 1 + r % 2);
    }
    p.mask_blocks = summary.data();
    p.mask_blocks_strides = {nb * nh * nq * nk, full_b ? nh * nq * nk : 0, full_h ? nq * nk : 0, full_q ? nk : 0,
                             full_k ? 1 : 0};
    compare_tiles<128, 128>(p);
    compare_tiles<128, 64>(p);
    compare_tiles<64, 128>(p);
    compare_tiles<64, 64>(p);
    if (trial % 50 == 0) {  // a mask without a summary: every tile partial; no mask: every tile visible
      p.mask_blocks = nullptr;
      compare_tiles<128, 128>(p);
      p.mask = nullptr;
      compare_tiles<128, 64>(p);
    }
  }
  std::printf("%lld tile covers compared, %d mismatches\n", (long long)compared, failures);
  if (failures == 0) std::printf("ALL OK\n");
  return failures == 0 ? 0 : 1;
}
