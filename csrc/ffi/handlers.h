// The exported XLA FFI handler symbols, one per (call, platform).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBackwardCpu);

#ifdef JAX_FLASH_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBackwardCuda);
#endif
