// Host launcher of the split-TF32 forward (float32_precision="highest" on the Hopper kernel; common/tf32_workspace.h
// says what it computes and what the workspace holds): pre-passes that write each operand's hi and lo parts into
// the call's workspace, then forward_kernel with the kSplitTf32 tile (kernel_traits.h), whose TMA loads read those
// parts. One kernel form per translation unit, as the 16-bit and TF32 forwards (split_tf32_dispatch.h picks it).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "../../common/attention_params.h"
#include "../../common/tf32_workspace.h"
#include "forward_launch.h"
#include "split_tf32_prepass.h"
#include "tf32_v_transpose.h"

namespace jax_flash::cuda::sm90 {

template <int kHeadDim, ForwardVariant kVariant>
std::string launch_split_tf32_variant(const AttentionParams& p, cudaStream_t stream) {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the split-TF32 tiles and the workspace's head dims");
  using Traits = ForwardTraits<kHeadDim, cutlass::tfloat32_t, RowTile::kSplitTf32>;
  if (p.tf32_vt == nullptr || !p.split_tf32) return "sm90 split-TF32 forward: no split-TF32 workspace";
  const SplitTf32Parts parts =
      split_tf32_parts(p.tf32_vt, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim);
  if (std::string err = launch_tf32_v_transpose<kHeadDim>(p, stream, parts.vt.lo); !err.empty()) return err;
  if (std::string err = launch_split_parts(p.q, parts.q, p.batch * p.seqlen_q * p.heads_q * p.head_dim, stream);
      !err.empty()) {
    return err;
  }
  if (std::string err = launch_split_parts(p.k, parts.k, p.batch * p.seqlen_k * p.heads_kv * p.head_dim, stream);
      !err.empty()) {
    return err;
  }
  bool persistent = false;
  int64_t max_ctas = 0;
  if (std::string err = persistent_switch(p.seqlen_k, &persistent, &max_ctas); !err.empty()) return err;
  // The kernel's Q and K descriptors read the hi parts; launch_tiles adds those of the lo parts (Traits::kSplit).
  AttentionParams hi = p;
  hi.q = parts.q.hi;
  hi.k = parts.k.hi;
  return launch_tiles<Traits, kVariant>(hi, persistent, max_ctas, stream);
}

}  // namespace jax_flash::cuda::sm90
