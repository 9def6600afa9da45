"""The Hopper kernels stage accumulator tiles in shared memory with stmatrix (store_accumulators in
csrc/cuda/sm90/fragments.h); every element must land where the element-wise copy would put it, for each staging
destination of the kernels. The check (csrc/cuda/tests/stmatrix_store_check.cu) runs on the CPU: it needs nvcc (for
CuTe's host code; no GPU) and the CUTLASS headers, and is skipped without them."""

from cpu_checks import run_nvcc_host_check


def test_stmatrix_staging_matches_the_element_wise_copy(tmp_path):
    run_nvcc_host_check("stmatrix_store_check.cu", tmp_path)
