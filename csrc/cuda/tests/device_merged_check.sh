#!/usr/bin/env bash
# One call on nvidia-h200-x2 (from the repository root, .whl carried) that checks a merged tree end to end when
# device time is short: build (head dims 64;128, sm_90a), the sharding + ring tests on both GPUs, then the GPU
# test grid with the newest features first. Each stage has a time limit; logs go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/device_merged_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
repo=$(pwd)
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start)) s"
  tail -n ${TAIL:-6} "$out/$name.log"
}
python3 -m pip install -q --no-deps --no-index .whl/*.whl
JAX_FLASH_CUDA=ON JAX_FLASH_CUDA_ARCHS=90a JAX_FLASH_CUDA_HEAD_DIMS="64;128" \
  stage build ${BUILD_LIMIT:-200} python3 -m pip install --no-deps --no-build-isolation -v .
cd /tmp
pytest_args=(-q -p no:cacheprovider --rootdir "$repo")
JAX_FLASH_TEST_PLATFORM=gpu stage sharding ${SHARDING_LIMIT:-100} python3 -m pytest "${pytest_args[@]}" -n 4 \
  "$repo/tests/test_ring_attention.py" "$repo/tests/test_sharding.py"
new="bias or mask or dropout or dbias or float32 or sm90 or backward_features or deterministic or graphs"
stage cuda_new ${NEW_LIMIT:-150} python3 -m pytest "${pytest_args[@]}" -n 24 "$repo/tests/test_cuda.py" \
  -k "($new) and not 192 and not 256"
stage cuda_rest ${REST_LIMIT:-120} python3 -m pytest "${pytest_args[@]}" -n 24 "$repo/tests/test_cuda.py" \
  -k "not ($new) and not 192 and not 256"
