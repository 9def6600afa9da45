// Forward pass: for each (batch, query head, query tile), stream the key tiles the tile can see, keeping a
// running row max and row sum (online softmax), so no Sq x Sk matrix ever exists.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_cpu.h"
#include "element_convert.h"
#include "parallel_for.h"
#include "row_ops.h"
#include "slice_view.h"
#include "tile_gemm.h"

namespace jax_flash::cpu {

void attention_forward(const AttentionParams& p) {
  if (p.batch == 0) return;  // every output is empty
  const SliceGeometry geometry(p);
  const int64_t dp = geometry.padded_head_dim;
  const int64_t query_tiles = (p.seqlen_q + kQueryTile - 1) / kQueryTile;
  const ScoreSettings settings{p.softmax_scale, p.softcap};

  parallel_for(p.batch * p.heads_q * query_tiles, [&](int64_t task) {
    const int64_t tile = task % query_tiles;
    const int64_t h = (task / query_tiles) % p.heads_q;
    const int64_t b = task / (query_tiles * p.heads_q);
    const SliceMask mask = make_slice_mask(p, b, h);
    const int64_t i0 = tile * kQueryTile;
    const int64_t rows = std::min(kQueryTile, p.seqlen_q - i0);
    const auto [key_lo, key_hi] = visible_key_range(mask, i0, rows);

    std::vector<float> q_tile(kQueryTile * dp), k_tile(kKeyTile * dp), k_transposed(dp * kKeyTile);
    std::vector<float> v_tile(kKeyTile * dp), scores(kQueryTile * kKeyTile), acc(kQueryTile * dp, 0.0f);
    std::vector<float> running_max(kQueryTile, -std::numeric_limits<float>::infinity());
    std::vector<float> running_sum(kQueryTile, 0.0f);

    load_rows(geometry.q_slice(b, h), p.element_type, geometry.q_row_stride, i0, kQueryTile, p.seqlen_q,
              p.head_dim, q_tile.data(), dp);
    for (int64_t j0 = key_lo; j0 < key_hi; j0 += kKeyTile) {
      const int64_t cols = std::min(kKeyTile, key_hi - j0);
      if (mask_hides_tile(mask, i0, rows, j0, cols)) continue;
      const int64_t kv_head = h / geometry.group_size;
      load_rows(geometry.k_slice(b, kv_head), p.element_type, geometry.kv_row_stride, j0, kKeyTile, p.seqlen_k,
                p.head_dim, k_tile.data(), dp);
      load_rows(geometry.v_slice(b, kv_head), p.element_type, geometry.kv_row_stride, j0, kKeyTile, p.seqlen_k,
                p.head_dim, v_tile.data(), dp);
      transpose(k_tile.data(), dp, kKeyTile, dp, k_transposed.data(), kKeyTile);

      std::fill(scores.begin(), scores.end(), 0.0f);
      gemm_accumulate(kQueryTile, kKeyTile, dp, q_tile.data(), dp, k_transposed.data(), kKeyTile, scores.data(),
                      kKeyTile);
      for (int64_t r = 0; r < kQueryTile; ++r) {
        float* row = scores.data() + r * kKeyTile;
        if (r >= rows) {
          std::fill(row, row + kKeyTile, 0.0f);
          continue;
        }
        score_row(mask, settings, i0 + r, j0, cols, kKeyTile, row, row, nullptr);
        const float new_max = std::max(running_max[r], row_max(row, kKeyTile));
        if (new_max == -std::numeric_limits<float>::infinity()) {
          std::fill(row, row + kKeyTile, 0.0f);  // nothing visible yet in this row
          continue;
        }
        const float correction = std::exp(running_max[r] - new_max);  // exp(-inf) = 0 on the first block
        running_sum[r] = running_sum[r] * correction + exp_shifted_and_sum(row, kKeyTile, new_max);
        running_max[r] = new_max;
        if (p.dropout_rate > 0.0f) {  // the row sum (and lse) are of the undropped probabilities
          dropout_row(dropout_for_row(p, b, h, i0 + r), j0, kKeyTile, row);
        }
        float* acc_row = acc.data() + r * dp;
        for (int64_t d = 0; d < dp; ++d) acc_row[d] *= correction;
      }
      gemm_accumulate(kQueryTile, dp, kKeyTile, scores.data(), kKeyTile, v_tile.data(), dp, acc.data(), dp);
    }

    float* lse = p.lse + (b * p.heads_q + h) * p.seqlen_q + i0;
    for (int64_t r = 0; r < rows; ++r) {
      float* acc_row = acc.data() + r * dp;
      if (running_sum[r] == 0.0f) {  // fully masked row: o = 0, lse = -inf
        std::fill(acc_row, acc_row + dp, 0.0f);
        lse[r] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float inverse_sum = 1.0f / running_sum[r];
      for (int64_t d = 0; d < dp; ++d) acc_row[d] *= inverse_sum;
      lse[r] = running_max[r] + std::log(running_sum[r]);
    }
    store_rows(acc.data(), dp, rows, p.head_dim, geometry.o_slice(b, h), p.element_type, geometry.q_row_stride,
               i0);
  });
}

}  // namespace jax_flash::cpu
