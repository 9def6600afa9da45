"""The sm90 forward walks its key tiles with QueryTileMaskBlocks (csrc/common/mask_blocks.h: one summary row per
query tile, 32-bit offsets); its covers must equal SliceMaskBlocks::cover, the sm80 kernels' definition, for every
summary layout. The check (csrc/cuda/tests/mask_cover_check.cc) runs on the CPU; it needs only g++."""

import os
import shutil
import subprocess

import pytest

SOURCE = os.path.join(os.path.dirname(__file__), "..", "csrc", "cuda", "tests", "mask_cover_check.cc")
CSRC = os.path.join(os.path.dirname(__file__), "..", "csrc")


def test_query_tile_covers_equal_the_slice_definition(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    binary = tmp_path / "mask_cover_check"
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", f"-I{CSRC}", SOURCE, "-o", str(binary)], check=True,
                   capture_output=True, text=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ALL OK" in result.stdout
