// Dropout keep bits of a thread's accumulator tile, from common/philox.h with one Philox call per eight elements.
#pragma once

#include <cassert>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/philox.h"

namespace jax_flash::cuda::sm80 {

// Dropout of one (batch, head) slice: the keep test of common/philox.h.
struct SliceDropout {
  uint32_t seed[2];
  uint32_t threshold;  // 16-bit draws at or above it are kept
  float keep_scale;    // 1 / (1 - rate)
  int64_t head;

  __device__ static SliceDropout make(const AttentionParams& p, int64_t batch, int64_t head) {
    SliceDropout d;
    d.seed[0] = p.dropout_seeds[2 * batch];
    d.seed[1] = p.dropout_seeds[2 * batch + 1];
    d.threshold = dropout_threshold(p.dropout_rate);
    d.keep_scale = 1.0f / (1.0f - p.dropout_rate);
    d.head = head;
    return d;
  }
};

// Step in (row, column) of one mode of the accumulator coordinates' layout: a stride of the form k@0 (rows) or
// k@1 (columns); a mode of size 1 has stride 0 and no step.
template <class Stride>
struct CoordStep {
  static constexpr int row = 0, col = 0;
};
template <class T>
struct CoordStep<cute::ScaledBasis<T, 0>> {
  static constexpr int row = T::value, col = 0;
};
template <class T>
struct CoordStep<cute::ScaledBasis<T, 1>> {
  static constexpr int row = 0, col = T::value;
};

// Keep bits of the elements of a thread's score accumulator tile, whose (row, column) coordinates in the tile
// have layout CoordLayout (thr_mma.partition_C of an identity tensor).
//
// The accumulators of a TiledMMA of 16x8 atoms are ((2, 2), kTilesM, kTilesN): value (e, a, m, n) lies at the
// thread's origin + (8 a + kRowStep m, e + kColStep n), i.e. columns 2c + e and rows r + 8 a of each atom. With
// the tile at a multiple of its shape (rows of 16, columns of 64 or the tile's width when 32), these four
// elements (e, a) share one Philox call of common/philox.h, and so does atom column n + kPartner of the same
// atom row, 32 columns further right: the forward (a warp spans all columns, kColStep 8) and the backward's S/dP
// (four warps side by side, kColStep 32) both give a thread that atom. So a call serves eight of the thread's
// elements, or four when the tile is only 32 columns wide (kPartner 0).
//
// The calls run in a loop that is deliberately not unrolled (unrolled, Philox's rounds would be replicated per
// call, bloating the kernel and evicting the accumulators from registers). Bits are stored call by call: call g
// holds bits [kUnusedBits + kBitsPerCall g, ...), element (e, a, partner) at e + 2 a + 4 partner; kept(v) maps an
// accumulator index to its bit at compile time when v is a constant (unrolled callers). Host-callable too, so
// that a CPU test (csrc/cuda/tests/keep_bits_check.cc) compares it with dropout_keeps element by element.
template <class CoordLayout>
struct KeepBits {
  using Strides = decltype(cute::stride(CoordLayout{}));
  static constexpr int kTilesM = decltype(cute::size<1>(CoordLayout{}))::value;
  static constexpr int kTilesN = decltype(cute::size<2>(CoordLayout{}))::value;
  static constexpr int kElems = 4 * kTilesM * kTilesN;
  static constexpr int kRowStep = CoordStep<std::decay_t<decltype(cute::get<1>(Strides{}))>>::row;
  static constexpr int kColStep = CoordStep<std::decay_t<decltype(cute::get<2>(Strides{}))>>::col;
  static constexpr int kPartner = kColStep <= 32 && 32 % kColStep == 0 && 32 / kColStep < kTilesN ? 32 / kColStep : 0;
  static constexpr int kBitsPerCall = kPartner ? 8 : 4;
  static constexpr int kCalls = kElems / kBitsPerCall;
  static constexpr int kWords = (kElems + 31) / 32;
  static constexpr int kUnusedBits = 32 * kWords - kElems;  // the calls' bits are shifted in from the top

