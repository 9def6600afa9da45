// Every compile-time choice of the Hopper (sm_90a) forward kernel, from one tile table keyed by head dim.
// A CTA is one producer warpgroup (TMA loads) and kConsumerGroups consumer warpgroups (WGMMA + softmax), each
// consumer owning 64 consecutive query rows of the CTA's kBlockM-row tile. bf16 and fp16 share tiles.
#pragma once

#include <type_traits>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/fast_math.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../../common/attention_params.h"

namespace jax_flash::cuda::sm90 {

// setmaxnreg moves registers only within what the CTA was launched with: 65536 / (threads x CTAs per SM) per
// thread, at most 255, rounded down to a multiple of 8 (__launch_bounds__). setmaxnreg.inc waits until the CTA's
// own pool has the registers, so the consumers' increase must be covered by the producer's decrease, or it never
// starts (three 256-thread CTAs per SM launch at 80 registers: a 24 + 144 split hung on the H200).
constexpr bool registers_fit(int threads, int consumer_threads, int producer_registers, int consumer_registers,
                             int ctas_per_sm = 1) {
  const int per_thread = 65536 / (threads * ctas_per_sm);
  const int launched = (per_thread < 255 ? per_thread : 255) / 8 * 8;
  return (launched - producer_registers) * 128 >= (consumer_registers - launched) * consumer_threads;
}

struct ForwardTile {
  int block_m;  // query rows per CTA: 64 per consumer warpgroup
  int block_n;  // keys per pipeline stage (the N of Q K^T and the K of P V)
  int stages;   // K and V shared-memory buffers each
  int ctas_per_sm = 1;  // CTAs resident per SM: __launch_bounds__, the register split and the shared-memory share
};

// smem = (block_m + 2 * stages * block_n) * head_dim * 2 bytes (+ barriers), at most 227 KiB on the H100/H200,
// plus block_m * head_dim * 2 for an O staging buffer of its own where that still fits (kOwnOutputBuffer), and as
// much again for a second Q buffer where that fits too (kQBuffers; not counted in the sizes below).
// Register budget per consumer thread after setmaxnreg (240 with two consumers, 160 with three): O is
// head_dim / 2 floats, S and the next S are block_n / 2 floats each, P block_n / 4 registers.
// Which of a head dim's row tiles (the common form has up to three; the other forms take kStandard):
//  - kLong: for long key sequences (one CTA per tile, forward_launch.h). At d=64 three consumers (192 rows) measured
//    faster there (JAX, H200: 4k 417 vs 398, 8k 458 vs 424, 16k 492 vs 437 TFLOP/s) but slower on short sequences
//    and in the persistent grid, which keep 128 rows (benchmarks/NOTES.md).
//  - kShort: one consumer (64 rows) for calls with at most 64 query rows, decoding above all (a single query row,
//    or G of them with GQA packing): a 128-row tile would compute 64 rows that hold nothing, and such calls read
//    long K/V with few tiles, so the freed shared memory goes to a deeper K/V pipeline instead.
//  - kThreePerSm: as kTwoPerSm with 64-key stages, so that three CTAs fit per SM (64 KiB each; consumers at 136
//    registers: ptxas, no spills), in place of kTwoPerSm for short causal calls (forward_launch.h
//    three_per_sm_switch); kThreePerSmWideKeys, the same with two 96-key stages in the same shared memory (consumers
//    up to R133 of 136, no spills), for its calls of more than 1024 keys (forward_launch.h).
//  - kTwoPerSm: one consumer (64 rows) in a CTA small enough that two are resident per SM. Two consumers of one
//    CTA work on the same tile, so they reach its serial parts together (the first Q K^T and its softmax with no
//    GEMM to overlap, the diagonal tile's mask, the last P V, the epilogue) and leave the tensor cores idle there;
//    two CTAs run unrelated tiles, so one's serial parts overlap the other's main loop. At d=64 short tiles are
//    mostly serial parts (forward_launch.h says where this tile is used).
//  - kWideKeys: wider key stages than the standard tile, as wide as two stages and Q fit in shared memory (O staged
//    in Q's buffer): d=128 176 keys (S 88 floats per consumer thread, P 44 registers, O 64), d=192 112 keys (S 56,
//    P 28, O 96), d=256 80 keys (S 40, P 20, O 128); d=64 192 keys (S 96, P 48, O 32; O has its own buffer), and
//    kTwoPerSmWideKeys, the two-per-SM tile with 192-key stages. A wider S spreads each key tile's fixed costs (the pipeline
//    waits, the turn barriers, the softmax's per-row reductions, the O rescale) over more keys; FA3 runs these
//    widths for its non-causal forward. Chosen by forward_launch.h wide_keys_switch.
// d=96 and d=192 have tiles of their own (a call with head_dim 96 used to run the d=128 kernel on zero-padded
// operands: a quarter of its MMAs and loads wasted). d=96 takes d=128's tile with a third K/V stage, which the
// narrower rows leave room for; d=192 takes d=256's key tile and, unlike d=256, fits an O buffer of its own (its
// wide-keys tile does not).
// kSplitTf32 is not a row choice of the 16-bit kernels but the tile of the split-TF32 forward (float32, each operand
// as two TF32 parts: tf32_workspace.h): split_tf32_forward_tile.
enum class RowTile {
  kStandard, kLong, kShort, kTwoPerSm, kThreePerSm, kWideKeys, kTwoPerSmWideKeys, kThreePerSmWideKeys, kSplitTf32
};

constexpr ForwardTile forward_tile(int head_dim, RowTile rows = RowTile::kStandard) {
  switch (head_dim) {
    case 64: return rows == RowTile::kLong       ? ForwardTile{192, 128, 3}     //  24 + 96 (+ 24 O) = 144 KiB
                    : rows == RowTile::kShort    ? ForwardTile{64, 128, 4}      //   8 + 128 (+ 8 O) = 144 KiB
                    : rows == RowTile::kTwoPerSm ? ForwardTile{64, 128, 2, 2}   //   8 + 64 (+ 8 O) = 80 KiB
                    : rows == RowTile::kThreePerSm ? ForwardTile{64, 64, 3, 3}  //   8 + 48 (+ 8 O) = 64 KiB
                    : rows == RowTile::kThreePerSmWideKeys ? ForwardTile{64, 96, 2, 3}  // 8 + 48 (+ 8 O) = 64 KiB
                    : rows == RowTile::kWideKeys ? ForwardTile{128, 192, 2}     //  16 + 96 (+ 16 O) = 128 KiB
                    : rows == RowTile::kTwoPerSmWideKeys ? ForwardTile{64, 192, 2, 2}  // 8 + 96 (+ 8 O) = 112 KiB
                                                 : ForwardTile{128, 128, 3};    //  16 + 96 (+ 16 O) = 128 KiB
    case 96: return {128, 128, 3};   //  24 + 144 (+ 24 O) = 192 KiB; O 48 registers, S 64 + 64, P 32
    case 128: return rows == RowTile::kShort      ? ForwardTile{64, 128, 3}    //  16 + 192 (+ 16 O) = 224 KiB
                     : rows == RowTile::kWideKeys ? ForwardTile{128, 176, 2}   //  32 + 176 = 208 KiB (O in Q)
                                                  : ForwardTile{128, 128, 2};  //  32 + 128 (+ 32 O) = 192 KiB
    case 192: return rows == RowTile::kWideKeys ? ForwardTile{128, 112, 2}  //  48 + 168 = 216 KiB (O in Q)
                                                : ForwardTile{128, 64, 2};  //  48 + 96 (+ 48 O) = 192 KiB
    default: return rows == RowTile::kWideKeys ? ForwardTile{128, 80, 2}    // 256: 64 + 160 = 224 KiB (O in Q)
                                               : ForwardTile{128, 64, 2};   // 256: 64 + 128 = 192 KiB (O in Q)
  }
}

// TF32 (float32 operands, float32 O): tiles of their own, since every operand takes twice the bytes and P twice the
// registers of bf16. d=64: 32 (Q) + 2 x (32 + 32) K/V (+ 32 O) = 192 KiB; S 64 registers, P 64, O 32.
// d=128: 64 + 2 x (32 + 32) = 192 KiB, O staged in Q's buffer; S 32, P 32, O 64.
constexpr ForwardTile tf32_forward_tile(int head_dim) {
  return head_dim == 64 ? ForwardTile{128, 128, 2} : ForwardTile{128, 64, 2};
}

// Split TF32: every operand buffer twice (hi and lo parts), so half the TF32 tile's rows or keys. d=64: 2 x 32 (Q)
// + 2 x 2 x (16 + 16) K/V (+ 32 O) = 224 KiB; S 32 registers, P 32 + 32 (hi, lo), O 32. d=128, one consumer:
// 2 x 32 + 2 x 2 x (16 + 16) (+ 32 O) = 224 KiB; S 16, P 16 + 16, O 64.
constexpr ForwardTile split_tf32_forward_tile(int head_dim) {
  return head_dim == 64 ? ForwardTile{128, 64, 2} : ForwardTile{64, 32, 2};
}

template <class Element>
constexpr bool is_tf32 = std::is_same_v<Element, cutlass::tfloat32_t>;

using namespace cute;

// K-major GMMA shared-memory atom: the widest swizzle whose row (128/64/32 bytes) divides the width.
template <class Element, int kCols>
constexpr auto k_major_smem_atom() {
  constexpr int kRowBytes = kCols * int(sizeof(Element));
  if constexpr (kRowBytes % 128 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kRowBytes % 64 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else {
    return GMMA::Layout_K_SW32_Atom<Element>{};
  }
}

// A contiguous BSHD array as the TMA descriptors see it, (seqlen, head_dim, heads, batch) (tma_shapes.h), and a TMA
// copy (`Copy`: load or store) of one (kRows, kCols) tile of it to or from `SmemTile`, one stage's layout.
template <class Element>
using BshdGmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                            Shape<int32_t, int32_t, int32_t, int32_t>{},
                                            Stride<int64_t, _1, int64_t, int64_t>{}));
