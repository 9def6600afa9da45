"""The sm80 fused dK/dV pass splits its last, partly filled wave of key blocks across every SM
(csrc/cuda/sm80/dkdv_tail_plan.h): each tail item must be covered exactly once, by pieces that each lie in one block.
The check (csrc/cuda/tests/dkdv_tail_plan_check.cc) runs on the CPU; it needs only g++."""

from cpu_checks import run_cpu_check


def test_tail_pieces_cover_every_item_once(tmp_path):
    run_cpu_check("dkdv_tail_plan_check.cc", tmp_path)
