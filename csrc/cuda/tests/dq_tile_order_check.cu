// The sm90 fused dQ's tile order (sm90/dq_staging.h) on the CPU, with the kernels' own TiledMmaDq: every
// (consumer, thread, accumulator value) of an item's dQ tile has a distinct staged offset; the conversion's decode
// (dq_chunk_slot plus the TiledMma's coordinates) maps that offset back to the (row, column) the value belongs to;
// and for every head_dim the kernel runs (multiples of 8 up to its width) the offsets of columns < head_dim are
// exactly [0, 64 * head_dim), the prefix the one bulk reduction adds. Host code only (no GPU needed):
//   nvcc -std=c++17 --expt-relaxed-constexpr -I<csrc> -I<cutlass include> dq_tile_order_check.cu && ./a.out
// prints ALL OK; tests/test_dq_tile_order.py does this.
#include <cstdio>
#include <vector>

#include <cute/tensor.hpp>

#include "cuda/sm90/backward_traits.h"
#include "cuda/sm90/dq_staging.h"

namespace {

using namespace cute;
using namespace jax_flash::cuda::sm90;

int failures = 0;

void expect(bool ok, const char* what, int head_dim, int a, int b) {
  if (ok) return;
  if (++failures <= 20) std::printf("FAIL d=%d: %s (%d, %d)\n", head_dim, what, a, b);
}

template <int kHeadDim>
void check() {
  using Traits = DkdvTraits<kHeadDim, cutlass::bfloat16_t>;
  constexpr int kRows = Traits::kBlockM, kCols = Traits::kDqCols, kGroups = Traits::kDqSlices;
  constexpr int kGroupsPerConsumer = Traits::kDqGroupsPerConsumer;
  constexpr int kFloats = kRows * kHeadDim;
  typename Traits::TiledMmaDq mma;
  using Acc = decltype(partition_fragment_C(mma, Shape<Int<kRows>, Int<kCols>>{}));
  constexpr int kValues = int(size(Acc{}));
  // The staged offset of each (row, column) of the tile, from the consumers' side.
  std::vector<int> offset_of(kFloats, -1);
  for (int group = 0; group < kGroups; ++group) {
    for (int thread = 0; thread < kDqStagingThreads; ++thread) {
      auto coords = mma.get_thread_slice(thread).partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
      for (int i = 0; i < kValues; ++i) {
        const int row = get<0>(coords(i)), col = group * kCols + get<1>(coords(i));
        const int offset = dq_chunk_offset<kGroupsPerConsumer>(group, thread, i);
        expect(offset >= 0 && offset < kFloats, "offset inside the tile", kHeadDim, offset, i);
        expect(offset_of[row * kHeadDim + col] == -1, "one value per (row, column)", kHeadDim, row, col);
        offset_of[row * kHeadDim + col] = offset;
        // The conversion's side: the slot of this float4 and the TiledMma's coordinates of its value.
        const DqChunkSlot slot = dq_chunk_slot<kGroupsPerConsumer>(offset / kDqGroupFloats);
        auto back = mma.get_thread_slice(slot.thread)
                        .partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
        const int value = slot.first_value + offset % kDqGroupFloats;
        expect(get<0>(back(value)) == row && slot.group * kCols + get<1>(back(value)) == col,
               "conversion maps the offset back", kHeadDim, row, col);
        if (i % 2 == 1) {  // the conversion's paired stores: values 2k, 2k + 1 adjacent columns of one row
          expect(get<0>(coords(i - 1)) == row && get<1>(coords(i - 1)) + 1 == get<1>(coords(i)),
                 "value pairs are adjacent columns", kHeadDim, row, col);
        }
      }
    }
  }
  for (int offset : offset_of) expect(offset >= 0, "every (row, column) staged", kHeadDim, offset, 0);
  // Head dims that run on this kernel: the columns below head_dim fill the prefix the bulk reduction adds.
  for (int head_dim = 8; head_dim <= kHeadDim; head_dim += 8) {
    for (int row = 0; row < kRows; ++row) {
      for (int col = 0; col < kHeadDim; ++col) {
        const bool in_prefix = offset_of[row * kHeadDim + col] < kRows * head_dim;
        expect(in_prefix == (col < head_dim), "columns < head_dim are the reduced prefix", head_dim, row, col);
      }
    }
  }
  std::printf("d=%d: %d consumers x %d threads x %d values checked\n", kHeadDim, kGroups, kDqStagingThreads, kValues);
}

}  // namespace

int main() {
  check<64>();
  check<128>();
  if (failures == 0) std::printf("ALL OK\n");
  return failures == 0 ? 0 : 1;
}
