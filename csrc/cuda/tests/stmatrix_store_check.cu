// store_accumulators (csrc/cuda/sm90/fragments.h: stmatrix through CuTe's make_tiled_copy_C) writes every element of
// an accumulator-shaped fragment to the shared-memory address the element-wise copy through the MMA's partition_C
// would, for every destination the kernels stage into: the dK/dV kernels' dS^T buffers and dK/dV staging, the d=192 /
// d=256 split consumer's P^T / dS^T and column slices (and the d=128 float16-parts one's), and the forward's O staging of every row tile. Runs on the CPU
// (nvcc for CuTe's host code; no GPU): CuTe's copy loop is replayed and each stmatrix.x4 applied as PTX defines it
// (lane 8j + r gives the address of row r of matrix j; lane l's register j holds that matrix's row l / 4, columns
// 2 (l % 4) and + 1). A control with a swizzle of 8-byte units must come out different, so the check can fail.
// Prints ALL OK and exits 0 when every destination agrees.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cute/tensor.hpp>
#include "cuda/sm90/backward_traits.h"
#include "cuda/sm90/kernel_traits.h"
#include "cuda/sm90/fragments.h"

using namespace cute;
using namespace jax_flash::cuda::sm90;
using Elem = cutlass::bfloat16_t;

alignas(1024) static Elem arena[1 << 20];
static int failures = 0;  // over the kernels' destinations

// CuTe's copy(Copy_Atom, src, dst) loop: all but the first mode, then Copy_Atom::call peels nested first modes
// until a leaf of the atom's 8 values.
template <class S, class D, class F>
void leaves(S const& src, D const& dst, F&& f) {
  constexpr int R = decltype(rank(src))::value;
  if constexpr (R == 1) {
    if constexpr (decltype(size(src))::value == 8) {
      f(src, dst);
    } else {
      leaves(tensor<0>(src), tensor<0>(dst), f);
    }
  } else {
    Tensor s2 = group_modes<1, R>(src);
    Tensor d2 = group_modes<1, R>(dst);
    for (int k = 0; k < size<1>(s2); ++k) leaves(s2(_, k), d2(_, k), f);
  }
}

// The problems found for one destination (0: the same address for every element).
template <class TiledMma, class Dst>
int compare(const char* name, TiledMma const& mma, Dst const& dst) {
  int problems = 0;
  const char* base = reinterpret_cast<const char*>(arena);
  constexpr int kThreads = decltype(size(mma))::value;
  auto tile_shape = make_shape(size<0>(dst), size<1>(dst));
  auto frag_layout = partition_fragment_C(mma, tile_shape).layout();
  constexpr int kVals = decltype(size(frag_layout))::value;
  // element-wise addresses
  std::vector<long> want(kThreads * kVals), got(kThreads * kVals, -1);
  for (int t = 0; t < kThreads; ++t) {
    auto part = mma.get_thread_slice(t).partition_C(dst);
    static_assert(decltype(size(part))::value == kVals);
    for (int i = 0; i < kVals; ++i) want[t * kVals + i] = reinterpret_cast<const char*>(&part(i)) - base;
  }
  auto tiled_copy = accumulator_stmatrix_copy<Elem>(mma);  // store_accumulators' copy
  // per thread, per copy iteration: 4 registers (two fragment indices each) and one row address
  int iters = -1;
  std::vector<std::vector<std::array<int, 8>>> regs(kThreads);
  std::vector<std::vector<long>> addr(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    auto thr = tiled_copy.get_thread_slice(t);
    Tensor frag = make_tensor<uint16_t>(frag_layout);
    for (int i = 0; i < kVals; ++i) frag(i) = uint16_t(i);
    Tensor src = thr.retile_S(frag);
    Tensor dpart = thr.partition_D(dst);
    leaves(src, dpart, [&](auto const& sa, auto const& da) {
      Tensor rs = recast<uint32_t>(sa);
      Tensor rd = recast<cute::uint128_t>(da);
      if (size(rs) != 4 || size(rd) != 1) { std::printf("%s: not vectorised\n", name); ++problems; return; }
      std::array<int, 8> r;
      for (int j = 0; j < 4; ++j) {
        uint32_t v = rs(j);
        r[2 * j] = v & 0xffff;
        r[2 * j + 1] = v >> 16;
      }
      regs[t].push_back(r);
      long a = reinterpret_cast<const char*>(&rd(0)) - base;
      if (a % 16 != 0) { std::printf("%s: misaligned row address %ld\n", name, a); ++problems; }
      addr[t].push_back(a);
    });
    iters = regs[t].size();
  }
  // stmatrix.x4: matrix j's row r address from lane 8j + r; lane l's register j holds row l/4, cols 2(l%4), +1
  for (int t = 0; t < kThreads; ++t) {
    const int warp = t / 32, l = t % 32;
    for (int k = 0; k < iters; ++k) {
      for (int j = 0; j < 4; ++j) {
        const long row = addr[warp * 32 + 8 * j + l / 4][k];
        for (int h = 0; h < 2; ++h) {
          const int i = regs[t][k][2 * j + h];
          if (got[t * kVals + i] != -1) {
            std::printf("%s: element (%d, %d) stored twice\n", name, t, i);
            ++problems;
          }
          got[t * kVals + i] = row + (2 * (l % 4) + h) * 2;
        }
      }
    }
  }
  int bad = 0;
  for (int n = 0; n < kThreads * kVals; ++n) {
    if (got[n] != want[n]) {
      if (bad < 5) std::printf("%s: thread %d value %d: stmatrix %ld, element-wise %ld\n", name, n / kVals, n % kVals,
                               got[n], want[n]);
      ++bad;
    }
  }
  problems += bad;
  std::printf("%-60s threads %3d values %3d iterations %2d: %s\n", name, kThreads, kVals, iters,
              problems ? "MISMATCH" : "same addresses");
  return problems;
}

