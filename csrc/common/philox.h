// Counter-based random bits for attention dropout, identical on every platform (CPU specification, CUDA
// kernels, and the pure-JAX reference in jax_flash/_dropout.py). This file is THE definition: dropout_keeps
// below decides one element; the kernels batch it (sm80 KeepBits) and are tested against it.
//
// One Philox-4x32-10 call gives 128 bits, eight 16-bit draws, and serves eight elements of the same (b, h):
// rows {i, i + 8} of a 16-row block times columns {j, j + 1, j + 32, j + 33} of a 64-column block (j even,
// j % 64 < 32). Those are exactly the elements that one thread holds of two 16x8 tiles of an mma.sync
// accumulator (rows r and r + 8, columns 2c and 2c + 1), for tiles 32 columns apart, which both the forward
// (a warp spans every column) and the backward (four warps side by side, 8 columns each) layouts give a thread.
// For element (b, h, i, j):
//   call row     I = 8 * (i / 16) + i % 8
//   call column  J = 16 * (j / 64) + (j % 32) / 2
//   Philox-4x32-10 with key dropout_seeds[b] = (k0, k1) and counter (J, I, 0, h) gives words w[0..3];
//   the element's draw u is the 16-bit half (j % 2) of word w[2 * ((i / 8) % 2) + (j / 32) % 2]
//   (half 0: the low 16 bits, half 1: the high 16 bits);
//   it is kept when u >= dropout_threshold(rate) = round(rate * 65536), saturated at 65535.
// (i, j, h below 2^32; the head sits in the last counter word so that, the third being 0, the first round has
// one multiplication.) The drop probability is threshold / 65536: the rate is quantised to multiples
// of 1/65536 (0.1 drops with probability 6554/65536 = 0.1000061), while kept elements are scaled by the nominal
// 1 / (1 - rate), a relative bias of at most 2^-17 / (1 - rate) in the expectation.
#pragma once

#include <cstdint>

#include "score_pipeline.h"

namespace jax_flash {

struct PhiloxWords {
  uint32_t w[4];
};

JF_HOST_DEVICE PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                         uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// Draws at or above this are kept: round(rate * 65536), saturated at 65535 (so some elements survive any
// rate below 1).
JF_HOST_DEVICE uint32_t dropout_threshold(float rate) {
  const double scaled = static_cast<double>(rate) * 65536.0;
  return scaled >= 65535.0 ? 0xFFFFu : static_cast<uint32_t>(scaled + 0.5);
}

// The Philox call that holds element (h, i, j)'s draw (the call of the mapping above).
JF_HOST_DEVICE uint32_t dropout_call_row(int64_t i) { return static_cast<uint32_t>(8 * (i >> 4) + (i & 7)); }
JF_HOST_DEVICE uint32_t dropout_call_column(int64_t j) {
  return static_cast<uint32_t>(16 * (j >> 6) + ((j & 31) >> 1));
}
JF_HOST_DEVICE PhiloxWords dropout_call(const uint32_t* seed, int64_t head, int64_t i, int64_t j) {
  return philox4x32_10(dropout_call_column(j), dropout_call_row(i), 0u, static_cast<uint32_t>(head), seed[0],
                       seed[1]);
}

// Which of the call's four words, and which 16-bit half of it, is element (i, j)'s draw.
JF_HOST_DEVICE int dropout_word(int64_t i, int64_t j) { return static_cast<int>(2 * ((i >> 3) & 1) + ((j >> 5) & 1)); }
JF_HOST_DEVICE int dropout_half(int64_t j) { return static_cast<int>(j & 1); }

// Whether the draw in 16-bit half `half` of `word` keeps its element.
JF_HOST_DEVICE bool dropout_draw_keeps(uint32_t word, int half, uint32_t threshold) {
  return (half ? word >> 16 : word & 0xFFFFu) >= threshold;
}

// THE definition: whether element (h, i, j) of the batch row with key seed[0..1] survives dropout.
JF_HOST_DEVICE bool dropout_keeps(const uint32_t* seed, uint32_t threshold, int64_t head, int64_t i, int64_t j) {
  const PhiloxWords words = dropout_call(seed, head, i, j);
  return dropout_draw_keeps(words.w[dropout_word(i, j)], dropout_half(j), threshold);
}

}  // namespace jax_flash
