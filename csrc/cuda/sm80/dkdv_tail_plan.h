// The sm80 fused dK/dV pass's last wave, split into pieces across every SM (no CUDA here, so a CPU check runs it:
// csrc/cuda/tests/dkdv_tail_plan_check.cc).
//
// The pass runs one CTA per key block, each the same length when every block sees the same query tiles. Blocks
// run in waves of (SMs x CTAs per SM), so when their count is not a multiple of a wave, the last wave leaves SMs idle
// for a whole block's time: d=128 at 16k tokens launches 2048 blocks on the H200's 132 SMs, 15.5 waves that take as
// long as 16 (the seventeenth session measured 62, 64 and 66 heads at seqlen 4096 in the same 5.17 ms). So the first
// `full_blocks` blocks keep a CTA each, and each of the remaining `tail_blocks` blocks is cut into
// `pieces_per_block` CTAs of equal runs of its (query head, query tile) items, in a second launch after them (so it
// starts once the whole blocks are done): its SMs take the pieces as they free up, so the tail ends within about a
// piece of an even share. The pieces of a block add their float32 dK and dV into its slot of a workspace
// (AttentionBackwardParams::dkdv_tail), and a small pass converts the slots. (A CTA that ran two blocks' pieces,
// stream-K style, would balance exactly, but any second segment in the kernel made ptxas spill 956-1708 bytes of
// loads against 68.) The adds arrive in any order, so dk and dv of split blocks are not bit-reproducible run to
// run, like the fused dQ (deterministic calls never take this path).
#pragma once

#include <cstdint>

#include "../../common/score_pipeline.h"  // JF_HOST_DEVICE

namespace jax_flash::cuda::sm80 {

struct DkdvTail {
  int full_blocks = 0x7fffffff;  // CTAs [0, full_blocks) own linear key block blockIdx.x whole
  int tail_blocks = 0;           // key blocks [full_blocks, full_blocks + tail_blocks), one workspace slot each
  int pieces_per_block = 0;      // CTAs per tail block, after the whole-block ones
  int items_per_block = 0;       // (query head, query tile) items of every block
  float* slots = nullptr;        // tail_blocks slots of a block's float32 dK then dV

  JF_HOST_DEVICE int64_t ctas() const { return int64_t(full_blocks) + int64_t(tail_blocks) * pieces_per_block; }
};

// No split: one CTA per block.
JF_HOST_DEVICE DkdvTail whole_dkdv_blocks(int64_t blocks) {
  DkdvTail tail;
  tail.full_blocks = static_cast<int>(blocks);
  return tail;
}

// A piece is at least this many items; each also loads K/V and adds a whole slot, reckoned as about one item's time
// (kDkdvPieceOverheadItems) when choosing how many pieces to cut, out of at most kDkdvMaxPieces (a bound on the
// host's search; the H200's measured plans cut 4-16).
constexpr int64_t kDkdvTailMinItems = 2;
constexpr int64_t kDkdvPieceOverheadItems = 1;
constexpr int64_t kDkdvMaxPieces = 256;

// The split for `blocks` key blocks of `items_per_block` items each, in waves of `ctas_per_wave`, with room for
// `slot_capacity` slots: the pieces per block that end the tail soonest, reckoning that the SMs take pieces in
// rounds of a wave; none (whole blocks) where that would not shorten the tail by a quarter.
JF_HOST_DEVICE DkdvTail plan_dkdv_tail(int64_t blocks, int64_t items_per_block, int64_t ctas_per_wave,
                                       int64_t slot_capacity, float* slots) {
  const DkdvTail none = whole_dkdv_blocks(blocks);
  if (items_per_block < 2 * kDkdvTailMinItems || ctas_per_wave < 2) return none;
  const int64_t rest = blocks % ctas_per_wave;
  if (rest == 0 || rest > slot_capacity) return none;
  auto tail_time = [&](int64_t pieces) {
    const int64_t rounds = (rest * pieces + ctas_per_wave - 1) / ctas_per_wave;
    return rounds * ((items_per_block + pieces - 1) / pieces + kDkdvPieceOverheadItems);
  };
  int64_t best = 1;
  for (int64_t pieces = 2; pieces * kDkdvTailMinItems <= items_per_block && pieces <= kDkdvMaxPieces; ++pieces) {
    if (tail_time(pieces) < tail_time(best)) best = pieces;
  }
  if (4 * tail_time(best) > 3 * tail_time(1)) return none;
  DkdvTail tail;
  tail.full_blocks = static_cast<int>(blocks - rest);
  tail.tail_blocks = static_cast<int>(rest);
  tail.pieces_per_block = static_cast<int>(best);
  tail.items_per_block = static_cast<int>(items_per_block);
  tail.slots = slots;
  return tail;
}

// One CTA's work: items [item_begin, item_end) of linear key block `block`; `slot` is the block's tail workspace
// slot (index into DkdvTail::slots), or -1 where the CTA owns the block whole.
struct DkdvSegment {
  int64_t block = 0;
  int item_begin = 0;
  int item_end = 0;
  int slot = -1;
};

JF_HOST_DEVICE DkdvSegment dkdv_segment_of(const DkdvTail& tail, int64_t cta) {
  DkdvSegment segment;
  if (cta < tail.full_blocks) {
    segment.block = cta;
    segment.item_end = 0x7fffffff;  // every item the block has
    return segment;
  }
  const int64_t piece = cta - tail.full_blocks;
  const int64_t slot = piece / tail.pieces_per_block;
  const int64_t index = piece % tail.pieces_per_block;
  segment.block = tail.full_blocks + slot;
  segment.item_begin = static_cast<int>(index * tail.items_per_block / tail.pieces_per_block);
  segment.item_end = static_cast<int>((index + 1) * tail.items_per_block / tail.pieces_per_block);
  segment.slot = static_cast<int>(slot);
  return segment;
}

}  // namespace jax_flash::cuda::sm80
