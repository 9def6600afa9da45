"""The Hopper kernels stage accumulator tiles in shared memory with stmatrix (store_accumulators in
csrc/cuda/sm90/fragments.h); every element must land where the element-wise copy would put it, for each staging
destination of the kernels. The check (csrc/cuda/tests/stmatrix_store_check.cu) runs on the CPU: it needs nvcc (for
CuTe's host code; no GPU) and the CUTLASS headers, and is skipped without them."""

import os
import shutil
import subprocess

import pytest

from test_dropout_keep_bits import _cutlass_include

SOURCE = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda", "tests", "stmatrix_store_check.cu")
CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")


def test_stmatrix_staging_matches_the_element_wise_copy(tmp_path):
    cutlass = _cutlass_include()
    if shutil.which("nvcc") is None or cutlass is None:
        pytest.skip("needs nvcc and the CUTLASS headers (nvidia-cutlass)")
    binary = tmp_path / "stmatrix_store_check"
    build = subprocess.run(["nvcc", "-std=c++17", "--expt-relaxed-constexpr", "-O1", "-w", f"-I{CSRC}",
                            f"-I{cutlass}", SOURCE, "-o", str(binary)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ALL OK" in result.stdout
