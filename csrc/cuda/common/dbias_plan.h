// How a backward forms dbias, shared by the sm80 and float32 kernel families (no CuTe, so that the float32
// host emulation can include it). dbias has the bias's strides; the dispatcher zero-fills it first.
//   - no dbias element is shared by two score elements (full shape, or broadcast only along axes of extent 1):
//     the dQ pass stores each dS (DbiasMode::kStore);
//   - shared elements, deterministic=False: the dQ pass adds each dS with a float32 atomicAdd (kAtomicAdd);
//   - shared elements, deterministic=True: a separate dbias kernel, one CTA per dbias block, summing the
//     members of its block in a fixed order (sm80/dbias.h, f32/dbias_kernel.h); the dQ pass writes none.
#pragma once

#include <cstdint>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "block_range.h"

namespace jax_flash::cuda {

enum class DbiasMode : int {
  kNone = 0,       // the dQ pass writes no dbias (none wanted, or the dbias kernel forms it)
  kStore = 1,      // every dbias element has at most one score element: plain stores
  kAtomicAdd = 2,  // shared elements, order not fixed
};

// The corner of dbias that (batch, head) adds into.
JF_HOST_DEVICE float* dbias_slice_of(const AttentionBackwardParams& p, int64_t batch, int64_t head) {
  return p.dbias + broadcast_slice_offset(p.bias_strides, p.inner_batch, batch, head);
}

// Which axes of [inner batch, head, query, key] the bias broadcasts along (stride 0, extent > 1). The vmap
// ("outer") axes are never broadcast: a bias carries them like q does.
struct DbiasBroadcast {
  bool batch, head, query, key;
  JF_HOST_DEVICE bool any() const { return batch || head || query || key; }
};

inline DbiasBroadcast dbias_broadcast(const AttentionBackwardParams& p) {
  const BroadcastStrides& s = p.bias_strides;
  return {p.inner_batch > 1 && s.batch == 0, p.heads_q > 1 && s.head == 0, p.seqlen_q > 1 && s.query == 0,
          p.seqlen_k > 1 && s.key == 0};
}

// What the dQ pass does with each dS, and whether the separate deterministic kernel runs.
struct DbiasPlan {
  DbiasBroadcast broadcast;
  bool separate_kernel;
  DbiasMode dq_mode;
};

inline DbiasPlan plan_dbias(const AttentionBackwardParams& p) {
  DbiasPlan plan;
  plan.broadcast = dbias_broadcast(p);
  plan.separate_kernel = p.dbias != nullptr && plan.broadcast.any() && p.deterministic;
  plan.dq_mode = p.dbias == nullptr || plan.separate_kernel ? DbiasMode::kNone
                 : plan.broadcast.any()                      ? DbiasMode::kAtomicAdd
                                                             : DbiasMode::kStore;
  return plan;
}

// The deterministic dbias kernel's grid: CTA = (dbias slice, query tile, key tile), each looping over members.
struct DbiasGrid {
  DbiasBroadcast broadcast;
  int64_t slice_batches;  // inner batch rows that own a dbias slice (1 when broadcast)
  int64_t slice_heads;
  int m_tiles, n_tiles;    // owned tiles per slice (1 along a broadcast axis)
  int m_total, n_total;    // tiles of the score matrix

  // CTAs: outer batch x owned slices x owned tiles.
  int64_t blocks(const AttentionParams& p) const {
    return p.outer_batch * slice_batches * slice_heads * int64_t(m_tiles) * n_tiles;
  }
};

inline DbiasGrid make_dbias_grid(const AttentionBackwardParams& p, DbiasBroadcast broadcast, int block_m,
                                 int block_n) {
  DbiasGrid grid;
  grid.broadcast = broadcast;
  grid.slice_batches = broadcast.batch ? 1 : p.inner_batch;
  grid.slice_heads = broadcast.head ? 1 : p.heads_q;
  grid.m_total = static_cast<int>(ceil_div(p.seqlen_q, block_m));
  grid.n_total = static_cast<int>(ceil_div(p.seqlen_k, block_n));
  grid.m_tiles = broadcast.query ? 1 : grid.m_total;
  grid.n_tiles = broadcast.key ? 1 : grid.n_total;
  return grid;
}

// Decomposition of one dbias CTA's blockIdx.x = ((slice * m_tiles) + m_tile) * n_tiles + n_tile, slice =
// (outer, batch, head) folded.
struct DbiasBlock {
  int m_tile, n_tile;
  int64_t slice_head, slice_batch, outer;
};

JF_HOST_DEVICE DbiasBlock decode_dbias_block(const DbiasGrid& grid, int64_t block) {
  DbiasBlock b;
  b.n_tile = static_cast<int>(block % grid.n_tiles);
  b.m_tile = static_cast<int>((block / grid.n_tiles) % grid.m_tiles);
  const int64_t slice = block / (int64_t(grid.n_tiles) * grid.m_tiles);
  b.slice_head = slice % grid.slice_heads;
  b.slice_batch = (slice / grid.slice_heads) % grid.slice_batches;
  b.outer = slice / (grid.slice_heads * grid.slice_batches);
  return b;
}

}  // namespace jax_flash::cuda
