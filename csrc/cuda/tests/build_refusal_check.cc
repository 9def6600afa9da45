// CPU check of build_refusal.h: the messages dispatch.cu builds with build_refusal() are recognised, the
// refusals of invalid calls and kernel errors are not. Prints ALL OK and exits 0 when every expectation holds
// (tests/test_build_refusal.py).
#include <cstdio>
#include <string>

#include "cuda/build_refusal.h"

int main() {
  using jax_flash::cuda::build_refusal;
  using jax_flash::cuda::is_build_refusal;
  int failures = 0;
  auto expect = [&](bool got, bool want, const std::string& message) {
    if (got != want) {
      std::printf("FAIL: is_build_refusal(\"%s\") = %d\n", message.c_str(), got);
      ++failures;
    }
  };
  for (const std::string& message :
       {build_refusal("no float16 kernels (built with JAX_FLASH_CUDA_FP16=OFF)"),
        build_refusal("no kernels for head_dim 128 or larger (JAX_FLASH_CUDA_HEAD_DIMS)"),
        build_refusal("no sm_90a backward kernel for head_dim 256")}) {
    expect(is_build_refusal(message), true, message);
  }
  for (const std::string& message :
       {std::string("head_dim must be between 1 and 256, got 300"),
        std::string("heads_q must be a multiple of heads_kv"),
        std::string("sm90 forward kernel launch: invalid argument"), std::string(""),
        std::string("sm90 forward: this build has no kernel")}) {  // only a message that starts with it
    expect(is_build_refusal(message), false, message);
  }
  if (failures == 0) std::printf("ALL OK\n");
  return failures == 0 ? 0 : 1;
}
