#!/usr/bin/env bash
# On the GPU machine, from the repository root (.whl carried): build the package with its CUDA kernels for
# sm_90a, link the standalone check against the same kernel library, then run the requested stages.
#   bash csrc/cuda/tests/device_check.sh build check sanitize bench pytest attention
# `standalone` builds only the kernel library and the check (this folder's CMakeLists.txt), not the package.
# Logs go to $OUT (the device tool's output folder) or /tmp/device_check.
set -uo pipefail
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
repo=$(pwd)
run() {  # run NAME COMMAND...: log to $out/NAME.log, remember failures, keep going
  local name=$1
  shift
  echo "=== $name: $*"
  local start=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  tail -n 40 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}

build() {
  python3 -m pip install -q --no-deps --no-index .whl/*.whl || return 1
  JAX_FLASH_CUDA=ON JAX_FLASH_CUDA_ARCHS=${JAX_FLASH_CUDA_ARCHS:-90a} \
    python3 -m pip install --no-deps --no-build-isolation -v . || return 1
  local cutlass library
  cutlass=$(python3 -c "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
  library=$(find build -name libjax_flash_cuda_kernels.a | head -1)
  nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -Icsrc -I"$cutlass" \
    csrc/cuda/tests/standalone_check.cu "$library" -o build/standalone_check
}

standalone() {
  python3 -m pip install -q --no-deps --no-index .whl/*.whl || return 1
  local cutlass
  cutlass=$(python3 -c "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
  cmake -S csrc/cuda/tests -B build/cuda_tests -G Ninja -DCUTLASS_INCLUDE_DIR="$cutlass" \
    -DJAX_FLASH_CUDA_ARCHS=${JAX_FLASH_CUDA_ARCHS:-90a} || return 1
  cmake --build build/cuda_tests && cp build/cuda_tests/standalone_check build/standalone_check
}

for stage in "$@"; do
  case $stage in
    build) run build build ;;
    standalone) run standalone standalone ;;
    check) run check build/standalone_check ;;
    sanitize)
      run memcheck compute-sanitizer --tool memcheck --error-exitcode 3 build/standalone_check --small
      run racecheck compute-sanitizer --tool racecheck --error-exitcode 3 build/standalone_check --small
      run synccheck compute-sanitizer --tool synccheck --error-exitcode 3 build/standalone_check --small ;;
    bench) run bench build/standalone_check --bench ;;
    # From outside the checkout, so that `import jax_flash` finds the installed package, not the source tree.
    pytest) (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false run pytest timeout ${PYTEST_TIMEOUT:-300} \
      pytest -q -p no:cacheprovider -n ${PYTEST_WORKERS:-8} --rootdir "$repo" "$repo/${PYTEST_ARGS:-tests/test_cuda.py}")
      [ -s "$out/pytest.log" ] && grep -q " passed" "$out/pytest.log" || status=1 ;;
    attention) run attention python3 benchmarks/bench_attention.py --out-dir "$out" ${BENCH_ARGS:-} ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
