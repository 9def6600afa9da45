#!/usr/bin/env bash
# The one device script: from the repository root on the GPU machine (.whl carried), run the named stages in
# order, each under its own time limit, logging to $OUT/<stage>.log and one line per stage to $OUT/summary.log;
# at the end every file but summary.log is packed into $OUT/results.tar.gz.
#   bash csrc/cuda/tests/device_run.sh build check sanitize pytest bench
# Stages
#   build        the package (kernels for $JAX_FLASH_CUDA_ARCHS, default 90a) and build/standalone_check; skipped
#                when the sources and build switches are those of the last build on this (warm) machine; links a
#                carried prebuilt*/ kernel library of the same sources and switches instead of compiling the kernels
#   prebuild     (here, on the CPU machine) that library into ${PREBUILT_DIR:-prebuilt}/: see prebuild()
#   prebuilt_stamp  which prebuilt*/ library matches the sources and the exported switches
#   check        standalone float64 check of every kernel family        check_bwd90  the same for the sm90 backward
#   sanitize     memcheck, racecheck and synccheck on `--small` of both standalone grids
#   persistent   the sm90 forward's grid modes (the check stage runs the default, auto: persistent for every case
#                of its grid): the standalone grid with one CTA per tile (JAX_FLASH_SM90_PERSISTENT=0); forced
#                persistent (=1), both standalone grids with the grid capped at a few CTAs (each loops over many
#                tiles) and uncapped, the three sanitizers on
#                `--small` capped at 2 CTAs        persistent_bench  --bench-persistent (per-tile vs persistent timing,
#                bit-identical outputs)
#   dense90      the bias/mask forwards: the standalone grid with JAX_FLASH_SM90_DENSE=0 (sm80), then through the
#                sm90 dense form (the default) per-tile and persistent (3 CTAs), and the three sanitizers on `--small`
#                both ways (bench_cuda's padding-mask row times that forward both ways)
#   pytest*      tests/test_cuda.py -k "${NAME}_K" (default: all) with ${NAME}_WORKERS workers, plus $PYTEST_EXTRA
#                (pytest: $PYTEST_K and $PYTEST_WORKERS; pytest_forms: $PYTEST_FORMS_K ...: two selections may run at once)
#                (verbose: each result is listed as it happens, so a timed-out run still names its failures; their
#                tracebacks go to ${NAME}_failures.log as they happen, each test's duration to ${NAME}_durations.log,
#                tests/conftest.py)
#   sharding     the ring/sharding tests on every GPU of the machine
#   bench*       benchmarks/bench_attention.py ${NAME}_ARGS under environment ${NAME}_ENV (bench: $BENCH_ARGS,
#                bench_f32: $BENCH_F32_ARGS, ...; pass --tag to keep their result files apart)        bench_cuda   standalone --bench, sm80 and sm90 bwd
#   ncu_bwd      Nsight Compute sections of the Hopper backward's kernels (fused-dQ dK/dV, plain dK/dV, dQ);
#                NCU_BWD_FAMILY=sm80 profiles the sm80 backward's instead
#   kernel_times each kernel of one jitted backward and its duration (Nsight Compute), jax_flash and cuDNN, for the
#                cases $KERNEL_TIMES_CASES ("head_dim:seqlen[:causal] ...", default d=64 and d=128 causal 1k);
#                KERNEL_TIMES_FORWARD=1 times the forward instead; each timing process is cut after
#                $KERNEL_TIMES_PROCESS_LIMIT s (default 90) and fails its case only
#   ncu_vs_cudnn Nsight Compute sections of the main backward kernel, jax_flash's and cuDNN's, case $NCU_VS_CASE
#                (default 64:8192); NCU_VS_FORWARD=1 profiles the forward kernels instead
#   ncu_ops      executed instructions per SASS opcode of the main forward (NCU_VS_FORWARD=1) or backward kernel,
#                jax_flash's against cuDNN's, case $NCU_VS_CASE (ncu_opcode_mix.py)
#   ncu_src      per-instruction stall samples of one kernel launch (NCU_SRC_APP, NCU_SRC_KERNEL, NCU_SRC_SKIP,
#                NCU_BWD_FAMILY)
#   probe_features  feature_forward_probe.py: plain / padding-mask / softcap forwards through JAX, TFLOP/s
#   ncu_features the same under Nsight Compute: which kernel each call ran and its duration
#   ncu_forms    Nsight Compute detail (pipes, stalls, issue) of one launch of each Hopper forward form through JAX
#   ncu_decode   Nsight Compute detail (memory, pipes, stalls) of one decoding forward launch through JAX
#                (bench_decode.py, G = 32 / heads_kv $NCU_DECODE_HEADS_KV (default 1), seqlen_k $NCU_DECODE_SEQLEN
#                (default 65536), split-KV and packing as by default), after the warm-up launches
#   ncu_tf32_bwd Nsight Compute sections of the Hopper TF32 backward's dK/dV and dQ kernels (float32 d=128 4k through JAX)
#   pytest_files the test files $PYTEST_FILES through pytest, on the GPU (JAX_FLASH_TEST_PLATFORM=gpu)
#   decode*      benchmarks/bench_decode.py ${NAME}_ARGS under environment ${NAME}_ENV (as bench*)
#   cmd*         the shell command ${NAME}_CMD (e.g. CMD_KA_CMD='JAX_FLASH_SM90_K_AHEAD=1 $check --small')
#   train        benchmarks/bench_training_step.py $TRAIN_ARGS
#   f32_memcheck memcheck over csrc/cuda/tests/float32_memcheck.py (float32 kernels through JAX): its runs $F32_CASES
#                (default: all; an index may repeat; F32_MEMCHECK_CASES or F32_RACECHECK_CASES for one tool alone),
#                F32_EACH=1 one sanitizer process per run, F32_JOBS=N N such processes at a time, F32_SANITIZER_FLAGS
#                more compute-sanitizer options (e.g. --force-blocking-launches), F32_BACKTRACE=1 the sanitizer
#                under cuda-gdb, which prints its stack if it crashes (f32_sanitize)
#   f32_racecheck racecheck over the same
# Limits: $<STAGE>_LIMIT seconds (e.g. PYTEST_LIMIT=300). A timed-out stage costs its limit, not the call.
# TOTAL_LIMIT (seconds, optional) caps the whole script: later stages shrink or are skipped so that the results
# are still packed before the device call's own limit.
# A stage written with a trailing '+' (pytest+) runs in the background alongside the next ones; the script waits
# for it at the end.
set -uo pipefail
out=${OUT:-/tmp/device_run}
mkdir -p "$out"
repo=$(pwd)
self=$(readlink -f "$0")
t0=$SECONDS
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export JAX_FLASH_CUDA_ARCHS=${JAX_FLASH_CUDA_ARCHS:-90a}
check=$repo/build/standalone_check
# A build narrowed by the development switches (pyproject.toml) refuses the cases it has no kernel for: the
# standalone check then skips them and counts them apart (standalone_check.cu), instead of failing them, and so do
# the pytest stages (tests/build_refusal_skips.py: "unbuilt kernel: ..." skips).
if [ -n "${JAX_FLASH_CUDA_HEAD_DIMS:-}${JAX_FLASH_CUDA_SM90_HEAD_DIMS:-}" ] ||
  [ "${JAX_FLASH_CUDA_FP16:-ON}" = OFF ]; then
  export JAX_FLASH_CHECK_SKIP_UNBUILT=1
