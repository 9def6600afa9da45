// CUTLASS's sm90 pipelines, with their role checks compiled in even where NDEBUG is defined (release builds).
//
// Why: each consumer_wait / consumer_release then begins with a branch on the pipeline's role that the optimiser
// cannot resolve (it never fires here). ptxas does not hoist address and descriptor arithmetic across it into the
// stretch before, where dK, dV, S^T and dP^T already fill a backward consumer's registers. Without the checks, the
// Hopper backward's dK/dV kernels spilled (ptxas -v, nvcc 13.0, -DNDEBUG; d=128 fused dQ 48 bytes per thread,
// reloaded every query tile: 18M local-memory requests per launch at d=128 4k in Nsight Compute; d=64 and the
// d=128 transforms form 8-16 bytes, the masked form 60-120); with them, 0 outside the masked form. A fence of our
// own (an opaque branch before each call) did not reproduce it. The checks cost a compare and a branch per call.
// This header must be the first to include sm90_pipeline.hpp in a translation unit (its include guard keeps the
// first copy): the Hopper kernels' traits include it before any other CUTLASS header.
#pragma once

#pragma push_macro("NDEBUG")
#undef NDEBUG
#include <cutlass/pipeline/sm90_pipeline.hpp>
#pragma pop_macro("NDEBUG")
