// Backward pass. With P = exp(S - lse) recomputed per tile and D_i = rowsum(dO * O)_i - dlse_i:
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D) * dsoftcap,   dQ = scale * dS K,   dK = scale * dS^T Q.
// A task owns one (batch, KV head, chunk of key tiles): it walks the query tiles of every query head of the
// group, so dK/dV are summed over the group without per-head copies and need no locking. dQ rows are shared
// by all key tiles; each chunk accumulates its own partial, and partials are summed in a fixed order, so the
// result is bit-reproducible.
#include <algorithm>
#include <limits>
#include <vector>

#include "attention_cpu.h"
#include "element_convert.h"
#include "parallel_for.h"
#include "row_ops.h"
#include "slice_view.h"
#include "tile_gemm.h"

namespace jax_flash::cpu {
namespace {

// softmax_d[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] - dlse[b, h, i].
void compute_softmax_d(const AttentionBackwardParams& p, const SliceGeometry& geometry) {
  const int64_t dp = geometry.padded_head_dim;
  parallel_for(p.batch * p.heads_q, [&](int64_t task) {
    const int64_t b = task / p.heads_q;
    const int64_t h = task % p.heads_q;
    std::vector<float> o_tile(kQueryTile * dp), do_tile(kQueryTile * dp);
    const int64_t row_offset = (b * p.heads_q + h) * p.seqlen_q;
    for (int64_t i0 = 0; i0 < p.seqlen_q; i0 += kQueryTile) {
      const int64_t rows = std::min(kQueryTile, p.seqlen_q - i0);
      load_rows(geometry.o_slice(b, h), p.element_type, geometry.q_row_stride, i0, rows, p.seqlen_q, p.head_dim,
                o_tile.data(), dp);
      load_rows(geometry.slice(p.d_o, p.seqlen_q, p.heads_q, b, h), p.element_type, geometry.q_row_stride, i0,
                rows, p.seqlen_q, p.head_dim, do_tile.data(), dp);
      for (int64_t r = 0; r < rows; ++r) {
        float dot = 0.0f;
        for (int64_t d = 0; d < dp; ++d) dot += o_tile[r * dp + d] * do_tile[r * dp + d];
        p.softmax_d[row_offset + i0 + r] = dot - p.d_lse[row_offset + i0 + r];
      }
    }
  });
}

struct KeyTileWork {
  std::vector<float> k, k_transposed, v_transposed, dk, dv;
  std::vector<float> q, d_o, probs, dropped_probs, probs_transposed, dscores, dscores_transposed, softcap_grad, dq;
  explicit KeyTileWork(int64_t dp)
      : k(kKeyTile * dp), k_transposed(dp * kKeyTile), v_transposed(dp * kKeyTile), dk(kKeyTile * dp),
        dv(kKeyTile * dp), q(kQueryTile * dp), d_o(kQueryTile * dp), probs(kQueryTile * kKeyTile),
        dropped_probs(kQueryTile * kKeyTile), probs_transposed(kKeyTile * kQueryTile),
        dscores(kQueryTile * kKeyTile), dscores_transposed(kKeyTile * kQueryTile),
        softcap_grad(kQueryTile * kKeyTile), dq(kQueryTile * dp) {}
};

// Where a task adds the gradient of the scores with respect to the bias: this slice's corner of its dbias
// partial (strides of the bias; 0 along broadcast axes), or nullptr when dbias is not wanted.
struct DbiasTarget {
  float* slice = nullptr;
  int64_t query_stride = 0;
  int64_t key_stride = 0;
};

// Adds one query tile's contribution to dK/dV of the key tile in `work`, its dQ to dq_partial
// ([seqlen_q, heads_q, head_dim] of this batch row) and its dbias to `dbias`.
void accumulate_query_tile(const AttentionBackwardParams& p, const SliceGeometry& geometry, const SliceMask& mask,
                           int64_t b, int64_t h, int64_t i0, int64_t j0, KeyTileWork& work, float* dq_partial,
                           const DbiasTarget& dbias) {
  const int64_t dp = geometry.padded_head_dim;
  const int64_t rows = std::min(kQueryTile, p.seqlen_q - i0);
  const int64_t cols = std::min(kKeyTile, p.seqlen_k - j0);
  const ScoreSettings settings{p.softmax_scale, p.softcap};
  const float* lse = p.lse + (b * p.heads_q + h) * p.seqlen_q + i0;
  const float* softmax_d = p.softmax_d + (b * p.heads_q + h) * p.seqlen_q + i0;

  load_rows(geometry.q_slice(b, h), p.element_type, geometry.q_row_stride, i0, kQueryTile, p.seqlen_q, p.head_dim,
            work.q.data(), dp);
  load_rows(geometry.slice(p.d_o, p.seqlen_q, p.heads_q, b, h), p.element_type, geometry.q_row_stride, i0,
            kQueryTile, p.seqlen_q, p.head_dim, work.d_o.data(), dp);

  std::fill(work.probs.begin(), work.probs.end(), 0.0f);
  gemm_accumulate(kQueryTile, kKeyTile, dp, work.q.data(), dp, work.k_transposed.data(), kKeyTile,
                  work.probs.data(), kKeyTile);
  for (int64_t r = 0; r < kQueryTile; ++r) {
    float* row = work.probs.data() + r * kKeyTile;
    if (r >= rows || lse[r] == -std::numeric_limits<float>::infinity()) {
      std::fill(row, row + kKeyTile, 0.0f);
      continue;
    }
    score_row(mask, settings, i0 + r, j0, cols, kKeyTile, row, row, work.softcap_grad.data() + r * kKeyTile);
    exp_shifted_and_sum(row, kKeyTile, lse[r]);
  }

  // With dropout, O = dropout(P) V: dV sees the dropped probabilities, and dP = dropout(dO V^T) (the same
  // keep mask and scale). D = rowsum(dO * O) - dlse is unchanged.
  const bool dropout = p.dropout_rate > 0.0f;
  const float* probs_for_v = work.probs.data();
  if (dropout) {
    std::copy(work.probs.begin(), work.probs.end(), work.dropped_probs.begin());
    for (int64_t r = 0; r < rows; ++r)
      dropout_row(dropout_for_row(p, b, h, i0 + r), j0, kKeyTile, work.dropped_probs.data() + r * kKeyTile);
    probs_for_v = work.dropped_probs.data();
  }
  transpose(probs_for_v, kKeyTile, kQueryTile, kKeyTile, work.probs_transposed.data(), kQueryTile);
  gemm_accumulate(kKeyTile, dp, kQueryTile, work.probs_transposed.data(), kQueryTile, work.d_o.data(), dp,
                  work.dv.data(), dp);

  std::fill(work.dscores.begin(), work.dscores.end(), 0.0f);
  gemm_accumulate(kQueryTile, kKeyTile, dp, work.d_o.data(), dp, work.v_transposed.data(), kKeyTile,
                  work.dscores.data(), kKeyTile);
  for (int64_t r = 0; r < kQueryTile; ++r) {
    float* ds = work.dscores.data() + r * kKeyTile;
    if (dropout && r < rows) dropout_row(dropout_for_row(p, b, h, i0 + r), j0, kKeyTile, ds);
    const float* prob = work.probs.data() + r * kKeyTile;
    const float* grad = work.softcap_grad.data() + r * kKeyTile;
    const float d_row = r < rows ? softmax_d[r] : 0.0f;
    float* dbias_row = dbias.slice && r < rows ? dbias.slice + (i0 + r) * dbias.query_stride : nullptr;
    for (int64_t c = 0; c < kKeyTile; ++c) {
      const float dscore = prob[c] == 0.0f ? 0.0f : prob[c] * (ds[c] - d_row);  // d loss / d (biased score)
      if (dbias_row && c < cols) dbias_row[(j0 + c) * dbias.key_stride] += dscore;
      ds[c] = dscore * grad[c] * p.softmax_scale;
    }
  }

  transpose(work.dscores.data(), kKeyTile, kQueryTile, kKeyTile, work.dscores_transposed.data(), kQueryTile);
  gemm_accumulate(kKeyTile, dp, kQueryTile, work.dscores_transposed.data(), kQueryTile, work.q.data(), dp,
                  work.dk.data(), dp);

  std::fill(work.dq.begin(), work.dq.end(), 0.0f);
  gemm_accumulate(kQueryTile, dp, kKeyTile, work.dscores.data(), kKeyTile, work.k.data(), dp, work.dq.data(), dp);
  for (int64_t r = 0; r < rows; ++r) {
    float* out = dq_partial + ((i0 + r) * p.heads_q + h) * p.head_dim;
    const float* in = work.dq.data() + r * dp;
    for (int64_t d = 0; d < p.head_dim; ++d) out[d] += in[d];
  }
}

}  // namespace

void attention_backward(const AttentionBackwardParams& p) {
  // dbias may be non-empty when the batch is (a bias broadcast over it): its gradient is then zero.
  const int64_t dbias_elements = p.dbias ? p.outer_batch * p.bias_strides.outer : 0;
  if (p.dbias) std::fill(p.dbias, p.dbias + dbias_elements, 0.0f);
  if (p.batch == 0) return;  // every other output is empty
  const SliceGeometry geometry(p);
  const int64_t dp = geometry.padded_head_dim;
  const int64_t gradient_bytes = element_size(p.gradient_type());
  compute_softmax_d(p, geometry);

  // Split the key tiles of a (batch, KV head) into chunks only when there are fewer of those than workers.
  const int64_t key_tiles = (p.seqlen_k + kKeyTile - 1) / kKeyTile;
  const int64_t slices = p.batch * p.heads_kv;
  const int64_t wanted_chunks = std::clamp<int64_t>((worker_count() + slices - 1) / slices, 1,
                                                    std::max<int64_t>(key_tiles, 1));
  const int64_t tiles_per_chunk = std::max<int64_t>(1, (key_tiles + wanted_chunks - 1) / wanted_chunks);
  const int64_t chunks = std::max<int64_t>(1, (key_tiles + tiles_per_chunk - 1) / tiles_per_chunk);

  const int64_t dq_elements = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
  const int64_t batch_dq_elements = p.seqlen_q * p.heads_q * p.head_dim;
  // Host memory is safe here (the kernels finish before the handler returns), so the float32 dQ accumulators
  // need no workspace from XLA: one per chunk of key tiles.
  std::vector<float> dq_partials(chunks * dq_elements, 0.0f);
  auto dq_partial = [&](int64_t chunk, int64_t b) {
    return dq_partials.data() + chunk * dq_elements + b * batch_dq_elements;
  };

  // dbias: tasks that add into the same elements (the bias is broadcast along their batch rows, KV heads or
  // key chunks) get separate partials, summed in a fixed order at the end.
  const BroadcastStrides& bias_strides = p.bias_strides;
  const int64_t batch_slots = bias_strides.batch == 0 ? p.inner_batch : 1;
  const int64_t head_slots = bias_strides.head == 0 ? p.heads_kv : 1;
  const int64_t chunk_slots = bias_strides.key == 0 ? chunks : 1;
  const int64_t dbias_slots = p.dbias ? batch_slots * head_slots * chunk_slots : 0;
  std::vector<float> extra_dbias(dbias_slots > 1 ? (dbias_slots - 1) * dbias_elements : 0, 0.0f);
  auto dbias_target = [&](int64_t b, int64_t h, int64_t kv_head, int64_t chunk) {
    DbiasTarget target;
    if (!p.dbias) return target;
    const int64_t slot = ((bias_strides.batch == 0 ? b % p.inner_batch : 0) * head_slots +
                          (bias_strides.head == 0 ? kv_head : 0)) * chunk_slots +
                         (bias_strides.key == 0 ? chunk : 0);
    float* base = slot == 0 ? p.dbias : extra_dbias.data() + (slot - 1) * dbias_elements;
    target.slice = base + (b / p.inner_batch) * bias_strides.outer + (b % p.inner_batch) * bias_strides.batch +
                   h * bias_strides.head;
    target.query_stride = bias_strides.query;
    target.key_stride = bias_strides.key;
    return target;
  };

  parallel_for(slices * chunks, [&](int64_t task) {
    const int64_t chunk = task % chunks;
    const int64_t kv_head = (task / chunks) % p.heads_kv;
    const int64_t b = task / (chunks * p.heads_kv);
    KeyTileWork work(dp);
    std::vector<float> v_tile(kKeyTile * dp);
    const int64_t tile_end = std::min(key_tiles, (chunk + 1) * tiles_per_chunk);
    for (int64_t tile = chunk * tiles_per_chunk; tile < tile_end; ++tile) {
      const int64_t j0 = tile * kKeyTile;
      load_rows(geometry.k_slice(b, kv_head), p.element_type, geometry.kv_row_stride, j0, kKeyTile, p.seqlen_k,
                p.head_dim, work.k.data(), dp);
      load_rows(geometry.v_slice(b, kv_head), p.element_type, geometry.kv_row_stride, j0, kKeyTile, p.seqlen_k,
                p.head_dim, v_tile.data(), dp);
      transpose(work.k.data(), dp, kKeyTile, dp, work.k_transposed.data(), kKeyTile);
      transpose(v_tile.data(), dp, kKeyTile, dp, work.v_transposed.data(), kKeyTile);
      std::fill(work.dk.begin(), work.dk.end(), 0.0f);
      std::fill(work.dv.begin(), work.dv.end(), 0.0f);
      for (int64_t h = kv_head * geometry.group_size; h < (kv_head + 1) * geometry.group_size; ++h) {
        const SliceMask mask = make_slice_mask(p, b, h);
        for (int64_t i0 = 0; i0 < p.seqlen_q; i0 += kQueryTile) {
          const int64_t rows = std::min(kQueryTile, p.seqlen_q - i0);
          const auto [lo, hi] = visible_key_range(mask, i0, rows);
          if (hi <= j0 || lo >= j0 + kKeyTile) continue;
          if (mask_hides_tile(mask, i0, rows, j0, std::min(kKeyTile, p.seqlen_k - j0))) continue;
          accumulate_query_tile(p, geometry, mask, b, h, i0, j0, work, dq_partial(chunk, b),
                                dbias_target(b, h, kv_head, chunk));
        }
      }
      const int64_t rows = std::min(kKeyTile, p.seqlen_k - j0);
      store_rows(work.dk.data(), dp, rows, p.head_dim, geometry.slice(p.dk, p.seqlen_k, p.heads_kv, b, kv_head, gradient_bytes),
                 p.gradient_type(), geometry.kv_row_stride, j0);
      store_rows(work.dv.data(), dp, rows, p.head_dim, geometry.slice(p.dv, p.seqlen_k, p.heads_kv, b, kv_head, gradient_bytes),
                 p.gradient_type(), geometry.kv_row_stride, j0);
    }
  });

  for (int64_t slot = 1; slot < dbias_slots; ++slot) {
    const float* partial = extra_dbias.data() + (slot - 1) * dbias_elements;
    for (int64_t e = 0; e < dbias_elements; ++e) p.dbias[e] += partial[e];
  }

  // Sum the chunk partials in chunk order and convert dQ to the gradients' type.
  const int64_t total_rows = p.batch * p.seqlen_q * p.heads_q;
  const int64_t rows_per_task = 256;
  parallel_for((total_rows + rows_per_task - 1) / rows_per_task, [&](int64_t task) {
    const int64_t first = task * rows_per_task;
    const int64_t rows = std::min(rows_per_task, total_rows - first);
    float* dq = dq_partials.data() + first * p.head_dim;
    for (int64_t chunk = 1; chunk < chunks; ++chunk) {
      const float* partial = dq_partials.data() + chunk * dq_elements + first * p.head_dim;
      for (int64_t e = 0; e < rows * p.head_dim; ++e) dq[e] += partial[e];
    }
    store_rows(dq, p.head_dim, rows, p.head_dim, p.dq, p.gradient_type(), p.head_dim, first);
  });
}

}  // namespace jax_flash::cpu
