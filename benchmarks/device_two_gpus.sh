#!/usr/bin/env bash
# One call on the two-GPU machine (nvidia-h200-x2), from the repository root with .whl carried: build the package
# with the head dims these runs use, then the sharding tests on both GPUs, the one- vs two-GPU benchmark, and the
# Flax training example (one GPU) comparing jax_flash, Flax's attention and cuDNN. Logs and JSON go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/device_two_gpus}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# NVLink multicast stays off (shared hosts; see the device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
stage() {  # stage NAME SECONDS COMMAND...: log to $out/NAME.log, keep going after a failure
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
repo=$(pwd)
stage install 60 python3 -m pip install -q --no-deps --no-index .whl/*.whl
# The nnx example needs Flax >= 0.12.8 (is_causal, num_kv_heads); carry it in .whl_flax when the image is older.
if ! python3 -c "import flax, sys; sys.exit(tuple(map(int, flax.__version__.split('.')[:3])) < (0, 12, 8))"; then
  stage install_flax 60 python3 -m pip install -q --no-deps --no-index .whl_flax/*.whl
fi
# A build left by an earlier call on this machine is reused. (Checked from /tmp: in the checkout, `import
# jax_flash` would find the uncompiled source tree.)
if ! (cd /tmp && python3 -c "import jax_flash, sys; sys.exit(not jax_flash.BUILT_WITH_CUDA)"); then
  JAX_FLASH_CUDA=ON JAX_FLASH_CUDA_ARCHS=90a JAX_FLASH_CUDA_HEAD_DIMS="${HEAD_DIMS:-32;64;128}" \
    stage build 240 python3 -m pip install --no-deps --no-build-isolation .
fi
(cd /tmp && JAX_FLASH_TEST_PLATFORM=gpu stage sharding_tests 150 python3 -m pytest -q -p no:cacheprovider -x --rootdir "$repo" \
  "$repo/tests/test_sharding.py" "$repo/tests/test_ring_attention.py")
stage bench_sharding 150 python3 benchmarks/bench_sharding.py --iters 5
cp benchmarks/results/sharding_*.json "$out/" 2>/dev/null
CUDA_VISIBLE_DEVICES=0 stage flax_lm 150 python3 examples/train_flax_lm.py --attention jax_flash flax cudnn \
  --seq-len 4096 --batch-size 8 --d-model 512 --num-heads 8 --num-kv-heads 8 --num-layers 4 --steps 30
# Peak device memory of forward + backward at 128k tokens (d=128, 16 heads): the kernels vs the XLA path.
for impl in jax_flash_sm80 xla; do
  CUDA_VISIBLE_DEVICES=0 stage "memory_$impl" 90 python3 benchmarks/bench_attention.py --memory-child "$impl" 131072
done
exit $status