template <class Copy, class Element, class SmemTile, int kRows, int kCols>
using BshdTma = decltype(make_tma_copy(Copy{}, BshdGmemTensor<Element>{}, SmemTile{},
                                       Shape<Int<kRows>, Int<kCols>>{}, _1{}));

// A head dim whose common form has a tile of its own for `rows` (one that differs from its standard tile).
constexpr bool has_row_tile(int head_dim, RowTile rows) {
  const ForwardTile mine = forward_tile(head_dim, rows), standard = forward_tile(head_dim);
  return mine.block_m != standard.block_m || mine.block_n != standard.block_n || mine.stages != standard.stages ||
         mine.ctas_per_sm != standard.ctas_per_sm;
}

// Key-tile widths that CuTe's ss_op_selector covers with one WGMMA per k step without its extended shapes.
constexpr bool has_standard_wgmma_n(int n) {
  return n == 8 || n == 16 || n == 32 || n == 64 || n == 96 || n == 128 || n == 192 || n == 256;
}

// The Q K^T atom of the other widths (the wide-keys tiles), defined by wide_keys_mma.h, which says why it is not
// included here.
template <class Element, int kBlockN>
struct WideScoreMma;

// Q K^T's MMA atom: one 64 x kBlockN x 16 WGMMA per k step.
template <class Element, class BlockMNK>
constexpr auto score_mma_atom() {
  constexpr int kBlockN = size<1>(BlockMNK{});
  if constexpr (has_standard_wgmma_n(kBlockN) || is_tf32<Element>) {
    return GMMA::ss_op_selector<Element, Element, float, BlockMNK>();
  } else {
    return typename WideScoreMma<Element, kBlockN>::Atom{};
  }
}