  // The layout this relies on (one 16x8 atom per (m, n), atom rows 16-aligned, column groups of 64 aligned).
  static_assert(decltype(cute::rank(CoordLayout{}))::value == 3 && decltype(cute::size<0>(CoordLayout{}))::value == 4);
  static_assert(std::is_same_v<std::decay_t<decltype(cute::get<0, 0>(Strides{}))>, cute::ScaledBasis<cute::_1, 1>> &&
                    std::is_same_v<std::decay_t<decltype(cute::get<0, 1>(Strides{}))>, cute::ScaledBasis<cute::_8, 0>>,
                "an atom's (e, a) are columns 2c + e and rows r + 8a");
  static_assert(kTilesM == 1 || (kRowStep > 0 && kRowStep % 16 == 0), "atom rows step down whole 16-row blocks");
  static_assert(kTilesN == 1 || kColStep > 0, "atom columns step right");
  static_assert(kPartner == 0 || (kTilesN % (2 * kPartner) == 0), "partners pair up within 64-column groups");

  uint32_t bits[kWords];

  // row0, col0: the tile's origin in the (batch, head) slice, a multiple of 16 rows and of 64 columns (or of 32
  // for a tile 32 columns wide) -- every tile's origin is a multiple of its shape.
  template <class Coords>
  CUTE_HOST_DEVICE void compute(const SliceDropout& d, Coords const& coords, int64_t row0, int64_t col0) {
    static_assert(std::is_same_v<std::decay_t<decltype(coords.layout())>, CoordLayout>);
    assert(row0 % 16 == 0 && col0 % (kPartner ? 64 : 2) == 0);
    // 32-bit coordinates: the mapping takes rows and columns below 2^32 (common/philox.h).
    const uint32_t thread_row = static_cast<uint32_t>(row0 + cute::get<0>(coords(0)));
    const uint32_t thread_col = static_cast<uint32_t>(col0 + cute::get<1>(coords(0)));
    const uint32_t head = static_cast<uint32_t>(d.head);
    CUTE_UNROLL
    for (int w = 0; w < kWords; ++w) bits[w] = 0;
#pragma unroll 1
    for (int g = 0; g < kCalls; ++g) {
      const int m = g % kTilesM;
      const int n_group = g / kTilesM;
      const int n = kPartner ? (n_group / kPartner) * 2 * kPartner + n_group % kPartner : n_group;
      const uint32_t i = thread_row + kRowStep * m;  // (i, j): element (e, a, partner) = (0, 0, 0) of the call
      const uint32_t j = thread_col + kColStep * n;
      const PhiloxWords words =
          philox4x32_10(dropout_call_column(j), dropout_call_row(i), 0u, head, d.seed[0], d.seed[1]);
      // With a partner, j % 64 < 32 (the tile's alignment) and the element's word is 2a + partner; without
      // one, the column half (j / 32) % 2 picks the word.
      const bool right_half = !kPartner && ((j >> 5) & 1);
      uint32_t call_bits = 0;
      CUTE_UNROLL
      for (int partner = 0; partner < (kPartner ? 2 : 1); ++partner) {
        CUTE_UNROLL
        for (int a = 0; a < 2; ++a) {
          const uint32_t word = kPartner ? words.w[2 * a + partner]
                                         : (right_half ? words.w[2 * a + 1] : words.w[2 * a]);
          CUTE_UNROLL
          for (int e = 0; e < 2; ++e) {
            call_bits |= uint32_t(dropout_draw_keeps(word, e, d.threshold)) << (e + 2 * a + 4 * partner);
          }
        }
      }
      CUTE_UNROLL
      for (int w = 0; w + 1 < kWords; ++w) bits[w] = (bits[w] >> kBitsPerCall) | (bits[w + 1] << (32 - kBitsPerCall));
      bits[kWords - 1] = (bits[kWords - 1] >> kBitsPerCall) | (call_bits << (32 - kBitsPerCall));
    }
  }

  // Bit of accumulator value v = e + 2 a + 4 (m + kTilesM n).
  static constexpr int bit_of(int v) {
    const int ea = v % 4, m = (v / 4) % kTilesM, n = v / (4 * kTilesM);
    const int partner = kPartner ? (n / kPartner) % 2 : 0;
    const int n_group = kPartner ? (n / (2 * kPartner)) * kPartner + n % kPartner : n;
    return kUnusedBits + kBitsPerCall * (m + kTilesM * n_group) + ea + 4 * partner;
  }
  CUTE_HOST_DEVICE bool kept(int v) const {
    const int bit = bit_of(v);
    return (bits[bit / 32] >> (bit % 32)) & 1u;
  }
};

// The keep bits of a thread holding the score accumulators `coords` describes.
template <class Coords>
using KeepBitsFor = KeepBits<std::decay_t<decltype(std::declval<Coords>().layout())>>;

// Stand-in where a kernel never drops (the common variant never asks).
struct NoKeepBits {
  __device__ bool kept(int) const { return true; }
};

}  // namespace jax_flash::cuda::sm80
