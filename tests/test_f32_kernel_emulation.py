"""The float32 CUDA kernels (exact and TF32, forward and backward) run on the CPU under a host emulation of the
CUDA built-ins against a float64 reference (csrc/cuda/tests/f32_emulation): their index, mask and MMA-fragment
logic is checked in CI, which has no GPU."""

import os
import shutil
import subprocess
import sys

import pytest

RUNNER = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda", "tests", "f32_emulation", "run.py")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20) to build the emulation")
def test_float32_kernels_under_host_emulation():
    result = subprocess.run([sys.executable, RUNNER], capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ALL OK" in result.stdout
