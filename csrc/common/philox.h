// Counter-based random bits for attention dropout, identical on every platform (CPU specification, CUDA
// kernels, and the pure-JAX reference in jax_flash/_dropout.py).
//
// Element (h, i, j) of batch row b has the 64-bit linear index  n = (h * seqlen_q + i) * seqlen_k + j.
// Philox-4x32-10 with key dropout_seeds[b] = (k0, k1) and counter (lo32(n / 4), hi32(n / 4), 0, 0) yields four
// 32-bit words; element n takes word n % 4. It is kept when that word >= dropout_threshold(rate).
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

// Words at or above this are kept: round(rate * 2^32), saturated.
JF_HOST_DEVICE uint32_t dropout_threshold(float rate) {
  const double scaled = static_cast<double>(rate) * 4294967296.0;
  return scaled >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(scaled + 0.5);
}

JF_HOST_DEVICE bool dropout_keeps(const uint32_t* seed, uint32_t threshold, int64_t linear_index) {
  const uint64_t block = static_cast<uint64_t>(linear_index) >> 2;
  const PhiloxWords words = philox4x32_10(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, 0u,
                                          seed[0], seed[1]);
  return words.w[linear_index & 3] >= threshold;
}

}  // namespace jax_flash
