"""Build and run one of the CPU-side C++ checks in csrc/cuda/tests (host code of the kernels, compiled with g++, or
with nvcc where the headers need it): they print ALL OK and exit 0 when every comparison holds."""

import os
import shutil
import subprocess

import pytest

_CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")


def _expect_all_ok(binary) -> None:
    """Runs a built check and asserts it passed (exit 0 and ALL OK)."""
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ALL OK" in result.stdout


def run_cpu_check(source_name: str, tmp_path) -> None:
    """Compiles csrc/cuda/tests/<source_name> with g++ (skips without it), runs it and asserts it passed."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    source = os.path.join(_CSRC, "cuda", "tests", source_name)
    binary = tmp_path / os.path.splitext(source_name)[0]
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", f"-I{_CSRC}", source, "-o", str(binary)], check=True,
                   capture_output=True, text=True)
    _expect_all_ok(binary)


def cutlass_include():
    """The CUTLASS/CuTe include folder: $CUTLASS_INCLUDE_DIR, else the nvidia-cutlass wheel's; None without either."""
    if os.path.isdir(os.path.join(os.environ.get("CUTLASS_INCLUDE_DIR", ""), "cute")):
        return os.environ["CUTLASS_INCLUDE_DIR"]
    try:
        import cutlass_library
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return path if os.path.isdir(os.path.join(path, "cute")) else None


def run_nvcc_host_check(source_name: str, tmp_path) -> None:
    """Compiles csrc/cuda/tests/<source_name> with nvcc as host code against CuTe (skips without nvcc or the CUTLASS
    headers; no GPU needed), runs it and asserts it passed."""
    cutlass = cutlass_include()
    if shutil.which("nvcc") is None or cutlass is None:
        pytest.skip("needs nvcc and the CUTLASS headers (nvidia-cutlass)")
    source = os.path.join(_CSRC, "cuda", "tests", source_name)
    binary = tmp_path / os.path.splitext(source_name)[0]
    build = subprocess.run(["nvcc", "-std=c++17", "--expt-relaxed-constexpr", "-O1", "-w", f"-I{_CSRC}",
                            f"-I{cutlass}", source, "-o", str(binary)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    _expect_all_ok(binary)
