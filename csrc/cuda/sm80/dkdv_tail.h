// The device side of the fused dK/dV pass's split tail (dkdv_tail_plan.h has the plan): the pieces of a key block
// add their dK and dV to its workspace slot, and one pass converts the slots into dk and dv.
// A slot: the block's dK (already scaled) then its dV, each [kBlockN][kHeadDim] float32 row-major (the kernel's
// head dim: a narrower call leaves the columns past its head_dim unread).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "../../common/attention_params.h"
#include "../../common/dq_workspace.h"
#include "../common/dq_accum.h"
#include "dkdv_tail_plan.h"
#include "tensor_offsets.h"

namespace jax_flash::cuda::sm80 {

template <int kBlockN, int kHeadDim>
constexpr int64_t dkdv_tail_slot_floats() {
  // The Python side sizes the workspace in slots of kDkdvTailSlotFloats (common/dq_workspace.h).
  static_assert(2 * int64_t(kBlockN) * kHeadDim <= kDkdvTailSlotFloats, "a slot larger than the declared ones");
  return 2 * int64_t(kBlockN) * kHeadDim;
}

// Adds a CTA's dK and dV accumulators (mma.sync C fragments over [kBlockN, kHeadDim]; `coords` is the identity tensor
// partitioned like them) to its block's slot: one reduction per pair of adjacent columns, rows past the keys and
// columns past head_dim included (they hold zeros and are never converted).
template <int kBlockN, int kHeadDim, class Acc, class Coords>
__device__ __forceinline__ void add_to_dkdv_slot(float* slot, const Acc& acc_dk, const Acc& acc_dv,
                                                 const Coords& coords, float dk_scale) {
  float* dk = slot + cute::get<0>(coords(0)) * kHeadDim + cute::get<1>(coords(0));
  float* dv = dk + kBlockN * kHeadDim;
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc_dk); i += 2) {
    const int delta = (cute::get<0>(coords(i)) - cute::get<0>(coords(0))) * kHeadDim +
                      (cute::get<1>(coords(i)) - cute::get<1>(coords(0)));
    reduce_add_pair(dk + delta, acc_dk(i) * dk_scale, acc_dk(i + 1) * dk_scale, true);
    reduce_add_pair(dv + delta, acc_dv(i), acc_dv(i + 1), true);
  }
}

// Four floats of each of dK and dV per work item: the tail blocks' rows below seqlen_k and columns below head_dim (a
// multiple of 4: the fused pass's rule), grid-stride.
template <class T, int kBlockN, int kHeadDim>
__device__ __forceinline__ void dkdv_from_tail_slots(const AttentionBackwardParams& p, const DkdvTail& tail) {
  const int64_t groups_per_row = p.head_dim / 4;
  const int64_t count = int64_t(tail.tail_blocks) * kBlockN * groups_per_row;
  const int num_n_blocks = static_cast<int>(ceil_div(p.seqlen_k, kBlockN));
  const BshdShape kv_shape = key_shape(p);
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < count; i += stride) {
    const int col = static_cast<int>(i % groups_per_row) * 4;
    const int row = static_cast<int>(i / groups_per_row % kBlockN);
    const int64_t slot = i / groups_per_row / kBlockN;
    const BlockCoord block = block_coord(static_cast<unsigned>(tail.full_blocks + slot), num_n_blocks, p.heads_kv);
    const int64_t key = int64_t(block.block) * kBlockN + row;
    if (key >= p.seqlen_k) continue;
    const float* sums = tail.slots + slot * dkdv_tail_slot_floats<kBlockN, kHeadDim>() + row * kHeadDim + col;
    const float4 dk = *reinterpret_cast<const float4*>(sums);
    const float4 dv = *reinterpret_cast<const float4*>(sums + kBlockN * kHeadDim);
    const int64_t offset = kv_shape.offset(block.batch, key, block.head) + col;
    T* dk_out = static_cast<T*>(p.dk) + offset;
    T* dv_out = static_cast<T*>(p.dv) + offset;
    dk_out[0] = T(dk.x), dk_out[1] = T(dk.y), dk_out[2] = T(dk.z), dk_out[3] = T(dk.w);
    dv_out[0] = T(dv.x), dv_out[1] = T(dv.y), dv_out[2] = T(dv.z), dv_out[3] = T(dv.w);
  }
}

}  // namespace jax_flash::cuda::sm80
