// Row-wise steps of the CPU kernels: turning a row of raw dot products into masked scores, and the
// exponentials of the softmax (a vectorisable polynomial exp, since libm's expf would dominate the run time).
#pragma once

#include <cstdint>

#include "../common/philox.h"
#include "../common/score_pipeline.h"

namespace jax_flash::cpu {

struct ScoreSettings {
  float softmax_scale;
  float softcap;
};

// scores[c] = score of query row i against key j0 + c for c < tile_cols, -inf where masked (and for
// c >= valid_cols). `dots` may alias `scores`. When softcap_grad is not null it receives d score / d(scaled dot).
void score_row(const SliceMask& mask, const ScoreSettings& settings, int64_t i, int64_t j0, int64_t valid_cols,
               int64_t tile_cols, const float* dots, float* scores, float* softcap_grad);

// row[c] = exp(row[c] - shift) in place for c < n; returns the sum. exp(-inf) is exactly 0.
float exp_shifted_and_sum(float* row, int64_t n, float shift);

// Dropout of one query row: which elements survive and by how much the survivors are scaled.
struct DropoutRow {
  float rate;
  uint32_t threshold;
  const uint32_t* seed;   // this batch row's Philox key
  int64_t head;
  int64_t row;            // the query row i
};

// row[c] *= 1 / (1 - rate) where key j0 + c survives, 0 where it is dropped, for c < n.
void dropout_row(const DropoutRow& dropout, int64_t j0, int64_t n, float* row);

// Largest element of row[0..n), -inf for an all -inf row.
float row_max(const float* row, int64_t n);

}  // namespace jax_flash::cpu