fi
pytest_args=(-v -p no:cacheprovider --rootdir "$repo" -rf)  # -v: a run cut off by its limit still names its failures

stage() {  # stage NAME DEFAULT_LIMIT COMMAND...
  local name=$1 limit_var=${1^^}_LIMIT
  local limit=${!limit_var:-$2}
  shift 2
  if [ -n "${TOTAL_LIMIT:-}" ]; then  # leave 15 s for packing the results inside the call's own limit
    local left=$((TOTAL_LIMIT - 15 - (SECONDS - t0)))
    [ $left -lt $limit ] && limit=$left
    if [ $limit -le 5 ]; then echo "$name: skipped (TOTAL_LIMIT reached)" | tee -a "$out/summary.log"; return 1; fi
  fi
  local start=$SECONDS
  if [ "$(type -t "$1")" = function ]; then  # timeout runs programs: re-enter this script for a function
    timeout "$limit" bash "$self" __function "$@" >"$out/$name.log" 2>&1
  else
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
  fi
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s (at $((SECONDS - t0)) s)" | tee -a "$out/summary.log"
  tail -n ${TAIL:-8} "$out/$name.log"
  return $rc
}

# The CUTLASS/CuTe headers the kernels compile against: $CUTLASS_INCLUDE_DIR, else the installed nvidia-cutlass
# wheel's (as cmake/cuda_switch.cmake finds them).
cutlass_include() {
  if [ -n "${CUTLASS_INCLUDE_DIR:-}" ]; then echo "$CUTLASS_INCLUDE_DIR"; return; fi
  python3 -c "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
}

