"""The sm80 kernels' batched dropout keep bits (csrc/cuda/sm80/keep_bits.h, one Philox call per eight elements)
equal the single-element definition of csrc/common/philox.h, for every accumulator layout the kernels use. The
check (csrc/cuda/tests/keep_bits_check.cc) runs on the CPU; it needs g++, the CUTLASS headers and the CUDA
toolkit's headers, and is skipped without them."""

import os
import shutil
import subprocess

import pytest

from cpu_checks import cutlass_include

SOURCE = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda", "tests", "keep_bits_check.cc")
CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")


def _cuda_include():
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    for root in filter(None, roots):
        if os.path.isfile(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


def test_batched_keep_bits_equal_the_single_element_definition(tmp_path):
    cutlass, cuda = cutlass_include(), _cuda_include()
    if shutil.which("g++") is None or cutlass is None or cuda is None:
        pytest.skip("needs g++, the CUTLASS headers (nvidia-cutlass) and the CUDA toolkit headers")
    binary = tmp_path / "keep_bits_check"
    includes = [f"-I{CSRC}", f"-I{cutlass}", f"-I{cuda}"]
    if os.path.isdir(os.path.join(cuda, "cccl")):
        includes.append(f"-I{os.path.join(cuda, 'cccl')}")
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", *includes, SOURCE, "-o", str(binary)], check=True,
                   capture_output=True, text=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ALL OK" in result.stdout
