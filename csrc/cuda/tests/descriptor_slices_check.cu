// The Hopper kernels build their WGMMA shared-memory descriptors from the slice of their warpgroup's first thread
// (a warp-uniform value, fragments.h warp_uniform), not from the thread's own: that is only right if every thread of
// a warpgroup gets the same operand slice. This check runs CuTe's partitioning on the CPU (nvcc for CuTe's host
// code; no GPU) for every shared-memory operand the forward, dK/dV and dQ kernels slice that way, and compares each
// thread's element addresses with its warpgroup's first thread's. As a control, with several warpgroups along M the A
// slices of warpgroups 0 and 1 must differ (so the comparison can see a wrong slice) and the B slices must agree.
// Prints ALL OK and exits 0 when every operand agrees.
#include <cstdio>
#include <vector>

#include <cute/tensor.hpp>

#include "cuda/sm90/backward_traits.h"
#include "cuda/sm90/kernel_traits.h"

using namespace cute;
using namespace jax_flash::cuda::sm90;
using Elem = cutlass::bfloat16_t;

alignas(1024) static Elem arena[1 << 21];
static int failures = 0;

// Byte offsets of thread t's slice of `smem` as operand A (kA) or B of `mma`.
template <bool kA, class TiledMma, class Smem>
std::vector<long> slice_addresses(TiledMma const& mma, Smem const& smem, int t) {
  auto thr = mma.get_thread_slice(t);
  auto part = [&] {
    if constexpr (kA) {
      return thr.partition_A(smem);
    } else {
      return thr.partition_B(smem);
    }
  }();
  std::vector<long> addresses(size(part));
  for (int i = 0; i < size(part); ++i) {
    addresses[i] = reinterpret_cast<const char*>(&part(i)) - reinterpret_cast<const char*>(arena);
  }
  return addresses;
}

template <bool kA, class TiledMma, class Smem>
void check(const char* kernel, const char* operand, TiledMma const& mma, Smem const& smem) {
  constexpr int kThreads = decltype(size(mma))::value;
  int bad = 0;
  for (int t = 0; t < kThreads; ++t) {
    if (slice_addresses<kA>(mma, smem, t) != slice_addresses<kA>(mma, smem, t / 128 * 128)) {
      if (bad < 3) std::printf("%s %s: thread %d's slice differs from thread %d's\n", kernel, operand, t, t / 128 * 128);
      ++bad;
    }
  }
  // The control: warpgroups along M (the kernels' only multi-warpgroup MMAs) own different rows of A and
  // share B.
  const char* control = "";
  if constexpr (kThreads >= 256) {
    const bool differ = slice_addresses<kA>(mma, smem, 0) != slice_addresses<kA>(mma, smem, 128);
    if (differ != kA) {
      std::printf("%s %s: warpgroups 0 and 1 %s\n", kernel, operand, kA ? "share A" : "differ on B");
      ++bad;
    }
    control = kA ? ", warpgroups differ" : ", warpgroups share it";
  }
  std::printf("%-28s %-4s %-8s threads %3d: %s%s\n", kernel, kA ? "A" : "B", operand, kThreads,
              bad ? "MISMATCH" : "one slice per warpgroup", control);
  failures += bad;
}

template <class Layout>
auto smem_tensor(Layout layout) {
  return make_tensor(make_smem_ptr(arena), layout);
}

template <int D, RowTile kRows = RowTile::kStandard>
void forward(const char* name) {
  using Tr = ForwardTraits<D, Elem, kRows>;
  typename Tr::TiledMmaS mma_s;
  typename Tr::TiledMmaO mma_o;
  auto sK = smem_tensor(typename Tr::SmemLayoutKV{});
  auto sVt = smem_tensor(typename Tr::SmemLayoutVt{});
  check<true>(name, "Q", mma_s, smem_tensor(typename Tr::SmemLayoutQ{}));
  for (int stage = 0; stage < size<2>(sK); ++stage) check<false>(name, "K", mma_s, sK(_, _, stage));
  for (int stage = 0; stage < size<2>(sVt); ++stage) check<false>(name, "V^T", mma_o, sVt(_, _, stage));
}

template <int D>
void dkdv(const char* name) {
  using Tr = DkdvTraits<D, Elem>;
  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmaDkv mma_dkv;
  typename Tr::TiledMmaDq mma_dq;
  auto sQ = smem_tensor(typename Tr::SmemLayoutQ{});
  auto sQt = smem_tensor(typename Tr::SmemLayoutQt{});
  auto sDs = smem_tensor(typename Tr::SmemLayoutDs{});
  check<true>(name, "K / V", mma_sdp, smem_tensor(typename Tr::SmemLayoutKV{}));
  for (int stage = 0; stage < size<2>(sQ); ++stage) {
    check<false>(name, "Q / dO", mma_sdp, sQ(_, _, stage));
    check<false>(name, "Q^T/dO^T", mma_dkv, sQt(_, _, stage));
  }
  for (int buffer = 0; buffer < size<2>(sDs); ++buffer) check<true>(name, "dS", mma_dq, sDs(_, _, buffer));
  check<false>(name, "K^T", mma_dq,
               local_tile(smem_tensor(typename Tr::SmemLayoutKt{}),
                          Shape<Int<Tr::kDqCols>, Int<Tr::kBlockN>>{}, make_coord(0, 0)));
}

template <int D>
void dq(const char* name) {
  using Tr = DqTraits<D, Elem>;
  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmaDq mma_dq;
  auto sK = smem_tensor(typename Tr::SmemLayoutKV{});
  auto sKt = smem_tensor(typename Tr::SmemLayoutKt{});
  check<true>(name, "Q / dO", mma_sdp, smem_tensor(typename Tr::SmemLayoutQ{}));
  for (int stage = 0; stage < size<2>(sK); ++stage) {
    check<false>(name, "K / V", mma_sdp, sK(_, _, stage));
    check<false>(name, "K^T", mma_dq, sKt(_, _, stage));
  }
}

int main() {
  forward<64>("forward d=64");
  forward<64, RowTile::kTwoPerSm>("forward d=64 two per SM");
  forward<64, RowTile::kThreePerSm>("forward d=64 three per SM");
  forward<64, RowTile::kThreePerSmWideKeys>("forward d=64 three per SM, wide keys");
  forward<64, RowTile::kLong>("forward d=64 long rows");
  forward<64, RowTile::kWideKeys>("forward d=64 wide keys");
  forward<128>("forward d=128");
  forward<128, RowTile::kShort>("forward d=128 short rows");
  forward<256>("forward d=256");
  dkdv<64>("dK/dV d=64");
  dkdv<128>("dK/dV d=128");
  dq<64>("dQ d=64");
  dq<128>("dQ d=128");
  dq<256>("dQ d=256");
  std::printf("%d failures\n", failures);
  if (failures == 0) std::printf("ALL OK\n");
  return failures != 0;
}