template <int kHeadDim_, class Element_, RowTile kRows = RowTile::kStandard>
struct ForwardTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // TF32: O is float32, and V reaches shared memory transposed (tf32_v_transpose.h), since a TF32 WGMMA takes its B
  // operand K-major only (for P V: keys contiguous).
  static constexpr bool kTf32 = is_tf32<Element>;
  // Split TF32 (tf32_workspace.h): Q, K and V^T come as hi and lo parts, each in a buffer of its own, loaded on the
  // same barriers; each GEMM is three WGMMAs (split_tf32_mma.h).
  static constexpr bool kSplit = kRows == RowTile::kSplitTf32;
  static_assert(!kSplit || kTf32, "split TF32 is a float32 kernel");
  static constexpr int kOperandParts = kSplit ? 2 : 1;
  using OutElement = std::conditional_t<kTf32, float, Element>;
  static constexpr ForwardTile kTile = kSplit  ? split_tf32_forward_tile(kHeadDim)
                                       : kTf32 ? tf32_forward_tile(kHeadDim)
                                               : forward_tile(kHeadDim, kRows);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kCtasPerSm = kTile.ctas_per_sm;
  static constexpr int kConsumerGroups = kBlockM / 64;
  static constexpr int kConsumerThreads = kConsumerGroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  // setmaxnreg: the producer keeps what address arithmetic needs; consumers take the rest of what the CTA was
  // launched with (registers_fit).
  static constexpr int kProducerRegisters =
      kConsumerGroups == 3 ? 32 : (kConsumerGroups == 2 || kCtasPerSm >= 2) ? 24 : 40;
  // (A lone consumer of one CTA per SM may take setmaxnreg's 256: the split-TF32 d=128 tile, whose three sets of
  // operand descriptors spilled 56 bytes at 240.)
  static constexpr int kConsumerRegisters = kConsumerGroups == 3 ? 160
                                            : kCtasPerSm == 3    ? 136
                                            : kCtasPerSm == 2    ? 232
                                            : kSplit && kConsumerGroups == 1 ? 256
                                                                             : 240;
  static_assert(kConsumerGroups >= 1 && kConsumerGroups <= 3, "register split for 1 to 3 consumers");
  static_assert(kCtasPerSm == 1 || (kCtasPerSm <= 3 && kConsumerGroups == 1), "several CTAs per SM: one consumer each");
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0);
  static_assert(registers_fit(kThreads, kConsumerThreads, kProducerRegisters, kConsumerRegisters, kCtasPerSm));

  using BlockMNK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // S = Q K^T
  using BlockMKN = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // O = P V
  using GroupLayout = Layout<Shape<Int<kConsumerGroups>, _1, _1>>;   // consumer warpgroups stacked along M
  // Both operands of Q K^T from shared memory; P V takes P from registers and V^T (MN-major) from smem.
  using TiledMmaS = decltype(make_tiled_mma(score_mma_atom<Element, BlockMNK>(), GroupLayout{}));
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, BlockMKN, GMMA::Major::K,
                           kTf32 ? GMMA::Major::K : GMMA::Major::MN>(),
      GroupLayout{}));

  using SmemLayoutQ = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // may also stage O
  // O's own staging buffer (kOwnOutputBuffer below): each consumer's 64 rows one contiguous (64, head_dim) tile,
  // SmemLayoutORows, the box of that consumer's TMA store of O.
  using SmemLayoutORows = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                                 Shape<_64, Int<kHeadDim>>{}));
  using SmemLayoutOGroups = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                                   Shape<_64, Int<kHeadDim>, Int<kConsumerGroups>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDim>(),
                                              Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T: the same bytes as [head_dim, block_n, stage], i.e. an MN-major B operand for P V; TF32 loads V^T itself
  // (K-major, keys contiguous).
  using SmemLayoutVt = std::conditional_t<
      kTf32,
      decltype(tile_to_shape(k_major_smem_atom<Element, kBlockN>(), Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{})),
      decltype(composition(SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                                               Step<_2, _1, _3>{})))>;
  static_assert(cosize_v<SmemLayoutVt> == cosize_v<SmemLayoutKV>);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVStageBytes = kBlockN * kHeadDim * sizeof(Element);
  // Bytes a Q load or a K / V stage brings in (the transaction counts): every part of the operand.
  static constexpr uint32_t kQLoadBytes = kQBytes * kOperandParts;
  static constexpr uint32_t kKVStageLoadBytes = kKVStageBytes * kOperandParts;

  // O is staged in shared memory for 16-byte row stores. Where a buffer of its own fits (the standard tiles of head
  // dims 64, 96, 128 and 192; not d=256 nor the wide-keys tiles of d >= 128),
  // a tile's Q buffer is free as soon as its last Q K^T has retired, so a persistent CTA loads the next tile's Q
  // during this tile's last P V and epilogue; otherwise (256) O is staged in Q's buffer and frees it only after
  // the epilogue.
  // 227 KiB per CTA on the H100/H200, of 228 KiB per SM, each resident CTA reserving 1 KiB of it.
  static constexpr int kSmemLimit = kCtasPerSm == 1 ? 227 * 1024 : 228 * 1024 / kCtasPerSm - 1024;
  // How many Q-sized buffers (Q's parts, O's own, a second Q) fit beside both K/V pipelines (1024: barriers,
  // alignment); the one budget both choices below are made from.
  static constexpr int kQSizedBuffersThatFit =
      (kSmemLimit - int(2 * kStages * kKVStageLoadBytes) - 1024) / int(kQBytes);
  static constexpr bool kOwnOutputBuffer = kQSizedBuffersThatFit >= 1 + kOperandParts;
  static_assert(sizeof(OutElement) == sizeof(Element), "O is staged in buffers shaped like Q's");
  static_assert(cosize_v<SmemLayoutOGroups> == cosize_v<SmemLayoutQ>);
  // O written back by TMA stores, one per consumer and tile (its 64 rows of O's buffer are the box), where O has a
  // buffer of its own. With 16-byte stores instead, their 64-bit addresses were a noticeable share of each short
  // tile's instructions (d=64 two/three-per-SM tiles), and at d=128 the kernel took 1.2% longer at 2k-4k keys (H100,
  // Nsight Compute; NOTES, forty-eighth session), where each tile's fixed costs are what it loses to cuDNN. The store
  // reads O's buffer asynchronously; the consumer's next tile waits for that read before it stages O there again.
  static constexpr bool kTmaStoreO = kOwnOutputBuffer && !kTf32;
  // O's staging tile as the whole MMA's (kBlockM, head_dim), what the consumers' stmatrix stores write: row
  // 64 g + m of column k is SmemLayoutOGroups' (m, k, g) where the TMA stores read it, else Q's layout (in Q's
  // buffer, or TF32's own buffer, which its 16-byte stores read).
  using SmemLayoutO = std::conditional_t<
      kTmaStoreO,
      decltype(composition(SmemLayoutOGroups{},
                           Layout<Shape<Shape<_64, Int<kConsumerGroups>>, Int<kHeadDim>>,
                                  Stride<Stride<_1, Int<64 * kHeadDim>>, _64>>{})),
      SmemLayoutQ>;
  // Two Q buffers where they fit beside O's own (16-bit tiles of one CTA per SM: d=64, d=96, d=128's standard tile),
  // used by alternate rounds: a persistent CTA's next Q then loads during this tile's last key tiles. With one
  // buffer it could only load once this tile's last Q K^T had retired, and its latency sat between the tile's end
  // and the next tile's first Q K^T, where the tensor cores had only the last P V to run. H100, Nsight Compute, d=128
  // non-causal on the persistent grid: 2k 442.1 -> 435.0 us, 4k 833.1 -> 831.0 us (cuDNN 426.6 / 424.6 and 821.6 /
  // 825.4 in the same runs; NOTES, forty-ninth session). The per-tile grid runs one round per CTA and gains nothing.
  // Not on the tiles of two or three CTAs per SM, where a second Q buffer fits too: there another CTA's work hides
  // the Q load, and with it d=64's kernels ran 0.4-2.2% longer (H100, B A B: causal 1k 230.9 / 227.6 / 232.5 us,
  // non-causal 2k 598.9 / 596.3 / 604.6; NOTES, fifty-first session).
  static constexpr int kQBuffers =
      kOwnOutputBuffer && !kTf32 && kCtasPerSm == 1 && kQSizedBuffersThatFit >= 3 ? 2 : 1;  // Q, O, second Q
  struct OutputBuffer {
    cute::array_aligned<OutElement, cosize_v<SmemLayoutOGroups>, 1024> o;
  };
  struct NoOutputBuffer {};
  // Split TF32: `low`, the lo parts under the hi parts' names (split_tf32_mma.h low_parts(smem), as the backward's
  // WithLowParts); placed before the hi parts, the offsets the verified kernels were measured with.
  struct LowParts {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
  };
  struct LowPartsFirst {
    LowParts low;
  };
  struct NoLowParts {};

  struct SharedStorage : std::conditional_t<kOwnOutputBuffer, OutputBuffer, NoOutputBuffer>,
                         std::conditional_t<kSplit, LowPartsFirst, NoLowParts> {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ> * kQBuffers, 1024> q;  // buffer b at q_buffer(b)
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>, 1024> v;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    alignas(8) uint64_t q_full[kQBuffers];   // transaction barrier of a buffer's Q load (one phase per use)
    alignas(8) uint64_t q_empty[kQBuffers];  // every consumer thread arrives once per use when the buffer is free
    CUTE_DEVICE Element* q_buffer(int b) { return q.data() + b * cosize_v<SmemLayoutQ>; }
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kSmemLimit);

  using TmaQ = BshdTma<SM90_TMA_LOAD, Element, SmemLayoutQ, kBlockM, kHeadDim>;
  using TmaKV = BshdTma<SM90_TMA_LOAD, Element, decltype(take<0, 2>(SmemLayoutKV{})), kBlockN, kHeadDim>;
  using TmaO = BshdTma<SM90_TMA_STORE, Element, SmemLayoutORows, 64, kHeadDim>;
  // TF32: V^T from the workspace seen as (head_dim, keys, heads_kv, batch), keys contiguous; otherwise V as K.
  using TmaV = std::conditional_t<
      kTf32, BshdTma<SM90_TMA_LOAD, Element, decltype(take<0, 2>(SmemLayoutVt{})), kHeadDim, kBlockN>, TmaKV>;
};

