#!/usr/bin/env bash
# One device call for issue #7 (the experimental Hopper backward), from the repository root with .whl carried:
#   build (head dims 64 and 128, sm_90a) -> the standalone float64 check through the sm90 backward ->
#   compute-sanitizer memcheck / racecheck / synccheck on its small grid, alongside the sm90 backward pytest cases ->
#   backward throughput: jax_flash's sm80 backward vs the sm90 backward vs cuDNN (bench_attention.py rows at seqlen
#   4k, d=64 and 128) and the standalone --bench under both families.
# Logs in $OUT (summary.log first); about 8 minutes on an H200. Every stage has a timeout, so a hanging kernel
# (a pipeline deadlock) costs its stage, not the call.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"; repo=$(pwd); t0=$SECONDS
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stamp() { echo "$1 at $((SECONDS - t0)) s" | tee -a "$out/summary.log"; }
nvidia-smi -L > "$out/env.log" 2>&1

JAX_FLASH_CUDA_HEAD_DIMS="64;128" JAX_FLASH_CUDA_ARCHS=90a timeout 330 bash csrc/cuda/tests/device_check.sh build \
  > "$out/device_check.log" 2>&1
status=$?
stamp "build exit $status"
if [ $status -ne 0 ]; then tail -n 60 "$out/build.log"; exit 1; fi
check=$repo/build/standalone_check

timeout 90 "$check" --sm90-backward > "$out/standalone_sm90_backward.log" 2>&1
status=$?
stamp "standalone --sm90-backward exit $status"
grep -E "FAIL|passed" "$out/standalone_sm90_backward.log" | tail -n 20
if [ $status -eq 124 ]; then  # a hang (pipeline deadlock): every later stage would hang too
  tail -n 30 "$out/standalone_sm90_backward.log"; exit 1
fi

# The pytest cases of the sm90 backward (ids carry "sm90") run while the sanitizers take turns on the small grid.
(cd /tmp && timeout 180 python3 -m pytest -q -p no:cacheprovider -n 8 --rootdir "$repo" "$repo/tests/test_cuda.py" \
   -k "backward and sm90" -rfs > "$out/pytest.log" 2>&1; stamp "pytest (sm90 backward) exit $?") &
pytest_pid=$!
for tool in memcheck racecheck synccheck; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 3 "$check" --sm90-backward --small \
    > "$out/$tool.log" 2>&1
  stamp "$tool exit $?"
  tail -n 3 "$out/$tool.log"
done
wait $pytest_pid
tail -n 15 "$out/pytest.log"

for family in sm80 sm90; do
  JAX_FLASH_CUDA_KERNEL_BACKWARD=$family timeout 40 "$check" --bench > "$out/bench_standalone_$family.log" 2>&1
  stamp "standalone --bench ($family backward) exit $?"
  cat "$out/bench_standalone_$family.log"
done
timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/bench_attention.py --head-dims 64 128 --seqlens 4096 --reps 5 \
  --impls jax_flash_sm80 jax_flash_sm90_bwd cudnn --out-dir "$out" > "$out/bench.log" 2>&1
stamp "bench_attention exit $?"
grep -v "^ *$" "$out/bench.log" | tail -n 30
cat "$out/summary.log"
