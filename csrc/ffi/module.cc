// The Python extension: hands Python one capsule per (platform, target) to register with XLA.
#include <nanobind/nanobind.h>

#include "attention_call.h"
#include "handlers.h"

namespace nb = nanobind;

namespace {

template <typename Handler>
nb::capsule capsule_of(Handler* handler) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

NB_MODULE(_C, m) {
  using jax_flash::ffi_boundary::kBackwardTarget;
  using jax_flash::ffi_boundary::kForwardTarget;

  m.def("registrations", [] {
    nb::dict by_platform;
    nb::dict cpu;
    cpu[kForwardTarget] = capsule_of(JaxFlashForwardCpu);
    cpu[kBackwardTarget] = capsule_of(JaxFlashBackwardCpu);
    by_platform["cpu"] = cpu;
#ifdef JAX_FLASH_WITH_CUDA
    nb::dict cuda;
    cuda[kForwardTarget] = capsule_of(JaxFlashForwardCuda);
    cuda[kBackwardTarget] = capsule_of(JaxFlashBackwardCuda);
    by_platform["CUDA"] = cuda;
#endif
    return by_platform;
  }, "Maps platform name -> {custom-call target -> XLA FFI handler capsule}.");

  m.def("target_names", [] { return nb::make_tuple(kForwardTarget, kBackwardTarget); },
        "The (forward, backward) custom-call target names.");

#ifdef JAX_FLASH_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