// How a tile number splits into (row block, batch, head), precomputed on the host in 32 bits (every count is below
// 2^31): a persistent CTA's tile loop then keeps no 64-bit division constants live across its tiles.
struct TileGrid {
  uint32_t tiles;       // row_blocks * slices
  uint32_t row_blocks;  // ceil(seqlen_q / block_m)
  uint32_t slices;      // heads_q * batch
  uint32_t band;        // causal: slices per band of the longest-first order (forward_kernel.h split_tile)
  // The divisions of forward_kernel.h split_tile and locate_tile (by these counts, heads_q and the GQA group), as a
  // multiply-high and a shift each (cutlass::FastDivmod, built on the host by make): every warp of a CTA decodes
  // every tile it runs, and as integer divisions (about 20 instructions each, MUFU.RCP among them) the decoding was a
  // visible part of a short tile's per-tile code (Nsight Compute, d=64 causal 1k: 1,350 per-tile instructions per
  // warp against cuDNN's 348; NOTES, fifty-third session). Kernel time, H100, d=64 causal 1k / 2k: -0.3-2.3% /
  // -1.4-2.8% (NOTES, fifty-fourth session).
  cutlass::FastDivmod by_row_blocks;  // not causal: tile -> (slice, row block)
  cutlass::FastDivmod by_band_tiles;  // causal: band * row_blocks
  cutlass::FastDivmod by_band;        // causal: a whole band's slices
  cutlass::FastDivmod by_last_band;   // causal: the last band's slices (fewer where band does not divide slices)
  cutlass::FastDivmod by_heads_q;     // slice -> (batch, head)
  cutlass::FastDivmod by_group_size;  // head -> KV head (heads_q / heads_kv per KV head)