# The kernel library's inputs: its sources (the headers and units of csrc/common and csrc/cuda but its tests: not
# its README or the generator of the committed units), the CMake files and pyproject.toml (the switches' defaults),
# the switches that choose its units, nvcc's release and the CUTLASS version. The same on every machine for the same
# tree: relative paths, C collation.
kernel_stamp() {
  local switch
  (find csrc/common csrc/cuda -path csrc/cuda/tests -prune -o -type f \( -name '*.h' -o -name '*.cu' -o \
     -name '*.cuh' -o -name '*.hpp' -o -name CMakeLists.txt \) -print0 | LC_ALL=C sort -z | xargs -0 md5sum
   md5sum CMakeLists.txt cmake/* pyproject.toml
   for switch in JAX_FLASH_CUDA_ARCHS JAX_FLASH_CUDA_HEAD_DIMS JAX_FLASH_CUDA_SM90_HEAD_DIMS JAX_FLASH_CUDA_FP16; do
     echo "$switch=${!switch:-}"
   done
   nvcc --version | grep -o "release [0-9.]*"
   md5sum < "$(cutlass_include)/cutlass/version.h") | md5sum
}

# prebuild (on any machine with nvcc, no GPU needed): the kernel library for the exported switches, gzipped into
# $PREBUILT_DIR (default prebuilt/; the objects with line info take ~80 MiB, over what a device call carries) with its
# kernel_stamp. Carried to a GPU machine (`carry: [".whl", "prebuilt"]`), `build` links it instead of compiling the
# kernels where the stamps match. Incremental: build/prebuild is kept between runs. The stamp is written only if the
# sources did not change while the library compiled.
# For an A/B of a kernel patch, prebuild the base and the patched sources into two folders of their own and carry both:
# each half of device_ab.sh then links its library (~30 s) instead of compiling (~430 s for d=64/128 on a fresh
# machine). Two full libraries (~35 MiB each) exceed the 64 MiB a call carries, so restrict both to the head dims
# under test (~19 MiB for d=64/128), with the same switches exported on the device (benchmarks/ab/README.md):
#   PREBUILT_DIR=prebuilt_base <switches> bash csrc/cuda/tests/device_run.sh prebuild
#   git apply P && PREBUILT_DIR=prebuilt_ab <switches> bash csrc/cuda/tests/device_run.sh prebuild; git apply -R P
prebuild() {
  local dir=build/prebuild switch defines=() before target=${PREBUILT_DIR:-prebuilt}
  for switch in JAX_FLASH_CUDA_ARCHS JAX_FLASH_CUDA_HEAD_DIMS JAX_FLASH_CUDA_SM90_HEAD_DIMS JAX_FLASH_CUDA_FP16; do
    [ -n "${!switch:-}" ] && defines+=("-D$switch=${!switch}")
  done
  case $target in prebuilt|prebuilt_*) ;; *) echo "PREBUILT_DIR must be prebuilt or prebuilt_<name>"; return 1 ;; esac
  before=$(kernel_stamp)
  rm -f "$target/stamp"
  # -U first: a switch unset now takes CMakeLists' default, not the value an earlier run left in the cache.
  cmake -S . -B "$dir" -G Ninja -U 'JAX_FLASH_CUDA*' -DJAX_FLASH_CUDA=ON -DJAX_FLASH_CUDA_PREBUILT_LIB= \
    -DPython_EXECUTABLE="$(command -v python3)" "${defines[@]}" || return 1
  cmake --build "$dir" --target jax_flash_cuda_kernels -j "${PREBUILD_JOBS:-$(nproc)}" || return 1
  mkdir -p "$target" && gzip -c "$dir/csrc/cuda/libjax_flash_cuda_kernels.a" > "$target/libjax_flash_cuda_kernels.a.gz" ||
    return 1
  if [ "$(kernel_stamp)" != "$before" ]; then
    echo "the sources or switches changed during the build: no stamp written, run prebuild again"; return 1
  fi
  echo "$before" > "$target/stamp"
  du -h "$target/libjax_flash_cuda_kernels.a.gz"
}

# The carried prebuilt*/ folder whose stamp is kernel_stamp's now (printed; status 1 where none is).
matching_prebuilt() {
  local stamp folder
  stamp=$(kernel_stamp)
  for folder in prebuilt prebuilt_*; do
    if [ -f "$folder/stamp" ] && [ "$(cat "$folder/stamp")" = "$stamp" ]; then echo "$folder"; return 0; fi
  done
  return 1
}

# The kernels: "prebuilt" (linked from the carried prebuilt*/ folder whose stamp matches), "compiled", or "" on
# failure; one line on how to summary.log.
install_package() {
  local folder why="no prebuilt*/ folder"
  if folder=$(matching_prebuilt); then
    mkdir -p build && gzip -dc "$folder/libjax_flash_cuda_kernels.a.gz" > build/libjax_flash_cuda_kernels.a &&
      JAX_FLASH_CUDA=ON JAX_FLASH_CUDA_PREBUILT_LIB=$repo/build/libjax_flash_cuda_kernels.a \
        python3 -m pip install --no-deps --no-build-isolation -v . >&2 &&
      # Another toolchain's objects might still fail to load (libstdc++ versions): then compile them.
      (cd /tmp && python3 -c "import jax_flash, sys; sys.exit(not jax_flash.BUILT_WITH_CUDA)") >&2 &&
      { echo "build: kernels prebuilt ($folder/ linked)" >> "$out/summary.log"; echo prebuilt; return; }
    why="$folder/ did not link or load"
  elif compgen -G "prebuilt*/stamp" > /dev/null; then
    why="prebuilt*/ are of other sources or switches"
  fi
  echo "build: kernels compiled ($why)" >> "$out/summary.log"
  JAX_FLASH_CUDA=ON JAX_FLASH_CUDA_PREBUILT_LIB="" python3 -m pip install --no-deps --no-build-isolation -v . >&2 &&
    echo compiled
}

# The device tool sends the tree with fresh file times; left so, ninja rebuilds every object of a source build in each
# call, and a build cut by its limit restarts from nothing (fiftieth session). Each file whose content is unchanged
# since the last build here gets back the time it had then (build/.source_times: path -> [md5, time in ns]); a changed
# file keeps its fresh time, so ninja rebuilds exactly what depends on it. Written before the build, so that a cut
# build resumes. Sound only while every build of this build folder goes through build() (the manifest must name the
# content the objects were compiled from). Arguments: the build's inputs, files or folders.
restore_source_times() {
  python3 - "$@" <<'PY'
import hashlib, json, os, pathlib, sys
manifest = pathlib.Path("build/.source_times")
old = json.loads(manifest.read_text()) if manifest.exists() else {}
new = {}
for root in sys.argv[1:]:
    top = pathlib.Path(root)
    for path in [top] if top.is_file() else sorted(top.rglob("*")):
        if not path.is_file():
            continue
        digest, key = hashlib.md5(path.read_bytes()).hexdigest(), str(path)
        if key in old and old[key][0] == digest:
            os.utime(path, ns=(old[key][1], old[key][1]))
        new[key] = [digest, path.stat().st_mtime_ns]
manifest.parent.mkdir(exist_ok=True)
manifest.write_text(json.dumps(new))
PY
}

build() {
  local stamp inputs=(csrc CMakeLists.txt cmake pyproject.toml)
  stamp=$( (find "${inputs[@]}" -type f -print0 | sort -z | xargs -0 md5sum;
            env | grep '^JAX_FLASH_CUDA' | sort) | md5sum)
  if [ -x "$check" ] && [ "$(cat build/.stamp 2>/dev/null)" = "$stamp" ]; then
    echo "unchanged since the last build here"; return 0
  fi
  python3 -m pip install -q --no-deps --no-index .whl/*.whl || return 1
  restore_source_times "${inputs[@]}" || return 1
  local kernels library
  kernels=$(install_package) || return 1
  [ -n "$kernels" ] || return 1
  library=build/libjax_flash_cuda_kernels.a
  [ "$kernels" = prebuilt ] || library=$(find build -path build/libjax_flash_cuda_kernels.a -prune -o \
                                         -name libjax_flash_cuda_kernels.a -print | head -1)
  nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -Icsrc -I"$(cutlass_include)" \
    csrc/cuda/tests/standalone_check.cu "$library" -o "$check" || return 1
  echo "$stamp" > build/.stamp
}

# sanitized NAME TOOL ARGS...: compute-sanitizer --tool TOOL over the standalone check with ARGS, its whole report in
# $out/NAME.log; printed here: any failing case (with the lines before it) and the report's end.
sanitized() {
  local log="$out/$1.log" tool=$2 rc=0
  shift 2
  compute-sanitizer --tool "$tool" --error-exitcode 3 "$check" "$@" > "$log" 2>&1 || rc=1
  grep -B8 "FAIL" "$log" | head -n 40
  tail -n 4 "$log"
  return $rc
}

sanitize() {
  local tool grid rc=0
  for tool in memcheck racecheck synccheck; do
    for grid in "--small" "--sm90-backward --small"; do
      echo "== $tool $grid"
      sanitized "sanitize_${tool}${grid// /_}" "$tool" $grid || rc=1
    done
  done
  return $rc
}

# f32_sanitize TOOL: compute-sanitizer --tool TOOL over float32_memcheck.py's runs $F32_CASES (default: all), in one
# process, or with F32_EACH=1 one sanitizer process per run (a crash then names its run and the others still go). The
# target runs with Python's faulthandler: a SIGSEGV in it prints where the Python side was. XLA allocates each buffer
# on its own (the platform allocator, unless XLA_PYTHON_CLIENT_ALLOCATOR says otherwise), so that memcheck bounds every
# buffer: inside XLA's default pool a store past one buffer lands in another unreported.
# F32_BACKTRACE=1: s41's crashes were of the process bash started (its "Segmentation fault" line names the
# compute-sanitizer command), with no summary printed; under cuda-gdb (the image has no gdb) a crash of the sanitizer
# itself prints its native stack, while one of the target still shows as the sanitizer's report and faulthandler's.
# The exit status printed is then cuda-gdb's: read the log.
# --target-processes application-only (always passed): the sanitizer attaches to the Python process alone, not to the
# processes it starts (XLA's compiler tools). With the default (all), the sanitizer's own process ended on SIGSEGV in
# 5 of 10 runs of the forty-fifth session, each during the backward's first call, while the target went on (XLA's
# compile warnings came after the crash in the same log): s41's single-process crash, and likely s42/s44's runs that
# never ended (the orphaned target held the old log pipe open). With it, none of 8 processes crashed: those five runs
# alone, memcheck of the whole grid in one process and racecheck of 13 runs in two were clean.
f32_sanitize() {
  local tool=$1 script="$repo/csrc/cuda/tests/float32_memcheck.py" index rc=0 launcher=()
  export XLA_FLAGS=--xla_gpu_enable_command_buffer= XLA_PYTHON_CLIENT_ALLOCATOR=${XLA_PYTHON_CLIENT_ALLOCATOR:-platform}
  cd /tmp || return 1  # not the repository: its jax_flash/ would shadow the installed package
  if [ "${F32_BACKTRACE:-0}" = 1 ]; then
    launcher=(cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt -ex "info threads" --args)
  fi
  # shellcheck disable=SC2206  # F32_SANITIZER_FLAGS: options split on spaces
  local sanitizer=("${launcher[@]}" compute-sanitizer --tool "$tool" --target-processes application-only
                   ${F32_SANITIZER_FLAGS:-} --error-exitcode 3 python3 -X faulthandler "$script")
  local cases_var=F32_${tool^^}_CASES  # F32_MEMCHECK_CASES, F32_RACECHECK_CASES: this tool's runs, over F32_CASES
  local cases=${!cases_var:-${F32_CASES:-}}  # empty: every run
  if [ "${F32_EACH:-0}" != 1 ]; then
    "${sanitizer[@]}" $cases; return
  fi
  # F32_JOBS=N: N sanitizer processes at a time (each run is mostly JAX start-up and compilation on the CPU, and the
  # machine has 16 cores). Each run logs to its own file under $out, which survives a timeout; they are printed in
  # order once all have ended.
  local jobs=${F32_JOBS:-1} runs="$out/f32_${tool}_runs" n=0 log
  mkdir -p "$runs"
  for index in ${cases:-$(seq 0 $(($(python3 "$script" --count) - 1)))}; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    n=$((n + 1))
    # Straight into the file, not through a filter (a pipe into grep holds its output in a block buffer until the
    # end, so a run cut off by the limit left an empty log): a timed-out run still shows how far it got.
    log="$runs/$(printf %03d $n)_run$index.log"
    { "${sanitizer[@]}" "$index"; echo "run $index: sanitizer exit $?"; } > "$log" 2>&1 &
  done
  wait
  for log in "$runs"/*.log; do
    grep -v "^========= COMPUTE-SANITIZER" "$log"
    grep -q "sanitizer exit 0$" "$log" || rc=1
  done
  return $rc
}

persistent() {
  local ctas tool grid rc=0
  echo "== check JAX_FLASH_SM90_PERSISTENT=0"
  JAX_FLASH_SM90_PERSISTENT=0 "$check" || rc=1
  export JAX_FLASH_SM90_PERSISTENT=1
  for ctas in 1 3 ""; do
    for grid in "" "--sm90-backward"; do
      echo "== check $grid JAX_FLASH_SM90_PERSISTENT_CTAS=${ctas:-(uncapped)}"
      JAX_FLASH_SM90_PERSISTENT_CTAS=$ctas "$check" $grid || rc=1
    done
  done
  for tool in memcheck racecheck synccheck; do
    for grid in "--small" "--sm90-backward --small"; do
      echo "== $tool $grid JAX_FLASH_SM90_PERSISTENT_CTAS=2"
      JAX_FLASH_SM90_PERSISTENT_CTAS=2 sanitized "persistent_${tool}${grid// /_}" "$tool" $grid || rc=1
    done
  done
  return $rc
}

dense90() {
  local tool persistent rc=0
  echo "== check JAX_FLASH_SM90_DENSE=0 (bias/mask forwards on sm80)"
  JAX_FLASH_SM90_DENSE=0 "$check" || rc=1
  echo "== check JAX_FLASH_SM90_PERSISTENT=0"
  JAX_FLASH_SM90_PERSISTENT=0 "$check" || rc=1
  echo "== check JAX_FLASH_SM90_PERSISTENT=1 JAX_FLASH_SM90_PERSISTENT_CTAS=3"
  JAX_FLASH_SM90_PERSISTENT=1 JAX_FLASH_SM90_PERSISTENT_CTAS=3 "$check" || rc=1
  for tool in memcheck racecheck synccheck; do
    for persistent in 0 1; do
      echo "== $tool --small JAX_FLASH_SM90_PERSISTENT=$persistent (CTAS=2)"
      JAX_FLASH_SM90_PERSISTENT=$persistent JAX_FLASH_SM90_PERSISTENT_CTAS=2 \
        sanitized "dense90_${tool}_persistent$persistent" "$tool" --small || rc=1
    done
  done
  return $rc
}

bench_cuda() {
  local family
  for family in sm80 sm90; do
    JAX_FLASH_CUDA_KERNEL_BACKWARD=$family "$check" --bench || return 1
  done
}

# Where the Hopper backward's time goes: Nsight Compute on one launch each of the fused-dQ dK/dV kernel, the plain
# dK/dV kernel and the dQ kernel of the standalone --bench (d=128 4k non-causal, its first case). In --bench each
# backward mode runs 23 times (3 warm-up + 20 timed), fused first: dK/dV launch 0 is fused, launch 23 plain.
# The Nsight Compute sections of ncu_bwd and ncu_vs_cudnn (pipes, issue, stalls, memory, launch).
kernel_sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
                 --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats)
ncu_bwd() {
  local sections=("${kernel_sections[@]}")
  export JAX_FLASH_CUDA_KERNEL_BACKWARD=${NCU_BWD_FAMILY:-sm90}
  echo "== fused-dQ dK/dV kernel"
  ncu --kernel-name regex:dkdv_kernel --launch-skip 0 --launch-count 1 "${sections[@]}" "$check" --bench || return 1
  echo "== dK/dV kernel (separate dQ pass)"
  ncu --kernel-name regex:dkdv_kernel --launch-skip 23 --launch-count 1 "${sections[@]}" "$check" --bench || return 1
  echo "== dQ kernel"
  ncu --kernel-name regex:dq_kernel --launch-skip 0 --launch-count 1 "${sections[@]}" "$check" --bench
}

# Where inside one kernel the warps stall: Nsight Compute's per-instruction source counters (sampled stall reasons)
# of launch $NCU_SRC_SKIP (default 0) of kernels matching $NCU_SRC_KERNEL (default dkdv_kernel) in $NCU_SRC_APP
# (default: the standalone --bench, backward family $NCU_BWD_FAMILY, default sm90; e.g. NCU_SRC_APP="python3
# benchmarks/bench_attention.py --head-dims 64 --seqlens 1024 --impls jax_flash_sm90 --forward-only --reps 2
# --out-dir /tmp" with NCU_SRC_KERNEL=forward_kernel, NCU_SRC_SKIP=3); the report's SASS page as CSV, then the 40
# instructions with the most stall samples (ncu_src_top.txt, ncu_src_summary.py).
# Per source line: ncu_src_lines.py with an nvdisasm -gi listing of the same unit compiled locally (its docstring).
ncu_src() {
  export JAX_FLASH_CUDA_KERNEL_BACKWARD=${NCU_BWD_FAMILY:-sm90}
  # shellcheck disable=SC2086  # NCU_SRC_APP is a command line
  ncu --kernel-name "regex:${NCU_SRC_KERNEL:-dkdv_kernel}" --launch-skip "${NCU_SRC_SKIP:-0}" --launch-count 1 \
    --section SourceCounters --section WarpStateStats -f -o "$out/ncu_src" ${NCU_SRC_APP:-$check --bench} \
    > "$out/ncu_src_app.log" 2>&1 || return 1
  ncu --import "$out/ncu_src.ncu-rep" --page source --csv --print-source sass > "$out/ncu_src_sass.csv" || return 1
  python3 "$repo/csrc/cuda/tests/ncu_src_summary.py" "$out/ncu_src_sass.csv" 40 | tee "$out/ncu_src_top.txt"
}

# Nsight Compute sections (pipes, issue, stalls, memory) of the main backward kernel of one jitted backward, jax_flash's
# dK/dV kernel and cuDNN's flash_bprop kernel, the fourth call's launch, for the case $NCU_VS_CASE
# ("head_dim:seqlen[:causal]", default 64:8192; attention_kernel_times.py's shapes). NCU_VS_FORWARD=1: the forward
# kernels of one jitted forward instead (jax_flash's forward_kernel, cuDNN's flash_fprop).
# ncu_vs_cudnn's and ncu_ops' case, into the caller's locals d, s, c (head dim, seqlen, "causal" or empty), kernels
# (the kernel-name regex: backward, or forward with NCU_VS_FORWARD=1) and pass (the tool's --forward, or nothing).
read_ncu_vs_case() {
  kernels="dkdv_kernel|flash_bprop" pass=()
  IFS=: read -r d s c <<<"${NCU_VS_CASE:-64:8192}"
  [ "${NCU_VS_FORWARD:-0}" = 1 ] && kernels="forward_kernel|flash_fprop" pass=(--forward)
  return 0
}

ncu_vs_cudnn() {
  local impl d s c kernels pass
  read_ncu_vs_case
  for impl in jax_flash_sm90 cudnn; do
    echo "== $impl d=$d seqlen=$s ${c:-non-causal} ${pass[*]}"
    (cd /tmp && ncu --kernel-name "regex:$kernels" --launch-skip 3 --launch-count 1 \
      "${kernel_sections[@]}" --section Occupancy python3 "$repo/csrc/cuda/tests/attention_kernel_times.py" \
      --impl $impl --head-dim "$d" --seqlen "$s" ${c:+--causal} "${pass[@]}") > "$out/ncu_vs_cudnn_${impl}.txt" 2>&1 \
      || return 1
    grep -E "Duration|Registers Per|Issue Slots Busy|Executed Instructions  " "$out/ncu_vs_cudnn_${impl}.txt"
  done
}

# Executed instructions per SASS opcode of the same kernels as ncu_vs_cudnn (one launch each, SourceCounters): which
# kinds of instruction make one kernel longer than the other.
ncu_ops() {
  local impl d s c kernels pass mix=()
  read_ncu_vs_case
  for impl in jax_flash_sm90 cudnn; do
    (cd /tmp && ncu --kernel-name "regex:$kernels" --launch-skip 3 --launch-count 1 --section SourceCounters \
      -f -o "$out/ncu_ops_$impl" python3 "$repo/csrc/cuda/tests/attention_kernel_times.py" --impl $impl \
      --head-dim "$d" --seqlen "$s" ${c:+--causal} "${pass[@]}") > "$out/ncu_ops_${impl}.log" 2>&1 || return 1
    ncu --import "$out/ncu_ops_$impl.ncu-rep" --page source --csv --print-source sass > "$out/ncu_ops_$impl.csv" \
      || return 1
    rm -f "$out/ncu_ops_$impl.ncu-rep"  # the CSV keeps what is needed; a report is megabytes
    mix+=("$impl=$out/ncu_ops_$impl.csv")
  done
  python3 "$repo/csrc/cuda/tests/ncu_opcode_mix.py" "${mix[@]}" | tee "$out/ncu_ops.txt"
}

# Which kernels one jitted backward (KERNEL_TIMES_FORWARD=1: forward) runs and how long each takes, jax_flash against
# cuDNN (attention_kernel_times.py), for each case "head_dim:seqlen[:causal]" of $KERNEL_TIMES_CASES.
# Each timing process has a limit of its own ($KERNEL_TIMES_PROCESS_LIMIT seconds, default 90), and a failed one does
# not stop the others (the stage then exits 1): Nsight Compute has crashed a process (SIGSEGV) and hung at attach
# before any kernel ran (fifty-fifth and fifty-sixth sessions), and in the fifty-sixth every later process of that
# call hung too, so one failure cost the rest of the stage's cases. After a failure, what still runs on the GPU is
# listed, for the log, and the timing processes left behind are killed before the next case starts.
kernel_times() {
  local case impl d s c csv tool="$repo/csrc/cuda/tests/attention_kernel_times.py" pass=() rc=0 status
  [ "${KERNEL_TIMES_FORWARD:-0}" = 1 ] && pass=(--forward)
  for case in ${KERNEL_TIMES_CASES:-64:1024:causal 128:1024:causal}; do
    IFS=: read -r d s c <<<"$case"
    for impl in jax_flash_sm90 cudnn; do
      echo "== $impl d=$d seqlen=$s ${c:-non-causal}"
      csv="$out/kernel_times_${impl}_${d}_${s}${c:+_causal}${pass:+_forward}.csv"
      (cd /tmp && timeout --kill-after=10 "${KERNEL_TIMES_PROCESS_LIMIT:-90}" \
        ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none \
        python3 "$tool" --impl $impl --head-dim "$d" --seqlen "$s" ${c:+--causal} "${pass[@]}" > "$csv")
      status=$?
      if [ $status -eq 0 ]; then
        python3 "$tool" --summarize "$csv" || rc=1
        continue
      fi
      echo "failed (exit $status); Nsight Compute's last line: $(tail -n 1 "$csv")"
      nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1 |
        sed 's/^/  on the GPU: /'
      pkill -9 -f "$tool"
      rc=1
    done
  done
  return $rc
}

# Which kernels a feature forward through JAX runs and how long each takes (feature_forward_probe.py: plain,
# padding mask as a closure constant and as an argument, softcap): the first 40 forward-kernel launches, warm-up
# calls included (the kernel's template arguments name its form).
ncu_features() {
  (cd /tmp && ncu --kernel-name regex:forward --launch-skip 0 --launch-count 40 --section SpeedOfLight \
     python3 "$repo/csrc/cuda/tests/feature_forward_probe.py" --reps 2) > "$out/ncu_features_full.log" 2>&1 || return 1
  grep -E "TFLOP/s|forward_kernel|Duration" "$out/ncu_features_full.log"
}

# Why the Hopper forward's feature forms run slower than its common form: Nsight Compute's pipe use, warp stall
# reasons and issue statistics of one launch (after a warm-up) of each form through JAX (feature_forward_probe.py
# --only: plain = common form, padding_mask = dense form, softcap and alibi = transforms form).
ncu_forms() {
  local name
  for name in plain padding_mask softcap alibi; do
    echo "== $name"
    (cd /tmp && ncu --kernel-name regex:forward_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
       --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section LaunchStats \
       --section InstructionStats python3 "$repo/csrc/cuda/tests/feature_forward_probe.py" --reps 2 --only $name) \
       > "$out/ncu_forms_$name.log" 2>&1 || return 1
    grep -iE "forward_kernel<|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc A|stall|spends|pipe|Registers Per|Local" \
      "$out/ncu_forms_$name.log" | head -n 30
  done
}

ncu_decode() {
  (cd /tmp && ncu --kernel-name regex:forward_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \
     --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
     --section SchedulerStats --section LaunchStats --section Occupancy python3 "$repo/benchmarks/bench_decode.py" \
     --impls jax_flash --heads-kv "${NCU_DECODE_HEADS_KV:-1}" --seqlens "${NCU_DECODE_SEQLEN:-65536}" --reps 1 \
     --out-dir /tmp) > "$out/ncu_decode_full.log" 2>&1 || return 1
  grep -iE "forward_kernel<|Duration|Throughput|Hit Rate|Busy|Executed Ipc|stall|Registers Per|Grid Size|Waves" \
    "$out/ncu_decode_full.log" | head -n 60
}

# Where the Hopper TF32 backward's time goes (#10): Nsight Compute sections of its dK/dV and dQ kernels, one launch
# each after a warm-up, in a float32 d=128 4k backward through JAX (bench_attention.py's shape: 16k tokens, 16 heads).
ncu_tf32_bwd() {
  local probe=/tmp/tf32_backward_probe.py name
  cat > "$probe" <<'PY'
import jax
import jax.numpy as jnp
import jax_flash
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, d_o = (jax.random.normal(key, (4, 4096, 16, 128), jnp.float32) for key in keys)
step = jax.jit(lambda q, k, v, d_o: jax.vjp(jax_flash.attention, q, k, v)[1](d_o))
for _ in range(3):
    jax.block_until_ready(step(q, k, v, d_o))
PY
  for name in dkdv_kernel dq_kernel; do
    (cd /tmp && ncu --kernel-name regex:$name --launch-skip 1 --launch-count 1 --section SpeedOfLight \
       --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
       --section SchedulerStats --section LaunchStats --section Occupancy python3 "$probe") \
      > "$out/ncu_tf32_bwd_$name.log" 2>&1 || return 1
    grep -iE "_kernel<|Duration|Throughput|Busy|Executed Ipc|stall|Registers Per|Grid Size|Waves" \
      "$out/ncu_tf32_bwd_$name.log" | head -n 40
  done
}

if [ "${1:-}" = __function ]; then
  shift
  "$@"
  exit
fi

run_stage() {
  case $1 in
    build) stage build 500 build || { tail -n 60 "$out/build.log"; exit 1; } ;;
    prebuild) stage prebuild 7200 prebuild || { tail -n 30 "$out/prebuild.log"; exit 1; } ;;
    prebuilt_stamp) if folder=$(matching_prebuilt); then
                      echo "$folder/ is current" | tee -a "$out/summary.log"
                    else
                      echo "no prebuilt*/ matches these sources and switches: run prebuild" | tee -a "$out/summary.log"
                    fi ;;
    check) stage check 120 "$check" ;;
    check_bwd90) stage check_bwd90 90 "$check" --sm90-backward ;;
    sanitize) stage sanitize 240 sanitize ;;
    persistent) stage persistent 300 persistent ;;
    persistent_bench) stage persistent_bench 120 "$check" --bench-persistent ;;
    dense90) stage dense90 360 dense90 ;;
    # pytest runs from outside the checkout, so that `import jax_flash` finds the installed package.
    # pytest_files: the test files $PYTEST_FILES (paths from the repository root), e.g. the platform-neutral suites,
    # on the GPU (JAX_FLASH_TEST_PLATFORM=gpu: without it tests/conftest.py places their arrays on the CPU).
    pytest_files) (cd /tmp && JAX_FLASH_TEST_PLATFORM=gpu JAX_FLASH_FAILURE_LOG="$out/pytest_files_failures.log" \
                   stage pytest_files 300 python3 -m pytest "${pytest_args[@]}" -n ${PYTEST_WORKERS:-16} \
                    $(for f in $PYTEST_FILES; do echo "$repo/$f"; done) ${PYTEST_EXTRA:-}) ;;
    pytest*) local k_var=${1^^}_K workers_var=${1^^}_WORKERS  # pytest, pytest_forms, ...: own ${NAME}_K, ${NAME}_WORKERS
      (cd /tmp && JAX_FLASH_FAILURE_LOG="$out/${1}_failures.log" JAX_FLASH_DURATION_LOG="$out/${1}_durations.log" \
         stage "$1" 300 python3 -m pytest "${pytest_args[@]}" -n ${!workers_var:-16} \
         "$repo/tests/test_cuda.py" -k "${!k_var:-}" ${PYTEST_EXTRA:-}) ;;
    sharding) (cd /tmp && JAX_FLASH_TEST_PLATFORM=gpu stage sharding 120 python3 -m pytest "${pytest_args[@]}" -n 4 \
                "$repo/tests/test_ring_attention.py" "$repo/tests/test_sharding.py" "$repo/tests/test_sharding_dense.py") ;;
    bench_cuda) stage bench_cuda 90 bench_cuda ;;
    ncu_bwd) stage ncu_bwd 240 ncu_bwd ;;
    ncu_src) stage ncu_src 240 ncu_src ;;
    kernel_times) stage kernel_times 180 kernel_times ;;
    ncu_vs_cudnn) stage ncu_vs_cudnn 150 ncu_vs_cudnn ;;
    ncu_ops) stage ncu_ops 180 ncu_ops ;;
    ncu_features) stage ncu_features 180 ncu_features ;;
    ncu_forms) stage ncu_forms 150 ncu_forms ;;
    ncu_decode) stage ncu_decode 150 ncu_decode ;;
    ncu_tf32_bwd) stage ncu_tf32_bwd 200 ncu_tf32_bwd ;;
    probe_features) (cd /tmp && stage probe_features 120 python3 "$repo/csrc/cuda/tests/feature_forward_probe.py") ;;
    bench*) local args_var=${1^^}_ARGS env_var=${1^^}_ENV  # bench, bench_f32, ...: own ${NAME}_ARGS, ${NAME}_ENV
      stage "$1" 300 env ${!env_var:-} python3 benchmarks/bench_attention.py --out-dir "$out" ${!args_var:-} ;;
    decode*) local args_var=${1^^}_ARGS env_var=${1^^}_ENV  # decode, decode_b, ...: benchmarks/bench_decode.py
      stage "$1" 300 env ${!env_var:-} python3 benchmarks/bench_decode.py --out-dir "$out" ${!args_var:-} ;;
    cmd*) local cmd_var=${1^^}_CMD  # cmd, cmd_ka, ...: the shell command ${NAME}_CMD ($check names the standalone check)
      stage "$1" 300 env check="$check" bash -c "${!cmd_var}" ;;
    train) stage train 120 python3 benchmarks/bench_training_step.py --out-dir "$out" ${TRAIN_ARGS:-} ;;
    f32_memcheck|f32_racecheck) stage $1 200 f32_sanitize ${1#f32_} ;;
    *) echo "unknown stage $1" | tee -a "$out/summary.log" ;;
  esac
}

background=()
for name in "$@"; do
  if [ "${name%+}" != "$name" ]; then
    run_stage "${name%+}" &
    background+=($!)
  else
    run_stage "$name"
  fi
done
[ ${#background[@]} -eq 0 ] || wait "${background[@]}"
cat "$out/summary.log"
# The device tool brings back at most 8 files: everything else travels in one archive.
archive=$(mktemp --suffix=.tar.gz)
(cd "$out" && tar czf "$archive" --exclude=summary.log . && find . -type f ! -name summary.log -delete &&
  mv "$archive" results.tar.gz)
