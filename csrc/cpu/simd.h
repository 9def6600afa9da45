// A fixed 8-float vector through GCC/Clang vector extensions: compiled as AVX where a function is built for
// it (see JF_VECTOR_CLONES) and as SSE pairs otherwise, with no intrinsics and no per-ISA code.
#pragma once

#include <cstdint>

namespace jax_flash::cpu {

typedef float Float8 __attribute__((vector_size(32)));
// The same vector at any float-aligned address: dereferencing a pointer to it is an unaligned vector load or
// store. (Spelled as a type rather than as load/store helpers, which would be compiled for the baseline ISA and
// could not be inlined into the AVX clones.)
typedef float UnalignedFloat8 __attribute__((vector_size(32), aligned(4)));

// Hot functions are built twice on x86-64 (AVX2+FMA and baseline) and picked at load time, so one binary is
// fast on modern CPUs and still runs everywhere.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JF_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define JF_VECTOR_CLONES
#endif

}  // namespace jax_flash::cpu
