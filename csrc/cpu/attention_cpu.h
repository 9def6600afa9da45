// The CPU kernels: the executable specification that every CUDA kernel must match.
#pragma once

#include "../common/attention_params.h"

namespace jax_flash::cpu {

// Tile sizes. Memory per worker is O(kQueryTile * kKeyTile + (kQueryTile + kKeyTile) * head_dim).
inline constexpr int64_t kQueryTile = 64;
inline constexpr int64_t kKeyTile = 128;

// Writes p.o and p.lse.
void attention_forward(const AttentionParams& p);

// Writes p.dq, p.dk, p.dv; uses p.softmax_d as workspace. Always deterministic.
void attention_backward(const AttentionBackwardParams& p);

}  // namespace jax_flash::cpu
