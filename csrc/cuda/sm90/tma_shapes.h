// The (seqlen, head_dim, heads, batch) shapes under which the TMA descriptors see the BSHD arrays: queries (q, O,
// dO) and keys (k, v). The host builds the descriptors over them (forward_launch.h bshd_tensor) and every kernel
// slices its descriptors' tensors with them. Params: AttentionParams or AttentionBackwardParams.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

namespace jax_flash::cuda::sm90 {

template <class Params>
__host__ __device__ auto query_tma_shape(const Params& p) {
  return cute::make_shape(int32_t(p.seqlen_q), int32_t(p.head_dim), int32_t(p.heads_q), int32_t(p.batch));
}

template <class Params>
__host__ __device__ auto key_tma_shape(const Params& p) {
  return cute::make_shape(int32_t(p.seqlen_k), int32_t(p.head_dim), int32_t(p.heads_kv), int32_t(p.batch));
}

}  // namespace jax_flash::cuda::sm90
