// Host launcher of the Hopper forward kernel for one (head dim, element type); instantiated once per generated
// .cu (sm_90a only). Builds the three TMA descriptors for this call's pointers and shapes.
#pragma once

#include <string>

#include "../../common/attention_params.h"
#include "../common/block_range.h"
#include "../sm80/launch_common.h"
#include "../sm80/score_tile.h"
#include "forward_kernel.h"
#include "kernel_traits.h"

namespace jax_flash::cuda::sm90 {

// (seqlen, head_dim, heads, batch) view of a contiguous BSHD array, as the TMA descriptors see it.
template <class Traits>
auto bshd_tensor(const void* data, int64_t seqlen, int64_t heads, int64_t head_dim, int64_t batch) {
  using namespace cute;
  using T = typename Traits::Element;
  const auto shape = make_shape(int32_t(seqlen), int32_t(head_dim), int32_t(heads), int32_t(batch));
  const auto stride = make_stride(heads * head_dim, _1{}, head_dim, seqlen * heads * head_dim);
  return make_tensor(make_gmem_ptr(static_cast<const T*>(data)), make_layout(shape, stride));
}

template <int kHeadDim, class Element>
std::string launch_forward(const AttentionParams& p, cudaStream_t stream) {
  using namespace cute;
  using Traits = ForwardTraits<kHeadDim, Element>;
  if (p.batch > INT32_MAX || p.heads_q > INT32_MAX) return "sm90 forward: batch or heads beyond TMA coordinates";
  ForwardArgs<Traits> args{p,
                           make_tma_copy(SM90_TMA_LOAD{},
                                         bshd_tensor<Traits>(p.q, p.seqlen_q, p.heads_q, p.head_dim, p.batch),
                                         typename Traits::SmemLayoutQ{},
                                         Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{}),
                           make_tma_copy(SM90_TMA_LOAD{},
                                         bshd_tensor<Traits>(p.k, p.seqlen_k, p.heads_kv, p.head_dim, p.batch),
                                         take<0, 2>(typename Traits::SmemLayoutKV{}),
                                         Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{}),
                           make_tma_copy(SM90_TMA_LOAD{},
                                         bshd_tensor<Traits>(p.v, p.seqlen_k, p.heads_kv, p.head_dim, p.batch),
                                         take<0, 2>(typename Traits::SmemLayoutKV{}),
                                         Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{})};
  auto kernel = sm80::needs_general_variant(p) ? forward_kernel<Traits, true> : forward_kernel<Traits, false>;
  if (std::string err = sm80::allow_dynamic_smem(kernel, Traits::kSmemBytes); !err.empty()) return err;
  unsigned grid = 0;
  if (std::string err = sm80::grid_size(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch, &grid);
      !err.empty()) {
    return err;
  }
  if (grid == 0) return {};
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
  return sm80::last_launch_error("sm90 forward kernel launch");
}

}  // namespace jax_flash::cuda::sm90
