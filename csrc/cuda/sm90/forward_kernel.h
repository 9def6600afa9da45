// FlashAttention-3-style forward for sm_90a. One CTA owns kBlockM query rows of one (batch, head):
//  - warpgroup 0 is the producer: it gives registers away (setmaxnreg) and one thread issues TMA loads of Q
//    and of the visible key tiles (position masks by range, the boolean mask by its block summary) into a
//    kStages-deep K pipeline and V pipeline (mbarrier transaction counts);
//  - each consumer warpgroup owns 64 of the rows: S = Q K^T by WGMMA from shared memory, the shared score
//    pipeline (per element as sm80 where the kernel form asks for it: softcap and ALiBi, plus bias and boolean mask
//    in the dense form; forward_variant.h), an online-softmax step, O += P V by WGMMA with P from registers.
// Inside a consumer, the Q K^T of tile n is issued together with the P V of tile n-1, and the source waits for P V
// after tile n's softmax. ptxas, though, puts that wait (an instruction without register inputs) at the top of the
// softmax's basic block, so in the SASS (common form: d=64's three-per-SM, wide-keys and standard tiles, d=128, d=256)
// P V retires before the softmax starts. Pinning it below the softmax (a branch the compiler cannot remove;
// benchmarks/ab/pin_pv_wait_s57.patch) made the d=64 kernels 1-4% slower on an H200 (NOTES, fifty-seventh session): the
// overlap that pays is across warpgroups. Between consumers, a ring of named barriers (one per consumer) makes their
// GEMM issues take turns (pingpong with two consumers; three at d=64 on long key sequences, kernel_traits.h), so one
// warpgroup's softmax hides under the others' GEMMs; with one consumer per CTA (the d=64 three-per-SM tiles), under the
// other CTAs' on the SM.
// Key tiles run last to first: a causal row block meets its diagonal (masked) tiles first. Causal grids run the
// longest row blocks first, across bands of (batch, head) slices whose K/V fits in L2 (split_tile).
//
// Tiles: tile t (a query row block of one (batch, head)) is numbered as split_tile says. They go out in passes of
// gridDim.x tiles: in pass j, CTA b runs tile j * gridDim.x + b, or on odd passes the mirror position (pass_tile).
// One pass and one tile per CTA when the grid has one CTA per tile; many on a persistent grid of about one CTA per
// SM (the default up to 2048 keys, 4096 at d=128: forward_launch.h). Each tile is the same function in both cases;
// only the loop around it is new.
//
// Synchronisation across the tiles of one CTA (all warpgroups skip the same empty tiles, so "round" r below counts
// the CTA's non-empty tiles, 0, 1, 2, ...):
//  - K and V: the producer's write state and each consumer's read state run on across tiles; every round fills
//    and drains exactly one stage of each pipeline per key tile of its walk (next_key_tile: all of key_tiles, or in
//    the dense form those the boolean mask's block summary does not hide), and producer and consumers walk
//    the same list, so the two stay in step as within one tile.
//  - Q has B = Traits::kQBuffers buffers (1 or 2); round r uses buffer r % B, each buffer with its own q_full and
//    q_empty, so a buffer's k-th phase belongs to round r = k B + r % B.
//  - q_full (transaction mbarrier, 1 arrival + the Q bytes): a phase completes when its round's Q has landed; the
//    consumers of round r wait for parity (r / B) & 1.
//  - q_empty (mbarrier, one arrival per consumer thread): a phase completes when no consumer reads or writes its
//    round's Q buffer any more (after its last Q K^T retired, or with O staged in Q, after the epilogue read O back
//    and fenced its generic-proxy accesses against the next TMA write). The producer waits for the phase of round
//    r - B, parity (r / B - 1) & 1, before it issues round r's Q (r >= B).
//    Neither barrier can run two phases ahead of its waiter: Q of round r + B needs q_empty of round r, which
//    needs every consumer to have passed its q_full wait of round r (and vice versa), so a parity wait is never
//    ambiguous. No deadlock: before that wait the producer has issued all of round r - B's K/V, which the
//    consumers need to reach their q_empty arrival of that round; with one buffer the next tile's first K load is
//    issued before the wait (it needs only stages the consumers release in round r - 1).
//  - pingpong: one turn token circulates between the consumers for the CTA's whole life: consumer 0 takes the
//    first turn (the last consumer hands it over at its first tile), every GEMM round of every tile ends by
//    passing the turn, so consumer 0's first round of tile r + 1 follows the last consumer's last round of tile
//    r. Only the last consumer's final hand-over in the CTA's last tile is skipped (nobody would take it); when
//    only empty tiles follow, that hand-over is made and simply never taken (a named barrier left with pending
//    arrivals at exit).
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "../../common/attention_params.h"
#include "../../common/score_pipeline.h"
#include "../../common/tf32_workspace.h"
#include "../common/block_range.h"
#include "../common/bulk_reduce.h"
#include "../sm80/fragments.h"
#include "../sm80/score_tile.h"
#include "../sm80/tensor_offsets.h"
#include "forward_variant.h"
#include "fragments.h"
#include "kernel_traits.h"
#include "online_softmax.h"
#include "persistent_pass.h"
#include "split_tf32_mma.h"
#include "tma_shapes.h"

