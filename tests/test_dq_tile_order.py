"""The Hopper fused dQ's tile order (csrc/cuda/sm90/dq_staging.h): the consumers' staged offsets, the conversion's
decode and the prefix one bulk reduction adds agree for every thread and value of the kernels' own TiledMma, at
head dims 64 and 128 and every narrower head dim those kernels run. The check
(csrc/cuda/tests/dq_tile_order_check.cu) is host code; it needs nvcc (the sm90 headers do not compile with g++) and
the CUTLASS headers, and is skipped without them."""

import os
import shutil
import subprocess

import pytest

from test_dropout_keep_bits import _cutlass_include

SOURCE = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda", "tests", "dq_tile_order_check.cu")
CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")


def test_staged_dq_order_round_trips_through_the_conversion(tmp_path):
    cutlass = _cutlass_include()
    if shutil.which("nvcc") is None or cutlass is None:
        pytest.skip("needs nvcc and the CUTLASS headers (nvidia-cutlass)")
    binary = tmp_path / "dq_tile_order_check"
    subprocess.run(["nvcc", "-std=c++17", "--expt-relaxed-constexpr", f"-I{CSRC}", f"-I{cutlass}", SOURCE, "-o",
                    str(binary)], check=True, capture_output=True, text=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ALL OK" in result.stdout
