#!/usr/bin/env bash
# One device call for issue #10, from the repository root: float32 tests, memcheck on a small float32 grid,
# float32 benchmark rows. Uses a jax_flash/_C*.so carried in the tree if it loads, else builds (head dims 64, 128).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"; repo=$(pwd); t0=$SECONDS
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L > "$out/env.log" 2>&1
if PYTHONPATH=$repo python3 -c "import jax, jax_flash; assert jax_flash.BUILT_WITH_CUDA; print(jax_flash.__file__, jax.__version__, jax.devices())" >> "$out/env.log" 2>&1; then
  export PYTHONPATH=$repo
else
  echo "prebuilt extension did not load; building on the device" | tee -a "$out/env.log"
  rm -f jax_flash/_C*.so
  JAX_FLASH_CUDA_HEAD_DIMS="64;128" bash csrc/cuda/tests/device_check.sh build > "$out/build.log" 2>&1
  python3 -c "import jax_flash; print(jax_flash.__file__)" >> "$out/env.log" 2>&1
fi
echo "setup done at $((SECONDS - t0)) s" | tee -a "$out/env.log"
(cd /tmp && timeout 170 python3 -m pytest -q -p no:cacheprovider -n 12 --rootdir "$repo" "$repo/tests/test_cuda.py" \
   -k "float32 or test_built_with_cuda or (test_backward_features and everything)" -rf > "$out/pytest.log" 2>&1; echo "pytest exit $? at $((SECONDS - t0)) s" >> "$out/pytest.log") &
pytest_pid=$!
(cd /tmp && XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 \
   python3 "$repo/csrc/cuda/tests/float32_memcheck.py" > "$out/memcheck.log" 2>&1; echo "memcheck exit $? at $((SECONDS - t0)) s" >> "$out/memcheck.log") &
memcheck_pid=$!
wait $pytest_pid $memcheck_pid
tail -n 25 "$out/pytest.log"; tail -n 6 "$out/memcheck.log"
timeout ${BENCH_TIMEOUT:-110} python3 benchmarks/bench_attention.py --float32 --head-dims 64 128 --seqlens 1024 4096 16384 \
   --reps 2 --out-dir "$out" > "$out/bench.log" 2>&1
echo "bench exit $? at $((SECONDS - t0)) s" >> "$out/bench.log"
cat "$out/bench.log" | grep -v "^ *$" | tail -n 80
