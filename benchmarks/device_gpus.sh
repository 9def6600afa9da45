#!/usr/bin/env bash
# One call on a machine with several GPUs (nvidia-h200-x2 / -x4 / -x8), from the repository root with .whl (and
# prebuilt/, if current) carried: build the package (kept between calls on a warm machine), then the named stages
# in order, each under its own time limit ($<STAGE>_LIMIT seconds), logging to $OUT/<stage>.log; result JSON goes
# to $OUT too, and at the end all of it into $OUT/results.tar.gz beside $OUT/summary.log (one line per stage). With
# no stage named: tests bench_sharding train_equal train_long.
#   tests           the sharding and ring-attention tests on every GPU (JAX_FLASH_TEST_PLATFORM=gpu)
#   bench_sharding  benchmarks/bench_sharding.py: batch and head sharding at $SHARD_SEQ_LEN tokens (default 32k),
#                   at 1, 2, 4 ... every GPU
#   bench_ring      the same script's ring cases (jit-partitioned, zigzag shard_map) on one sequence of each of
#                   $RING_SEQ_LENS tokens (default 65536 131072)
#   train_equal     benchmarks/bench_sharded_training.py on a small model at 1, 2, 4 ... every GPU: its first-step
#                   losses must agree with the one-GPU run's (the script exits 1 otherwise)
#   train_long      the same at $TRAIN_SEQ_LENS tokens (default 65536 131072), one sequence, every GPU on its ring:
#                   step time and scaling efficiency against one and two GPUs
#   flax_lm         examples/train_flax_lm.py on one GPU: jax_flash, Flax's attention and cuDNN
#   memory          peak memory of forward + backward at 128k tokens on one GPU, the kernels against the XLA path
set -uo pipefail
out=${OUT:-/tmp/device_gpus}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# NVLink multicast stays off (shared hosts; see the device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
stage() {  # stage NAME DEFAULT_SECONDS COMMAND...: log to $out/NAME.log, keep going after a failure
  local name=$1 limit_var=${1^^}_LIMIT
  local limit=${!limit_var:-$2}
  shift 2
  echo "=== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/summary.log"
  tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
repo=$(pwd)
# The nnx example needs Flax >= 0.12.8 (is_causal, num_kv_heads); carry it in .whl_flax when the image is older.
if ! python3 -c "import flax, sys; sys.exit(tuple(map(int, flax.__version__.split('.')[:3])) < (0, 12, 8))"; then
  stage install_flax 60 python3 -m pip install -q --no-deps --no-index .whl_flax/*.whl
fi
# The package as the single-GPU script builds it (csrc/cuda/tests/device_run.sh build: skipped on a warm machine whose
# sources and switches are unchanged, the carried prebuilt/ kernel library linked where its stamp matches); the
# float16 kernels left out unless JAX_FLASH_CUDA_FP16 says otherwise, as no run here uses them.
JAX_FLASH_CUDA_FP16=${JAX_FLASH_CUDA_FP16:-OFF} OUT=$out/build stage build 560 bash csrc/cuda/tests/device_run.sh build
grep "^build" "$out/build/summary.log" 2>/dev/null
# The model of the training stages: 8 heads of 128, 4 layers.
model=(--d-model 1024 --num-heads 8 --num-kv-heads 8 --num-layers 4)

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests bench_sharding train_equal train_long)
for name in "${stages[@]}"; do
  case $name in
    tests)
      # From /tmp: in the checkout, `import jax_flash` would find the uncompiled source tree.
      JAX_FLASH_TEST_PLATFORM=gpu stage tests 200 env -C /tmp python3 -m pytest -q -p no:cacheprovider -x \
        --rootdir "$repo" "$repo/tests/test_sharding.py" "$repo/tests/test_ring_attention.py" ;;
    bench_sharding)
      stage bench_sharding 200 python3 benchmarks/bench_sharding.py --cases batch heads \
        --seq-len "${SHARD_SEQ_LEN:-32768}" --iters 5 --out-dir "$out" --tag "${gpus}gpus" ;;
    bench_ring)
      for seq_len in ${RING_SEQ_LENS:-65536 131072}; do
        stage "bench_ring_$seq_len" 200 python3 benchmarks/bench_sharding.py --cases ring-jit ring-zigzag \
          --seq-len "$seq_len" --iters 3 --out-dir "$out" --tag "${gpus}gpus_ring$seq_len"
      done ;;
    train_equal)
      stage train_equal 200 python3 benchmarks/bench_sharded_training.py --attention both --seq-len 4096 \
        --batch-size 8 "${model[@]}" --steps 5 --out-dir "$out" --tag "${gpus}gpus_equal" ;;
    train_long)
      for seq_len in ${TRAIN_SEQ_LENS:-65536 131072}; do
        stage "train_long_$seq_len" 300 python3 benchmarks/bench_sharded_training.py --all-on-sequence \
          --attention both --seq-len "$seq_len" --batch-size 1 "${model[@]}" --steps 6 --out-dir "$out" \
          --tag "${gpus}gpus_seq$seq_len"
      done ;;
    flax_lm)
      CUDA_VISIBLE_DEVICES=0 stage flax_lm 150 python3 examples/train_flax_lm.py --attention jax_flash flax cudnn \
        --seq-len 4096 --batch-size 8 --d-model 512 --num-heads 8 --num-kv-heads 8 --num-layers 4 --steps 30 ;;
    memory)
      # Peak device memory of forward + backward at 128k tokens (d=128, 16 heads): the kernels vs the XLA path.
      for impl in jax_flash_sm80 xla; do
        CUDA_VISIBLE_DEVICES=0 stage "memory_$impl" 90 python3 benchmarks/bench_attention.py --memory-child "$impl" \
          131072
      done ;;
    *) echo "unknown stage $name" >&2; status=1 ;;
  esac
done
# The device tool brings back at most 8 files: everything but summary.log travels in one archive.
archive=$(mktemp --suffix=.tar.gz)
(cd "$out" && tar czf "$archive" --exclude=summary.log . && find . -mindepth 1 ! -name summary.log -delete &&
  mv "$archive" results.tar.gz)
exit $status
