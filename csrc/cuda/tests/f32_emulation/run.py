#!/usr/bin/env python3
"""Runs the float32 CUDA kernels (exact and TF32, forward and backward) on the CPU under a host emulation of the
CUDA built-ins they use, against a float64 reference: catches indexing, masking and fragment-layout mistakes
without a GPU. Each CUDA thread is a fiber that runs until its next barrier (__syncthreads, warp collectives;
emu_cuda.h), so a missing __syncthreads shows as a wrong result (the fibers ahead read poisoned shared memory);
cvt.rna.tf32, mma.m16n8k8 TF32 and cp.async are emulated (emu_ptx.h), swapped into a temporary copy of csrc.
Other races that real hardware could expose are not guaranteed to show; use compute-sanitizer for those.

  python3 csrc/cuda/tests/f32_emulation/run.py   # exit status 0 when every case is within bound
"""
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
CSRC = HERE.parents[2]


def replace_function(text: str, signature: str, body: str) -> str:
    start = text.index(signature)
    depth, end = 0, text.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            break
        end += 1
    return text[:start] + body + text[end + 1:]


def emulated_tf32_header(text: str) -> str:
    text = text.replace("#include <cute/arch/mma_sm80.hpp>", '#include "emu_ptx.h"')
    text = replace_function(text, "__device__ __forceinline__ uint32_t to_tf32(float x)",
                            "__device__ __forceinline__ uint32_t to_tf32(float x) { return emu_to_tf32(x); }")
    text = replace_function(text, "__device__ __forceinline__ float exp2_approx(float x)",
                            "__device__ __forceinline__ float exp2_approx(float x) { return emu_exp2_approx(x); }")
    text = replace_function(text, "  __device__ __forceinline__ static void run(",
                            "  static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) "
                            "{ emu_mma(c, a, b0, b1); }")
    if re.search(r"\basm\b", text):
        raise SystemExit("tf32_mma.h has PTX this emulation does not replace")
    return text


def emulated_async_copy_header(text: str) -> str:
    """f32/async_copy.h (the cp.async tile loads of every float32 kernel) with synchronous copies."""
    text = text.replace("#include <cstdint>", '#include <cstdint>\n\n#include "emu_ptx.h"')
    text = replace_function(text, "__device__ __forceinline__ void cp_async_16(",
                            "__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool fill) "
                            "{ emu_cp_async(smem, gmem, fill); }")
    text = replace_function(text, "__device__ __forceinline__ void cp_async_commit()",
                            "__device__ __forceinline__ void cp_async_commit() {}")
    text = replace_function(text, "__device__ __forceinline__ void cp_async_wait()",
                            "__device__ __forceinline__ void cp_async_wait() {}")
    if re.search(r"\basm\b|__cvta", text):
        raise SystemExit("async_copy.h has PTX this emulation does not replace")
    return text


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        shutil.copytree(CSRC, work / "csrc")
        for name, emulated in (("tf32_mma.h", emulated_tf32_header), ("async_copy.h", emulated_async_copy_header)):
            header = work / "csrc/cuda/f32" / name
            header.write_text(emulated(header.read_text()))
        binary = work / "harness"
        compiler = shutil.which("g++") or "c++"
        subprocess.run([compiler, "-std=c++20", "-O2", f"-I{HERE}", f"-I{work / 'csrc'}",
                        str(HERE / "harness.cc"), "-o", str(binary)], check=True)
        return subprocess.run([str(binary)]).returncode


if __name__ == "__main__":
    sys.exit(main())