namespace jax_flash::cuda::sm90 {

using sm80::BshdShape;

// Named barrier ids (16 per CTA, id 0 is __syncthreads): pingpong turn of consumer g is kTurnBarrier + g; epilogue
// of consumer g kEpilogueBarrier + g.
constexpr int kTurnBarrier = 1;
constexpr int kEpilogueBarrier = 5;
constexpr int kMaxConsumerGroups = kEpilogueBarrier - kTurnBarrier;  // the two ranges stay apart
static_assert(kEpilogueBarrier + kMaxConsumerGroups <= 16);

// Where one CTA's query tile lies and which key tiles it must visit; computed identically by every warpgroup.
struct RowBlock {
  int64_t batch;
  int64_t head;
  int64_t head_kv;
  int64_t m0;           // first query row
  int rows_in_bounds;   // rows of the tile that exist (< seqlen_q)
  SliceMask mask;
  TileSpan key_tiles;
  TileSpan interior;    // tiles that need no per-element mask
  QueryTileMaskBlocks mask_blocks;  // dense form: row_block_mask_blocks (used by the producer)
};

// A plain division with FastDivmod's call form (quotient, remainder, dividend), for split_tile's one-off callers.
template <class Int>
struct PlainDivmod {
  Int divisor;
  __device__ void operator()(Int& quotient, Int& remainder, Int dividend) const {
    quotient = dividend / divisor;
    remainder = dividend - quotient * divisor;
  }
};

// Tile number -> (row block counted from the last, slice = batch * heads_q + head). The divisions are by the
// TileGrid counts: by_band_tiles by band * row_blocks, by_band and by_last_band by the width of a whole band and of
// the last one, by_row_blocks by row_blocks.
template <class Int, class Divmod>
__device__ void split_tile(Int tile, bool causal, Int slices, Int band, const Divmod& by_row_blocks,
                           const Divmod& by_band_tiles, const Divmod& by_band, const Divmod& by_last_band, Int* block,
                           Int* slice) {
  if (causal) {
    // Work grows with the row block, so the longest row blocks go first and the short ones fill the tail of the
    // grid. Across all slices at once, though, the row blocks of one slice run far apart in time, and each reads
    // the slice's K/V from DRAM again (on the H200 that cost d=128 / 256 up to 14% / 19% at 512-2048 keys).
    // So the slices are cut into bands of `band` (the last band may be narrower), whose K/V fits in L2 together,
    // and the order is longest-first within each band, one band after the other.
    Int band_index, in_band, in_width;
    by_band_tiles(band_index, in_band, tile);
    const Int first_slice = band_index * band;
    const Divmod& by_width = first_slice + band <= slices ? by_band : by_last_band;
    by_width(*block, in_width, in_band);
    *slice = first_slice + in_width;
  } else {
    // Equal work per block: the row blocks of one slice run together and share its K/V in L2.
    by_row_blocks(*slice, *block, tile);
  }
}

// Params: the forward's AttentionParams, or the dQ pass's AttentionBackwardParams (no row layouts: make_slice_mask).
template <class Traits, class Params>
__device__ RowBlock make_row_block(const Params& p, int64_t batch, int64_t head, int64_t head_kv, int64_t m0) {
  RowBlock rb;
  rb.batch = batch;
  rb.head = head;
  rb.head_kv = head_kv;
  rb.m0 = m0;
  rb.rows_in_bounds = static_cast<int>(min(int64_t(Traits::kBlockM), p.seqlen_q - rb.m0));
  rb.mask = make_slice_mask(p, rb.batch, rb.head);
  rb.key_tiles = key_tiles_for_rows(rb.mask, rb.m0, Traits::kBlockM, Traits::kBlockN);
  rb.interior = fully_visible_key_tiles(rb.mask, rb.m0, Traits::kBlockM, Traits::kBlockN);
  return rb;
}

// The row block's row of the boolean mask's block summary (common/mask_blocks.h). The producer keeps it in its
// RowBlock; the consumers rebuild it where they use it, between their GEMM issues, rather than holding it through
// the score pipeline, where every register is taken. One function, so both see the same covers.
template <class Traits>
__device__ QueryTileMaskBlocks row_block_mask_blocks(const AttentionParams& p, const RowBlock& rb) {
  return QueryTileMaskBlocks::make<Traits::kBlockM>(p, rb.batch, rb.head, rb.m0);
}

// How the boolean mask covers key tile n_block of the row block whose summary row is `blocks`. Only the dense form
// can have a mask; the others see every tile as visible and compile none of this.
template <class Traits, ForwardVariant kVariant>
__device__ MaskCover key_tile_cover(const AttentionParams& p, const QueryTileMaskBlocks& blocks, int n_block) {
  if constexpr (reads_bias_or_mask(kVariant)) {
    return blocks.template cover<Traits::kBlockN>(p, int64_t(n_block) * Traits::kBlockN);
  } else {
    return MaskCover::kVisible;
  }
}

// The key tile visited after n_block (key tiles run last to first): the previous one that the mask summary does not
// hide entirely; below rb.key_tiles.begin when none is left. A pure function of the kernel parameters and the row
// block: the producer and every consumer walk the same list with it, so the producer issues exactly the K and V
// stages the consumers wait for, in the same order (a hidden tile is neither loaded nor computed).
template <class Traits, ForwardVariant kVariant>
__device__ __forceinline__ int next_key_tile(const AttentionParams& p, const RowBlock& rb,
                                             const QueryTileMaskBlocks& blocks, int n_block) {
  if constexpr (reads_bias_or_mask(kVariant)) {
    if (p.mask != nullptr) {
      return previous_unhidden_tile(n_block - 1, rb.key_tiles.begin,
                                    [&](int n) { return key_tile_cover<Traits, kVariant>(p, blocks, n); });
    }
  }
  return n_block - 1;
}

// The forward's tile `tile`, split in 32 bits with the host's TileGrid. In the dense form key_tiles ends after
// the last key tile the mask summary leaves anything visible in (where every walk starts), so a row block whose
// every tile is hidden is empty for producer and consumers alike (O = 0, lse = -inf, no load, no barrier phase).
template <class Traits, ForwardVariant kVariant>
__device__ RowBlock locate_tile(const ForwardArgs<Traits>& args, uint32_t tile) {
  const TileGrid& grid = args.grid;
  int block, slice, batch, head;
  split_tile(int(tile), args.p.causal, int(grid.slices), int(grid.band), grid.by_row_blocks, grid.by_band_tiles,
             grid.by_band, grid.by_last_band, &block, &slice);
  grid.by_heads_q(batch, head, slice);
  RowBlock rb = make_row_block<Traits>(args.p, batch, head, grid.by_group_size.div(head),
                                       int64_t(int(grid.row_blocks) - 1 - block) * Traits::kBlockM);
  if constexpr (reads_bias_or_mask(kVariant)) {
    const AttentionParams& p = args.p;
    rb.mask_blocks = row_block_mask_blocks<Traits>(p, rb);
    if (!rb.key_tiles.empty()) {
      rb.key_tiles.end = next_key_tile<Traits, kVariant>(p, rb, rb.mask_blocks, rb.key_tiles.end) + 1;
    }
  }
  return rb;
}

// One CTA per row block, numbered as the forward numbers its tiles (the sm90 dQ pass): tile = blockIdx.x.
template <class Traits>
__device__ RowBlock locate_row_block(const AttentionBackwardParams& p) {
  const int64_t row_blocks = ceil_div(p.seqlen_q, Traits::kBlockM);
  int64_t block, slice;
  const int64_t slices = p.heads_q * p.batch;  // one band: longest-first across every slice
  const PlainDivmod<int64_t> by_row_blocks{row_blocks}, by_all_tiles{slices * row_blocks}, by_slices{slices};
  split_tile<int64_t>(blockIdx.x, p.causal, slices, slices, by_row_blocks, by_all_tiles, by_slices, by_slices, &block,
                      &slice);
  const int64_t head = slice % p.heads_q;
  return make_row_block<Traits>(p, slice / p.heads_q, head, head / (p.heads_q / p.heads_kv),
                                (row_blocks - 1 - block) * Traits::kBlockM);
}

// Elements of O per 16-byte store; the dispatcher admits head dims that are a multiple of it (TMA row strides).
template <class Traits>
constexpr int kOutputChunk = 16 / int(sizeof(typename Traits::OutElement));

// Rows with nothing visible: O = 0, lse = -inf (16-byte stores), written by the consumer threads (`thread` among
// kConsumerThreads); such a tile touches no shared memory or barrier.
template <class Traits>
__device__ void store_empty_rows(const AttentionParams& p, const RowBlock& rb, int thread) {
  using T = typename Traits::OutElement;
  constexpr int kChunk = kOutputChunk<Traits>;
  constexpr int kThreads = Traits::kConsumerThreads;
  const BshdShape q_shape = sm80::query_shape(p);
  const int chunks_per_row = static_cast<int>(p.head_dim / kChunk);
  for (int i = thread; i < rb.rows_in_bounds * chunks_per_row; i += kThreads) {
    const int row = i / chunks_per_row, chunk = i % chunks_per_row;
    T* dst = static_cast<T*>(p.o) + q_shape.offset(rb.batch, rb.m0 + row, rb.head) + chunk * kChunk;
    *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  float* lse = p.lse + sm80::row_stat_offset(p, rb.batch, rb.head, rb.m0);
  for (int r = thread; r < rb.rows_in_bounds; r += kThreads) lse[r] = -INFINITY;
}

// Split TF32 (Traits::kSplit): the lo parts' TMA descriptors (their buffers: split_tf32_mma.h low_parts). Elsewhere
// the hi parts' descriptors, so that the code naming them compiles for every kernel; only kSplit code uses them.
template <class Traits>
__device__ __forceinline__ auto const& low_part_tmas(const ForwardArgs<Traits>& args) {
  if constexpr (Traits::kSplit) {
    return args.tma_lo;
  } else {
    return args;
  }
}

// Producer, one tile (round `round` of this CTA): the first K, then Q once the previous round freed Q's buffer,
// then the rest of K and V. `write` carries the pipelines' position from tile to tile. Split TF32 loads each
// operand's lo part with its hi part, on the same barrier (whose transaction count covers both).
template <class Traits, ForwardVariant kVariant>
__device__ void load_tile(const ForwardArgs<Traits>& args, const RowBlock& rb, typename Traits::SharedStorage& smem,
                          typename Traits::Pipeline& pipeline_k, typename Traits::Pipeline& pipeline_v,
                          typename Traits::PipelineState& write, int round) {
  using namespace cute;
  const AttentionParams& p = args.p;
  const auto q_shape = query_tma_shape(p);
  const auto kv_shape = key_tma_shape(p);
  const int m_block = static_cast<int>(rb.m0 / Traits::kBlockM);
  // (TMA source, TMA destination) of one part of an operand for this batch row (tma_shapes.h tma_load_pair).
  auto part = [&](auto const& tma, auto const& shape, int64_t head, auto tile, auto coord, auto* buffer,
                  auto layout) { return tma_load_pair(tma, shape, head, rb.batch, tile, coord, buffer, layout); };
  // Q's tile; K's key tiles (TMA, TMA_N, TMA_D, n) and stages (..., stage); V's the same, from V itself or from
  // TF32's V^T workspace.
  auto q_part = [&](auto const& tma, auto* buffer) {
    return part(tma, q_shape, rb.head, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, make_coord(m_block, 0),
                buffer, typename Traits::SmemLayoutQ{});
  };
  auto k_part = [&](auto const& tma, auto* buffer) {
    return part(tma, kv_shape, rb.head_kv, Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, make_coord(_, 0),
                buffer, typename Traits::SmemLayoutKV{});
  };
  auto v_part = [&](auto const& tma, auto* buffer) {
    if constexpr (Traits::kTf32) {
      const auto vt_shape = make_shape(int32_t(Traits::kHeadDim), int32_t(tf32_vt_keys(p.seqlen_k)),
                                       int32_t(p.heads_kv), int32_t(p.batch));
      return part(tma, vt_shape, rb.head_kv, Shape<Int<Traits::kHeadDim>, Int<Traits::kBlockN>>{},
                  make_coord(0, _), buffer, typename Traits::SmemLayoutVt{});
    } else {
      return k_part(tma, buffer);
    }
  };
  const auto& low = low_part_tmas(args);
  auto& low_smem = low_parts<Traits::kSplit>(smem);
  const int q_buffer = round % Traits::kQBuffers;
  auto q_hi = q_part(args.tma_q, smem.q_buffer(q_buffer));
  auto k_hi = k_part(args.tma_k, smem.k.data());
  auto v_hi = v_part(args.tma_v, smem.v.data());
  auto q_lo = q_part(low.tma_q, low_smem.q.data());
  auto k_lo = k_part(low.tma_k, low_smem.k.data());
  auto v_lo = v_part(low.tma_v, low_smem.v.data());

  auto load_k = [&](int n_block) {
    pipeline_k.producer_acquire(write);
    auto& barrier = *pipeline_k.producer_get_barrier(write);
    copy(args.tma_k.with(barrier), k_hi.first(_, _, _, n_block), k_hi.second(_, _, _, write.index()));
    if constexpr (Traits::kSplit) {
      copy(low.tma_k.with(barrier), k_lo.first(_, _, _, n_block), k_lo.second(_, _, _, write.index()));
    }
  };
  auto load_v = [&](int n_block) {
    pipeline_v.producer_acquire(write);
    auto& barrier = *pipeline_v.producer_get_barrier(write);
    copy(args.tma_v.with(barrier), v_hi.first(_, _, _, n_block), v_hi.second(_, _, _, write.index()));
    if constexpr (Traits::kSplit) {
      copy(low.tma_v.with(barrier), v_lo.first(_, _, _, n_block), v_lo.second(_, _, _, write.index()));
    }
  };

  // Q waits for the q_empty phase of the round that last used its buffer (see the invariants at the top).
  auto load_q = [&] {
    constexpr int kBuffers = Traits::kQBuffers;
    if (round >= kBuffers) cutlass::arch::ClusterBarrier::wait(&smem.q_empty[q_buffer], (round / kBuffers - 1) & 1);
    uint64_t& q_full = smem.q_full[q_buffer];
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&q_full, Traits::kQLoadBytes);
    copy(args.tma_q.with(q_full), q_hi.first, q_hi.second);
    if constexpr (Traits::kSplit) copy(low.tma_q.with(q_full), q_lo.first, q_lo.second);
  };
  // With one buffer, the previous round frees Q's buffer only at its end, but the first K stage needs only a stage
  // the consumers released, so it goes first and streams in during the previous tile's end. With two, Q's buffer is
  // long free (two rounds back) and Q goes first: this producer reaches here while the consumers still have the
  // previous tile's last key tiles to run, and Q then lands behind them.
  int n_block = rb.key_tiles.end - 1;
  if constexpr (Traits::kQBuffers > 1) load_q();
  load_k(n_block);
  if constexpr (Traits::kQBuffers == 1) load_q();
  load_v(n_block);
  ++write;
  for (n_block = next_key_tile<Traits, kVariant>(p, rb, rb.mask_blocks, n_block); n_block >= rb.key_tiles.begin;
       n_block = next_key_tile<Traits, kVariant>(p, rb, rb.mask_blocks, n_block)) {
    load_k(n_block);
    load_v(n_block);
    ++write;
  }
}

// Producer: one thread issues every TMA load of the CTA, for each of its non-empty tiles in turn.
template <class Traits, ForwardVariant kVariant>
__device__ void produce(const ForwardArgs<Traits>& args, typename Traits::SharedStorage& smem,
                        typename Traits::Pipeline& pipeline_k, typename Traits::Pipeline& pipeline_v) {
  typename Traits::PipelineState write = cutlass::make_producer_start_state<typename Traits::Pipeline>();
  int round = 0;
  // pass * gridDim.x + blockIdx.x < tiles + gridDim.x <= 2^31 + 2^31: no overflow
  for (uint32_t pass = 0; pass * gridDim.x + blockIdx.x < args.grid.tiles; ++pass) {
    const uint32_t tile = pass_tile(pass, blockIdx.x, gridDim.x, args.grid.tiles);
    const RowBlock rb = locate_tile<Traits, kVariant>(args, tile);
    if (rb.key_tiles.empty()) continue;
    load_tile<Traits, kVariant>(args, rb, smem, pipeline_k, pipeline_v, write, round);
    ++round;
  }
}

// x, hidden from the optimiser: nothing computed from it can be hoisted above this point (e.g. out of a loop).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Whether the kernel's online softmax may keep a row's reference maximum and skip rescaling O (online_softmax.h
// kLazy): 16-bit kernels with a head dim of 128 or more, whose O (64+ registers per consumer thread) makes the
// skipped multiplies worth the vote and branch. On the H100 (bench_env_ab.py with the slack at 8 against 0, and
// bench_attention.py grids before and after; NOTES, forty-sixth session) it ran d=256 2-8% and d=128 0-5% faster
// (d=128 causal 16k: -4.2%, -2.3% and +0.4% in three A/Bs, faster in the grids), but the d=64 two-per-SM tile 6-7%
// slower at 1k-2k non-causal keys and the three-per-SM tile 1-3% slower at 1k causal: their O is 32 registers.
template <class Traits>
constexpr bool lazy_rescale() {
  return Traits::kHeadDim >= 128 && !Traits::kTf32;
}

// The kernel's parameter: the call's arguments (kernel_traits.h) and the per-call tuning that only the consumers
// read (forward_launch.h sets it from the environment).
template <class Traits>
struct ForwardKernelArgs : ForwardArgs<Traits> {
  float rescale_slack_log2 = 0.0f;  // online_softmax.h step, where lazy_rescale<Traits>(): 0 is the running maximum
};

// What a consumer warpgroup carries from one of its CTA's tiles to the next.
template <class Traits>
struct ConsumerProgress {
  typename Traits::PipelineState read;  // K and V advance in lock step
  int round = 0;                        // non-empty tiles done: the q_full / q_empty phase
  bool turn_passed = false;             // (last consumer) consumer 0 already holds the first turn of our next tile
};

// Consumer warpgroup `group` (0-based among consumers), one tile: its 64 rows through every key tile, then the
// epilogue. `last_tile`: no later tile of this CTA exists (the final pingpong hand-over is skipped).
// Force-inlined: as a called function, ptxas serialises every WGMMA of the transforming forms (C7510).
template <class Traits, ForwardVariant kVariant>
__device__ __forceinline__ void consume_tile(const AttentionParams& p, const typename Traits::TmaO& tma_o,
                                            float rescale_slack_log2, const RowBlock& rb,
                                            typename Traits::SharedStorage& smem, typename Traits::Pipeline& pipeline_k,
                                            typename Traits::Pipeline& pipeline_v, ConsumerProgress<Traits>& progress,
                                            bool last_tile, int group) {
  using namespace cute;
  using T = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kGroups = Traits::kConsumerGroups;
  // Among all consumer threads; made opaque per tile so that the thread's address arithmetic (the epilogue's
  // above all) is computed where it is used, not hoisted out of the tile loop to sit in registers through every
  // tile's main loop.
  const int thread = opaque(int(threadIdx.x) - 128);

  const int q_buffer = progress.round % Traits::kQBuffers;
  Tensor sQ = make_tensor(make_smem_ptr(smem.q_buffer(q_buffer)), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
  // Split TF32: the lo parts (elsewhere the same buffers again, unused).
  auto& low_smem = low_parts<Traits::kSplit>(smem);
  Tensor sQlo = make_tensor(make_smem_ptr(low_smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sKlo = make_tensor(make_smem_ptr(low_smem.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sVtlo = make_tensor(make_smem_ptr(low_smem.v.data()), typename Traits::SmemLayoutVt{});

  typename Traits::TiledMmaS mma_s;
  typename Traits::TiledMmaO mma_o;
  auto thr_mma_s = mma_s.get_thread_slice(thread);
  // The smem descriptors are the same for the whole warpgroup: sliced with its first thread, a warp-uniform value
  // (fragments.h warp_uniform), and indexed by warp-uniform stages below, they stay in uniform registers (with
  // three consumers this also removed the 192-row tile's last spill: two registers per k slice of Q otherwise).
  const int descriptor_thread = warp_uniform(group * 128);
  auto desc_s = mma_s.get_thread_slice(descriptor_thread);
  Tensor frag_q = desc_s.partition_fragment_A(sQ);  // smem descriptors
  Tensor frag_k = desc_s.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stage)
  Tensor frag_vt = mma_o.get_thread_slice(descriptor_thread).partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor frag_q_lo = desc_s.partition_fragment_A(sQlo);
  Tensor frag_k_lo = desc_s.partition_fragment_B(sKlo);
  Tensor frag_vt_lo = mma_o.get_thread_slice(descriptor_thread).partition_fragment_B(sVtlo);
  constexpr bool kSplit = Traits::kSplit;

  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<Traits::kHeadDim>>{});
  clear(acc_o);
  // Split TF32 at d=64: each key tile's P V sums in `partial` first, added to acc_o in float32 (split_tf32_mma.h
  // add_partial_sums says why). Not at d=128, whose lone consumer has no 64 registers to spare (255 of 256): its
  // P V accumulates in acc_o over every key tile (benchmarks/emulate_split_products.py: ~8e-6 of max|O| at 16k keys;
  // NOTES, thirty-sixth session). Elsewhere `partial` is unused.
  constexpr bool kTilePartials = kSplit && Traits::kHeadDim == 64;
  Tensor partial = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<Traits::kHeadDim>>{});
  Tensor coords = sm80_view(thr_mma_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  constexpr int kRows = decltype(size<0>(sm80::rows_cols(coords.layout())))::value;
  OnlineSoftmax<kRows, lazy_rescale<Traits>()> softmax;
  softmax.reset();
  const float to_log2 = sm80::ScoreTile<transforms_scores(kVariant)>::to_log2(p);

  // Pingpong: a consumer issues GEMMs only on its turn, then hands the turn to the next consumer.
  const int last_group = kGroups - 1;
  auto wait_turn = [&] {
    if constexpr (kGroups > 1) named_barrier_sync(kTurnBarrier + group, 2 * 128);
  };
  auto pass_turn = [&](bool final_round) {
    // The last consumer's final hand-over of the CTA's last tile would have no taker.
    if constexpr (kGroups > 1) {
      if (!(final_round && group == last_group && last_tile)) {
        named_barrier_arrive(kTurnBarrier + (group + 1) % kGroups, 2 * 128);
      }
    }
  };
  // A ring: consumer g waits on kTurnBarrier + g (its 128 threads sync, consumer g - 1's 128 arrive) and passes to
  // g + 1 mod kGroups. Every consumer runs the same GEMM rounds per tile, so the turns go round in order, and a
  // barrier never gets a second arrival before its waiter's sync (g - 1 passes to g again only after a full lap).
  static_assert(kGroups <= kMaxConsumerGroups, "named barrier ids of the turns and epilogues would collide");

  // (dense form) The row block's summary row, rebuilt at each use (row_block_mask_blocks says why), and whether
  // tile n_block reads mask elements (not where its mask blocks are all visible). Both are evaluated before a tile's
  // GEMMs are issued, while the score accumulators hold nothing: during the score pipeline every register is taken
  // (the loads cannot move past the turn barrier's memory clobber).
  auto mask_blocks = [&] {
    if constexpr (reads_bias_or_mask(kVariant)) {
      return row_block_mask_blocks<Traits>(p, rb);
    } else {
      return QueryTileMaskBlocks{};
    }
  };
  auto reads_mask = [&](int n_block) {
    if constexpr (reads_bias_or_mask(kVariant)) {
      return key_tile_cover<Traits, kVariant>(p, mask_blocks(), n_block) != MaskCover::kVisible;
    } else {
      return true;
    }
  };

  // Scores of tile n_block in place: raw dots -> masked / transformed scores, reading bias and mask elements where
  // `reads` (a std::bool_constant) says so. This lambda, `score` and the scorer's apply are inlined by force: the
  // bf16 dense form's reading scorer (two copies of its loop) was otherwise a called function, acc_s went through
  // local memory (a 640-byte stack frame at d=128), and ptxas serialised every WGMMA of that kernel (C7514).
  auto score_with = [&](auto reads, auto& acc_s, int n_block, bool read_boolean_mask)
                        __attribute__((always_inline)) {
    using Scorer = sm80::ScoreTile<transforms_scores(kVariant), decltype(reads)::value, true>;
    auto view = sm80_view(acc_s);
    // The scorer is built where it is used: ahead of the branch, its slice-mask arithmetic (sequence lengths,
    // diagonal, window) ran on every key tile, although the common form's interior tiles need no scorer at all
    // (Nsight Compute, d=64 causal 1k: 64 of the consumer's ~470 instructions per warp and key tile).
    auto scorer = [&] { return Scorer::make(p, rb.batch, rb.head, read_boolean_mask); };
    if (n_block >= rb.interior.begin && n_block < rb.interior.end) {
      if constexpr (transforms_scores(kVariant)) {
        scorer().template apply_inlined<false>(view, coords, rb.m0, int64_t(n_block) * kBlockN);
      }
    } else {
      scorer().template apply_inlined<true>(view, coords, rb.m0, int64_t(n_block) * kBlockN);
    }
  };
  // The dense form splits the tiles in two. One that reads bias or mask elements first waits for the P V GEMM in
  // flight: while it runs, its operand (the probabilities) and acc_o leave a handful of registers beside acc_s, and
  // the element loads spilled (ptxas, d=128: 426 bytes per thread without the wait, 174 with it). The others (no
  // bias, mask blocks all visible) take the transforms form's scorer and keep the overlap.
  auto score = [&](auto& acc_s, int n_block, bool read_boolean_mask) __attribute__((always_inline)) {
    if constexpr (reads_bias_or_mask(kVariant)) {
      if (p.bias != nullptr || read_boolean_mask) {
        warpgroup_wait<0>();
        score_with(std::true_type{}, acc_s, n_block, read_boolean_mask);
      } else {
        score_with(std::false_type{}, acc_s, n_block, false);
      }
    } else {
      score_with(std::false_type{}, acc_s, n_block, read_boolean_mask);
    }
  };

  typename Traits::PipelineState& read = progress.read;
  cutlass::arch::ClusterBarrier::wait(&smem.q_full[q_buffer], (progress.round / Traits::kQBuffers) & 1);
  // Consumer 0 goes first: in the CTA's first tile the last consumer hands it the turn here; later, its final
  // hand-over of the previous tile did.
  if constexpr (kGroups > 1) {
    if (group == last_group && !progress.turn_passed) named_barrier_arrive(kTurnBarrier, 2 * 128);
  }

  // First tile: S only.
  int n_block = rb.key_tiles.end - 1;
  bool read_boolean_mask = reads_mask(n_block);
  Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  wait_turn();
  pipeline_k.consumer_wait(read);
  {
    const int stage = warp_uniform(read.index());
    issue_wgmma_parts<true, kSplit>(mma_s, frag_q, frag_q_lo, frag_k(_, _, _, stage), frag_k_lo(_, _, _, stage),
                                    acc_s);
  }
  pass_turn(false);
  warpgroup_wait<0>();
  pipeline_k.consumer_release(read);
  score(acc_s, n_block, read_boolean_mask);
  float correction[kRows];
  softmax.step(sm80::as_rows_cols(sm80_view(acc_s)), to_log2, rescale_slack_log2, correction);
  Tensor probs = make_tensor_like<T>(acc_s);
  // Split TF32: the probabilities' lo parts (elsewhere one unused register tensor, optimised away).
  Tensor probs_lo = [&] {
    if constexpr (kSplit) {
      return make_tensor_like<T>(acc_s);
    } else {
      return make_tensor<T>(Shape<_1>{});
    }
  }();
  auto convert_probs = [&] {
    if constexpr (kSplit) {
      split_registers(acc_s, probs, probs_lo);
    } else {
      Tensor converted = sm80::converted<T>(acc_s);
      CUTE_UNROLL
      for (int i = 0; i < size(probs); ++i) probs(i) = converted(i);
    }
  };
  convert_probs();
  auto operand_a_layout = [&] {
    if constexpr (Traits::kTf32) {
      return accumulator_as_tf32_operand_a(probs.layout());
    } else {
      return accumulator_as_operand_a(probs.layout());
    }
  };
  Tensor probs_operand = make_tensor(probs.data(), operand_a_layout());
  Tensor probs_lo_operand = make_tensor(kSplit ? probs_lo.data() : probs.data(), operand_a_layout());
  typename Traits::PipelineState previous = read;
  ++read;

  // Steady state: S of tile n with P V of tile n + 1 (the previous one) in flight.
  for (n_block = next_key_tile<Traits, kVariant>(p, rb, mask_blocks(), n_block); n_block >= rb.key_tiles.begin;
       n_block = next_key_tile<Traits, kVariant>(p, rb, mask_blocks(), n_block)) {
    read_boolean_mask = reads_mask(n_block);
    wait_turn();
    pipeline_k.consumer_wait(read);
    {
      const int stage = warp_uniform(read.index());
      issue_wgmma_parts<true, kSplit>(mma_s, frag_q, frag_q_lo, frag_k(_, _, _, stage), frag_k_lo(_, _, _, stage),
                                      acc_s);
    }
    pipeline_v.consumer_wait(previous);
    {
      const int stage = warp_uniform(previous.index());
      issue_wgmma_parts<kTilePartials, kSplit>(mma_o, probs_operand, probs_lo_operand, frag_vt(_, _, _, stage),
                                               frag_vt_lo(_, _, _, stage), gemm_target<kTilePartials>(acc_o, partial));
    }
    pass_turn(false);
    warpgroup_wait<1>();  // S is ready; P V may still run
    pipeline_k.consumer_release(read);
    score(acc_s, n_block, read_boolean_mask);
    softmax.step(sm80::as_rows_cols(sm80_view(acc_s)), to_log2, rescale_slack_log2, correction);
    warpgroup_wait<0>();  // P V retired: its V stage and the probability registers are free
    pipeline_v.consumer_release(previous);
    if constexpr (kTilePartials) add_partial_sums(acc_o, partial);
    softmax.rescale(sm80::as_rows_cols(sm80_view(acc_o)), correction);
    convert_probs();
    previous = read;
    ++read;
  }
  // Every Q K^T of the tile has retired: with O staged elsewhere, Q's buffer may take the next tile's Q.
  if constexpr (Traits::kOwnOutputBuffer) cutlass::arch::ClusterBarrier::arrive(&smem.q_empty[q_buffer]);

  // Last P V.
  wait_turn();
  pipeline_v.consumer_wait(previous);
  {
    const int stage = warp_uniform(previous.index());
    issue_wgmma_parts<kTilePartials, kSplit>(mma_o, probs_operand, probs_lo_operand, frag_vt(_, _, _, stage),
                                             frag_vt_lo(_, _, _, stage), gemm_target<kTilePartials>(acc_o, partial));
  }
  pass_turn(true);
  if (group == last_group) progress.turn_passed = !last_tile;
  warpgroup_wait<0>();
  pipeline_v.consumer_release(previous);
  if constexpr (kTilePartials) add_partial_sums(acc_o, partial);

  // Epilogue: normalise; stage this warpgroup's rows of O in its own rows of the O buffer (or of Q's buffer, whose
  // Q K^T GEMMs have retired; the other consumer reads only its own rows); a TMA store of those rows (16-byte row
  // stores where O is staged in Q's buffer, or is float32); lse from one lane per quad.
  float lse[kRows];
  softmax.finalize(sm80::as_rows_cols(sm80_view(acc_o)), to_log2, lse);
  using Out = typename Traits::OutElement;
  Tensor out_frag = sm80::converted<Out>(acc_o);
  Tensor sO = [&] {
    if constexpr (Traits::kOwnOutputBuffer) {
      return make_tensor(make_smem_ptr(smem.o.data()), typename Traits::SmemLayoutO{});
    } else {
      Out* staging = reinterpret_cast<Out*>(smem.q_buffer(q_buffer));
      return make_tensor(make_smem_ptr(staging), typename Traits::SmemLayoutQ{});
    }
  }();
  // The O buffer outlives the tile: this warpgroup's reads of its rows for the previous tile must be done (with the
  // TMA store, that store's reads, which its issuing thread waits for).
  if constexpr (Traits::kOwnOutputBuffer) {
    if (progress.round > 0) {
      if constexpr (Traits::kTmaStoreO) {
        if (thread % 128 == 0) bulk_wait_read();
      }
      named_barrier_sync(kEpilogueBarrier + group, 128);
    }
  }
  if constexpr (sizeof(Out) == 2) {
    store_accumulators(mma_o, thread, out_frag, sO);  // stmatrix (fragments.h)
  } else {
    copy(out_frag, mma_o.get_thread_slice(thread).partition_C(sO));
  }
  if constexpr (Traits::kTmaStoreO) {
    // One TMA store of this consumer's 64 rows (it clips rows past seqlen_q and columns past head_dim), issued by
    // one thread once every thread's stmatrix stores are visible to the async proxy; none where they all lie past
    // seqlen_q.
    fence_stores_for_async_proxy();
    named_barrier_sync(kEpilogueBarrier + group, 128);
    if (thread % 128 == 0 && group * 64 < rb.rows_in_bounds) {
      Tensor mO = tma_o.get_tma_tensor(query_tma_shape(p))(_, _, rb.head, rb.batch);
      Tensor gO = local_tile(mO, Shape<_64, Int<Traits::kHeadDim>>{},
                             make_coord(static_cast<int>(rb.m0 / 64) + group, 0));
      Tensor sO_rows = make_tensor(make_smem_ptr(smem.o.data() + group * 64 * Traits::kHeadDim),
                                   typename Traits::SmemLayoutORows{});
      auto tma_o_slice = tma_o.get_slice(0);
      copy(tma_o, tma_o_slice.partition_S(sO_rows), tma_o_slice.partition_D(gO));
      bulk_commit();
    }
  } else {
    named_barrier_sync(kEpilogueBarrier + group, 128);
    const BshdShape q_shape = sm80::query_shape(p);
    constexpr int kChunk = kOutputChunk<Traits>;
    constexpr int kChunksPerRow = Traits::kHeadDim / kChunk;
    const int chunks_in_bounds = static_cast<int>(p.head_dim / kChunk);
    const int thread_in_group = thread % 128;
    CUTE_UNROLL
    for (int i = thread_in_group; i < 64 * kChunksPerRow; i += 128) {
      const int row = group * 64 + i / kChunksPerRow, chunk = i % kChunksPerRow;
      if (row < rb.rows_in_bounds && chunk < chunks_in_bounds) {
        Out* dst = static_cast<Out*>(p.o) + q_shape.offset(rb.batch, rb.m0 + row, rb.head) + chunk * kChunk;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sO(row, chunk * kChunk));
      }
    }
  }
  if (threadIdx.x % 4 == 0) {
    float* lse_out = p.lse + sm80::row_stat_offset(p, rb.batch, rb.head, rb.m0);
    auto row_coords = sm80::as_rows_cols(coords);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(row_coords(r, 0));
      if (row < rb.rows_in_bounds) lse_out[row] = lse[r];
    }
  }
  if constexpr (!Traits::kOwnOutputBuffer) {
    // O was staged in Q's buffer: order this thread's generic-proxy accesses to it before the next tile's TMA
    // (async proxy) write, then free it.
    fence_stores_for_async_proxy();
    cutlass::arch::ClusterBarrier::arrive(&smem.q_empty[q_buffer]);
  }
  ++progress.round;
}

// Consumer warpgroup `group`: each of the CTA's tiles in turn; an empty one only writes O = 0 and lse = -inf.
template <class Traits, ForwardVariant kVariant>
__device__ __forceinline__ void consume(const ForwardKernelArgs<Traits>& args,
                                       typename Traits::SharedStorage& smem, typename Traits::Pipeline& pipeline_k,
                                       typename Traits::Pipeline& pipeline_v, int group) {
  ConsumerProgress<Traits> progress;
  for (uint32_t pass = 0; pass * gridDim.x + blockIdx.x < args.grid.tiles; ++pass) {
    const RowBlock rb =
        locate_tile<Traits, kVariant>(args, pass_tile(pass, blockIdx.x, gridDim.x, args.grid.tiles));
    if (rb.key_tiles.empty()) {
      store_empty_rows<Traits>(args.p, rb, threadIdx.x - 128);
      continue;
    }
    const bool last_tile = (pass + 1) * gridDim.x + blockIdx.x >= args.grid.tiles;
    consume_tile<Traits, kVariant>(args.p, args.tma_o, args.rescale_slack_log2, rb, smem, pipeline_k, pipeline_v,
                                   progress, last_tile, group);
  }
  // O's last TMA store has read shared memory before the CTA (and its shared memory) goes away.
  if constexpr (Traits::kTmaStoreO) {
    if (threadIdx.x % 128 == 0) bulk_wait_all();
  }
}

template <class Traits, ForwardVariant kVariant>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kCtasPerSm)
    forward_kernel(const __grid_constant__ ForwardKernelArgs<Traits> args) {
  using namespace cute;
  extern __shared__ __align__(1024) char smem_bytes[];
  auto& smem = pinned_shared_storage<typename Traits::SharedStorage>(smem_bytes);

  const int warp_group = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptors(args.tma_q, args.tma_k, args.tma_v);
    if constexpr (Traits::kSplit) prefetch_tma_descriptors(args.tma_lo.tma_q, args.tma_lo.tma_k, args.tma_lo.tma_v);
    for (int b = 0; b < Traits::kQBuffers; ++b) {
      cutlass::arch::ClusterTransactionBarrier::init(&smem.q_full[b], 1);
      cutlass::arch::ClusterBarrier::init(&smem.q_empty[b], Traits::kConsumerThreads);
    }
  }
  const auto params =
      tma_pipeline_params<typename Traits::Pipeline>(Traits::kConsumerThreads, Traits::kKVStageLoadBytes);
  typename Traits::Pipeline pipeline_k(smem.pipeline_k, params, Shape<_1, _1, _1>{});
  typename Traits::Pipeline pipeline_v(smem.pipeline_v, params, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier initialisation visible to every thread before any use

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x == 0) produce<Traits, kVariant>(args, smem, pipeline_k, pipeline_v);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    consume<Traits, kVariant>(args, smem, pipeline_k, pipeline_v, warp_group - 1);
  }
}

}  // namespace jax_flash::cuda::sm90
