"""The Hopper fused dQ's tile order (csrc/cuda/sm90/dq_staging.h): the consumers' staged offsets, the conversion's
decode and the prefix one bulk reduction adds agree for every thread and value of the kernels' own TiledMma, at
head dims 64 and 128 and every narrower head dim those kernels run. The check
(csrc/cuda/tests/dq_tile_order_check.cu) is host code; it needs nvcc (the sm90 headers do not compile with g++) and
the CUTLASS headers, and is skipped without them."""

from cpu_checks import run_nvcc_host_check


def test_staged_dq_order_round_trips_through_the_conversion(tmp_path):
    run_nvcc_host_check("dq_tile_order_check.cu", tmp_path)
