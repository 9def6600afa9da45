// The (seqlen, head_dim, heads, batch) shapes under which the TMA descriptors see the BSHD arrays: queries (q, O,
// dO) and keys (k, v). The host builds the descriptors over them (forward_launch.h bshd_tensor) and every kernel
// slices its descriptors' tensors with them. Params: AttentionParams or AttentionBackwardParams.
#pragma once

#include <cstdint>
#include <utility>

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

// Thread 0 of a kernel, before the first load: the descriptors into the TMA unit's cache.
template <class... Tmas>
__device__ __forceinline__ void prefetch_tma_descriptors(Tmas const&... tmas) {
  (cute::prefetch_tma_descriptor(tmas.get_tma_descriptor()), ...);
}

// A TMA pipeline of the warp-specialised kernels: warpgroup 0 produces (its thread 0 issues the loads and leads),
// the `consumers` threads after it consume, and each stage's barrier expects `stage_bytes`.
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params tma_pipeline_params(int consumers, uint32_t stage_bytes) {
  typename Pipeline::Params params;
  params.role = threadIdx.x < 128 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumers;
  params.transaction_bytes = stage_bytes;
  return params;
}

// (TMA source, TMA destination) of one load: tile(s) `tile` at `coord` of the tensor that `tma` reads under `shape`,
// at (head, batch), and `buffer` seen as `layout`.
template <class Tma, class Shape, class Tile, class Coord, class Element, class Layout>
__device__ __forceinline__ auto tma_load_pair(Tma const& tma, Shape const& shape, int64_t head, int64_t batch,
                                              Tile tile, Coord coord, Element* buffer, Layout layout) {
  using namespace cute;
  auto slice = tma.get_slice(0);
  return std::make_pair(slice.partition_S(local_tile(tma.get_tma_tensor(shape)(_, _, head, batch), tile, coord)),
                        slice.partition_D(make_tensor(make_smem_ptr(buffer), layout)));
}

}  // namespace jax_flash::cuda::sm90
