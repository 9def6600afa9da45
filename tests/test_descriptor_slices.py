"""The Hopper kernels slice their WGMMA shared-memory descriptors with their warpgroup's first thread (a warp-uniform
value, so that the descriptors stay in uniform registers; csrc/cuda/sm90/fragments.h warp_uniform). The check
(csrc/cuda/tests/descriptor_slices_check.cu) runs CuTe's partitioning on the CPU and asserts that every thread's
slice of each operand equals its warpgroup's first thread's, with a control that warpgroups differ on A. It needs
nvcc (for CuTe's host code; no GPU) and the CUTLASS headers, and is skipped without them."""

from cpu_checks import run_nvcc_host_check


def test_every_thread_of_a_warpgroup_has_its_first_threads_operand_slices(tmp_path):
    run_nvcc_host_check("descriptor_slices_check.cu", tmp_path)
