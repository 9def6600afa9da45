"""The sm80 fused dK/dV pass splits its last, partly filled wave of key blocks across every SM
(csrc/cuda/sm80/dkdv_tail_plan.h): each tail item must be covered exactly once, by pieces that each lie in one block.
The check (csrc/cuda/tests/dkdv_tail_plan_check.cc) runs on the CPU; it needs only g++."""

import os
import shutil
import subprocess

import pytest

SOURCE = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda", "tests", "dkdv_tail_plan_check.cc")
CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")


def test_tail_runs_cover_every_item_once(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    binary = tmp_path / "dkdv_tail_plan_check"
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", f"-I{CSRC}", SOURCE, "-o", str(binary)], check=True,
                   capture_output=True, text=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ALL OK" in result.stdout