  // The grid of `tiles` tiles (row_blocks * slices), its divisors included.
  static TileGrid make(uint32_t tiles, uint32_t row_blocks, uint32_t heads_q, uint32_t group_size, uint32_t band) {
    TileGrid g{};
    g.tiles = tiles;
    g.row_blocks = row_blocks;
    g.slices = tiles / row_blocks;
    g.band = band;
    const uint32_t last_band = g.slices % band == 0 ? band : g.slices % band;
    g.by_row_blocks = cutlass::FastDivmod(int(row_blocks));
    g.by_band_tiles = cutlass::FastDivmod(int(band * row_blocks));
    g.by_band = cutlass::FastDivmod(int(band));
    g.by_last_band = cutlass::FastDivmod(int(last_band));
    g.by_heads_q = cutlass::FastDivmod(int(heads_q));
    g.by_group_size = cutlass::FastDivmod(int(group_size));
    return g;
  }
};

// Kernel arguments: the plain parameters, the tile numbering and the TMA descriptors (built per call).
// Split TF32: the descriptors of the lo parts (ForwardArgs' own then read the hi parts), named like those.
template <class Traits>
struct LowPartTmas {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaV tma_v;
};
struct NoLowPartTmas {};

template <class Traits>
struct ForwardArgs {
  AttentionParams p;
  TileGrid grid;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaO tma_o;  // built only where Traits::kTmaStoreO
  std::conditional_t<Traits::kSplit, LowPartTmas<Traits>, NoLowPartTmas> tma_lo;
};

}  // namespace jax_flash::cuda::sm90
