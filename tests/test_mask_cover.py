"""The sm90 forward walks its key tiles with QueryTileMaskBlocks (csrc/common/mask_blocks.h: one summary row per
query tile, 32-bit offsets); its covers must equal SliceMaskBlocks::cover, the sm80 kernels' definition, for every
summary layout. The check (csrc/cuda/tests/mask_cover_check.cc) runs on the CPU; it needs only g++."""

from cpu_checks import run_cpu_check


def test_query_tile_covers_equal_the_slice_definition(tmp_path):
    run_cpu_check("mask_cover_check.cc", tmp_path)
