# Decides JAX_FLASH_BUILD_CUDA from JAX_FLASH_CUDA (AUTO|ON|OFF) and finds the CUTLASS/CuTe headers.
include(CheckLanguage)

set(JAX_FLASH_BUILD_CUDA OFF)
string(TOUPPER "${JAX_FLASH_CUDA}" _cuda_mode)
if(_cuda_mode STREQUAL "ON")
  set(JAX_FLASH_BUILD_CUDA ON)
elseif(_cuda_mode STREQUAL "AUTO")
  # A compiler alone is not enough: without a driver the kernels could never run, and a full kernel build
  # costs many minutes on a small machine.
  check_language(CUDA)
  find_library(_libcuda NAMES cuda libcuda.so.1
               PATHS /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/lib/wsl/lib)
  if(CMAKE_CUDA_COMPILER AND _libcuda)
    set(JAX_FLASH_BUILD_CUDA ON)
  endif()
elseif(NOT _cuda_mode STREQUAL "OFF")
  message(FATAL_ERROR "JAX_FLASH_CUDA must be AUTO, ON or OFF, got '${JAX_FLASH_CUDA}'")
endif()
message(STATUS "jax_flash: CUDA kernels ${JAX_FLASH_BUILD_CUDA} (JAX_FLASH_CUDA=${JAX_FLASH_CUDA})")

if(JAX_FLASH_BUILD_CUDA)
  set(CMAKE_CUDA_ARCHITECTURES "${JAX_FLASH_CUDA_ARCHS}")
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  if(DEFINED ENV{CUTLASS_INCLUDE_DIR} AND NOT DEFINED CUTLASS_INCLUDE_DIR)
    set(CUTLASS_INCLUDE_DIR "$ENV{CUTLASS_INCLUDE_DIR}")
  endif()
  if(NOT CUTLASS_INCLUDE_DIR)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
              "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
      OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE CUTLASS_INCLUDE_DIR RESULT_VARIABLE _cutlass_found)
  endif()
  if(NOT EXISTS "${CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
    message(FATAL_ERROR "CUTLASS/CuTe headers not found: pip install nvidia-cutlass, or set CUTLASS_INCLUDE_DIR")
  endif()
  message(STATUS "jax_flash: CUTLASS headers ${CUTLASS_INCLUDE_DIR}, archs ${CMAKE_CUDA_ARCHITECTURES}")
endif()
