"""The Hopper dK/dV consumers decide once per key block which query tiles need no per-element mask
(fully_visible_query_tiles in csrc/cuda/common/block_range.h, a closed form); it must name exactly the tiles the
per-tile definition (tile_fully_visible) accepts, for every mask geometry. The check
(csrc/cuda/tests/tile_span_check.cc) runs on the CPU; it needs only g++."""

from cpu_checks import run_cpu_check


def test_fully_visible_query_tiles_match_the_per_tile_definition(tmp_path):
    run_cpu_check("tile_span_check.cc", tmp_path)