template <class TiledMma, class Dst>
void check(const char* name, TiledMma const& mma, Dst const& dst) {
  failures += compare(name, mma, dst);
}

template <int D>
void dkdv() {
  using Tr = DkdvTraits<D, Elem>;
  char name[128];
  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmaDkv mma_dkv;
  Tensor sDsT = make_tensor(make_smem_ptr(arena), typename Tr::SmemLayoutDsT{});
  for (int b = 0; b < 2; ++b) {
    std::snprintf(name, sizeof name, "dkdv d=%d dS^T buffer %d", D, b);
    check(name, mma_sdp, sDsT(_, _, b));
  }
  for (int buf = 0; buf < Tr::kKvBuffers; ++buf) {
    Tensor sV = make_tensor(make_smem_ptr(arena + buf * cosize_v<typename Tr::SmemLayoutKV>),
                            typename Tr::SmemLayoutKV{});
    std::snprintf(name, sizeof name, "dkdv d=%d dK/dV staging kv buffer %d", D, buf);
    check(name, mma_dkv, sV);
  }
}

// kParts: the float16-parts kernel's tiles (float16 elements: the same 16-bit layouts), whose P^T / dS^T hi and lo
// buffers share SmemLayoutPdS.
template <int D, bool kParts = false>
void split() {
  using Tr = std::conditional_t<kParts, DkdvSplitTraits<D, cutlass::half_t, float, true>, DkdvSplitTraits<D, Elem>>;
  char name[128];
  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmaDkv mma_dkv;
  Tensor sP = make_tensor(make_smem_ptr(arena), typename Tr::SmemLayoutPdS{});
  Tensor sV = make_tensor(make_smem_ptr(arena), typename Tr::SmemLayoutKV{});
  volatile int groups = 2;
  for (int g = 0; g < groups; ++g) {
    Tensor mine = local_tile(sP, Shape<Int<Tr::kBlockN>, Int<Tr::kQueryCols>>{}, make_coord(0, g));
    for (int b = 0; b < 2; ++b) {
      std::snprintf(name, sizeof name, "split d=%d%s P^T/dS^T group %d buffer %d", D, kParts ? " parts" : "", g, b);
      check(name, mma_sdp, mine(_, _, b));
    }
    std::snprintf(name, sizeof name, "split d=%d%s dK/dV staging group %d", D, kParts ? " parts" : "", g);
    check(name, mma_dkv, local_tile(sV, Shape<Int<Tr::kBlockN>, Int<Tr::kDkvCols>>{}, make_coord(0, g)));
  }
}

template <int D, RowTile kRows = RowTile::kStandard>
void forward(const char* rows) {
  using Tr = ForwardTraits<D, Elem, kRows>;
  char name[128];
  typename Tr::TiledMmaO mma_o;
  Tensor sO = make_tensor(make_smem_ptr(arena), typename Tr::SmemLayoutO{});
  std::snprintf(name, sizeof name, "forward d=%d %s (block_m %d) O staging", D, rows, Tr::kBlockM);
  check(name, mma_o, sO);
  if constexpr (Tr::kTmaStoreO) {
    // Each consumer's TMA store of O reads its 64 rows as SmemLayoutORows from 64 x D elements per consumer on.
    typename Tr::SmemLayoutO whole;
    typename Tr::SmemLayoutORows rows64;
    int mismatches = 0;
    for (int r = 0; r < Tr::kBlockM; ++r) {
      for (int k = 0; k < D; ++k) mismatches += whole(r, k) != r / 64 * 64 * D + rows64(r % 64, k);
    }
    std::printf("%s: O buffer against the per-consumer store tiles: %d mismatches\n", name, mismatches);
    failures += mismatches != 0;
  }
}

int main() {
  dkdv<64>();
  dkdv<96>();
  dkdv<128>();
  split<192>();
  split<256>();
  split<128, true>();
  forward<64>("standard");
  forward<64, RowTile::kLong>("long");
  forward<64, RowTile::kShort>("short");
  forward<64, RowTile::kTwoPerSm>("two per SM");
  forward<64, RowTile::kThreePerSm>("three per SM");
  forward<64, RowTile::kThreePerSmWideKeys>("three per SM, wide keys");
  forward<64, RowTile::kWideKeys>("wide keys");
  forward<64, RowTile::kTwoPerSmWideKeys>("two per SM, wide keys");
  forward<96>("standard");
  forward<128>("standard");
  forward<128, RowTile::kShort>("short");
  forward<192>("standard");
  forward<256>("standard");
  {
    // The control: a swizzle of 8-byte units, narrower than stmatrix's 16-byte rows, must not pass.
    using Tr = DkdvTraits<64, Elem>;
    typename Tr::TiledMmaSdP mma_sdp;
    auto layout =
        composition(Swizzle<3, 3, 3>{}, smem_ptr_flag_bits<16>{}, make_layout(Shape<_128, _64>{}, LayoutRight{}));
    Tensor narrow = make_tensor(make_smem_ptr(arena), layout);
    if (compare("control: 8-byte swizzle units (must differ)", mma_sdp, narrow) == 0) {
      std::printf("the control came out equal: this check cannot see a wrong address\n");
      ++failures;
    }
  }

  std::printf("%d failures\n", failures);
  if (failures == 0) std::printf("ALL OK\n");
  return failures != 0;
}
