// The sm80 kernels' batched dropout keep bits (sm80/keep_bits.h: one Philox call per eight elements) against
// the single-element definition dropout_keeps of common/philox.h, for every thread of every accumulator layout
// the kernels use, at random tile origins, heads, seeds and rates. Runs on the CPU (KeepBits is host-callable):
//   g++ -std=c++17 -O1 -I<csrc> -I<cutlass include> -I<cuda>/include [-I<cuda>/include/cccl] keep_bits_check.cc
//   ./a.out   # prints ALL OK; tests/test_dropout_keep_bits.py does this
#include <cstdio>
#include <random>

#include "cuda/sm80/kernel_traits.h"
#include "cuda/sm80/keep_bits.h"

namespace {

using namespace cute;
using namespace jax_flash;
using namespace jax_flash::cuda::sm80;

int failures = 0;

// Every thread of TiledMma's [kBlockM, kBlockN] score tile at `trials` random tile origins (multiples of the
// tile's shape, as in the kernels).
template <class TiledMma, int kBlockM, int kBlockN>
void check(const char* name, int trials, std::mt19937& rng) {
  TiledMma mma;
  using Tile = Shape<Int<kBlockM>, Int<kBlockN>>;
  using Coords = decltype(mma.get_thread_slice(0).partition_C(make_identity_tensor(Tile{})));
  using Keep = KeepBitsFor<Coords>;
  int64_t compared = 0, kept = 0;
  for (int trial = 0; trial < trials; ++trial) {
    SliceDropout d;
    d.seed[0] = rng();
    d.seed[1] = rng();
    const float rate = trial == 0 ? 0.0f : std::uniform_real_distribution<float>(0.02f, 0.98f)(rng);
    d.threshold = dropout_threshold(rate);
    d.keep_scale = 1.0f / (1.0f - rate);
    d.head = rng() % 64;
    const int64_t row0 = int64_t(rng() % 4096) * kBlockM, col0 = int64_t(rng() % 4096) * kBlockN;
    for (int t = 0; t < int(size(mma)); ++t) {
      auto coords = mma.get_thread_slice(t).partition_C(make_identity_tensor(Tile{}));
      Keep keep;
      keep.compute(d, coords, row0, col0);
      for (int v = 0; v < Keep::kElems; ++v) {
        const int64_t i = row0 + get<0>(coords(v)), j = col0 + get<1>(coords(v));
        const bool expected = dropout_keeps(d.seed, d.threshold, d.head, i, j);
        ++compared;
        kept += expected;
        if (keep.kept(v) != expected && ++failures <= 10) {
          std::printf("MISMATCH %s thread %d value %d (i %lld, j %lld)\n", name, t, v, (long long)i, (long long)j);
        }
      }
    }
  }
  std::printf("%-28s %d elements/thread, %d Philox calls/thread, %lld compared, kept fraction %.4f\n", name,
              Keep::kElems, Keep::kCalls, (long long)compared, double(kept) / double(compared));
}

// Distinct elements must draw distinct (call, word, half) triples: the mapping is one-to-one.
void check_mapping_is_injective() {
  const int rows = 48, cols = 200, heads = 2;
  std::vector<uint8_t> seen(size_t(heads) * 8 * 3 * 16 * 4 * 4 * 2, 0);
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j) {
        const size_t call = (size_t(h) * 8 * 3 + dropout_call_row(i)) * 16 * 4 + dropout_call_column(j);
        const size_t slot = (call * 4 + dropout_word(i, j)) * 2 + dropout_half(j);
        if (seen.at(slot)++ && ++failures <= 10) std::printf("COLLISION h %d i %d j %d\n", h, i, j);
      }
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  using Bf16 = cutlass::bfloat16_t;
  check_mapping_is_injective();
  // Forward (4 warps along M; 8 for d >= 192): tiles of forward_tile().
  check<TiledMmaFor<Bf16, 4, 1>, 128, 128>("forward 128x128 (d<=64)", 6, rng);
  check<TiledMmaFor<Bf16, 4, 1>, 128, 64>("forward 128x64 (d=96,128)", 6, rng);
  check<TiledMmaFor<Bf16, 8, 1>, 128, 64>("forward 128x64 8 warps", 6, rng);
  check<TiledMmaFor<Bf16, 8, 1>, 128, 32>("forward 128x32 (d=256)", 6, rng);
  // Backward S/dP (2 x 4 warps): dK/dV pass and dbias.
  check<TiledMmaFor<Bf16, 2, 4>, 64, 128>("backward 64x128", 6, rng);
  check<TiledMmaFor<Bf16, 2, 4>, 64, 64>("backward 64x64", 6, rng);
  // Deterministic dQ pass (4 warps along M).
  check<TiledMmaFor<Bf16, 4, 1>, 64, 64>("dq 64x64", 6, rng);
  check<TiledMmaFor<Bf16, 4, 1>, 64, 32>("dq 64x32", 6, rng);
  std::printf(failures ? "FAILED (%d)\n" : "ALL OK\n", failures);
  return failures ? 1 : 0;
}
