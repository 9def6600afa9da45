// The sm80 fused dK/dV pass's tail split (csrc/cuda/sm80/dkdv_tail_plan.h): for many grids, every item of every
// tail block is covered by exactly one piece, each piece has at least the minimum of items and its block's slot,
// whole-block CTAs keep their block, and the split is made where a quarter-full last wave would waste most of it.
// Runs on the CPU (g++ -std=c++17 -Icsrc); prints ALL OK and exits 0 when every check holds.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/sm80/dkdv_tail_plan.h"

using namespace jax_flash::cuda::sm80;

namespace {

int failures = 0;
int64_t plans = 0, splits = 0;

void fail(const char* what, int64_t blocks, int64_t items, int64_t wave, int64_t cta) {
  if (++failures <= 20) {
    std::printf("FAIL %s: blocks=%lld items_per_block=%lld wave=%lld cta=%lld\n", what, (long long)blocks,
                (long long)items, (long long)wave, (long long)cta);
  }
}

void check(int64_t blocks, int64_t items, int64_t wave, int64_t capacity) {
  ++plans;
  const DkdvTail tail = plan_dkdv_tail(blocks, items, wave, capacity, nullptr);
  for (int64_t cta = 0; cta < tail.full_blocks && cta < blocks; ++cta) {
    const DkdvSegment s = dkdv_segment_of(tail, cta);
    if (s.block != cta || s.slot != -1 || s.item_begin != 0 || s.item_end < items) {
      fail("a whole-block CTA", blocks, items, wave, cta);
      return;
    }
  }
  if (tail.tail_blocks == 0) {
    if (tail.full_blocks != blocks || tail.ctas() != blocks) {
      fail("no split keeps every block", blocks, items, wave, -1);
    }
    const int64_t rest = blocks % wave;
    if (rest != 0 && rest <= capacity && items >= 8 && wave >= 2 && rest * 4 <= wave) {
      fail("a quarter-full last wave was not split", blocks, items, wave, -1);
    }
    return;
  }
  ++splits;
  if (tail.full_blocks + tail.tail_blocks != blocks || tail.tail_blocks > capacity || tail.full_blocks % wave != 0 ||
      tail.pieces_per_block < 2 || tail.items_per_block != items) {
    fail("the plan's counts", blocks, items, wave, -1);
    return;
  }
  std::vector<int> covered(size_t(tail.tail_blocks) * items, 0);
  for (int64_t cta = tail.full_blocks; cta < tail.ctas(); ++cta) {
    const DkdvSegment s = dkdv_segment_of(tail, cta);
    if (s.slot < 0 || s.slot >= tail.tail_blocks || s.block != tail.full_blocks + s.slot || s.item_begin < 0 ||
        s.item_end > items || s.item_end - s.item_begin < kDkdvTailMinItems) {
      fail("a piece's block or items", blocks, items, wave, cta);
      return;
    }
    for (int i = s.item_begin; i < s.item_end; ++i) ++covered[size_t(s.slot) * items + i];
  }
  for (size_t i = 0; i < covered.size(); ++i) {
    if (covered[i] != 1) {
      fail("a tail item not covered exactly once", blocks, items, wave, int64_t(i));
      return;
    }
  }
}

}  // namespace

int main() {
  // The case that motivated it: d=128 at 16k tokens, 2048 blocks of 64 items (seqlen 4096) on 132 SMs: 68 blocks
  // over 15 waves, cut in 5 (340 pieces of 12-13 items, under 3 rounds of 132).
  const DkdvTail bench = plan_dkdv_tail(2048, 64, 132, 256, nullptr);
  if (bench.full_blocks != 1980 || bench.tail_blocks != 68 || bench.pieces_per_block != 5) {
    fail("the 2048-block plan", 2048, 64, 132, -1);
  }
  if (plan_dkdv_tail(2112, 64, 132, 256, nullptr).tail_blocks != 0) fail("16 whole waves split", 2112, 64, 132, -1);
  if (plan_dkdv_tail(2048, 64, 132, 67, nullptr).tail_blocks != 0) fail("no room for the slots", 2048, 64, 132, -1);
  for (int64_t wave : {1, 2, 3, 7, 108, 132, 264}) {
    for (int64_t items : {1, 2, 3, 4, 5, 8, 16, 17, 63, 64, 256}) {
      for (int64_t blocks = 0; blocks <= 3 * wave + 5; blocks += (wave > 100 ? 7 : 1)) check(blocks, items, wave, 300);
    }
  }
  std::printf("%lld plans, %lld split\n", (long long)plans, (long long)splits);
  if (failures == 0) std::printf("ALL OK\n");
  return failures == 0 ? 0 : 1;
}
