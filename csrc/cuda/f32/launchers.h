// Declarations of the float32 launchers. Each (head dim, direction) is defined by its own generated translation
// unit in instantiations/ (csrc/cuda/generate_instantiations.py), so the dispatcher never compiles a kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../../common/attention_params.h"

namespace jax_flash::cuda::f32 {

// p.allow_tf32: TF32 tensor cores (operands rounded to TF32, float32 accumulation); otherwise exact float32,
// every product and sum a float32 FMA.
template <int kHeadDim>
std::string launch_forward(const AttentionParams& p, cudaStream_t stream);

// Likewise, except that head dims above 128 run the exact backward in both modes (the TF32 one keeps two
// 16 x head_dim accumulators per warp in registers). `hopper`, where given (a call of the common variant: TF32, or
// exact with the split-TF32 workspace), runs the dK/dV and dQ passes instead of this family's (dispatch.cu: the
// Hopper ones).
using PassLauncher = std::string (*)(const AttentionBackwardParams&, cudaStream_t);
struct Tf32Passes {
  PassLauncher dkdv = nullptr;
  PassLauncher dq = nullptr;
  bool given() const { return dkdv != nullptr; }
};

template <int kHeadDim>
std::string launch_backward(const AttentionBackwardParams& p, cudaStream_t stream, Tf32Passes hopper = {});

}  // namespace jax_flash::cuda::f32
