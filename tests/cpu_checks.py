"""Build and run one of the CPU-side C++ checks in csrc/cuda/tests (host code of the kernels, compiled with g++):
they print ALL OK and exit 0 when every comparison holds."""

import os
import shutil
import subprocess

import pytest

_CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")


def run_cpu_check(source_name: str, tmp_path) -> None:
    """Compiles csrc/cuda/tests/<source_name> with g++ (skips without it), runs it and asserts it passed."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    source = os.path.join(_CSRC, "cuda", "tests", source_name)
    binary = tmp_path / os.path.splitext(source_name)[0]
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", f"-I{_CSRC}", source, "-o", str(binary)], check=True,
                   capture_output=True, text=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ALL OK" in result.stdout
