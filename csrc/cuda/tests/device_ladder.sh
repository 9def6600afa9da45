#!/usr/bin/env bash
# A ladder of source changes in one device call: device_run.sh's stages $LADDER_STAGES on the tree as sent (step 0,
# "base"), then again after each patch of $LADDER_PATCHES is applied on top of the ones before it (step 1, 2, ...),
# each step into its own folder. The build stage recompiles only the units a patch touches, so after the first
# build a step costs a partial build and the benchmark: several compile-time changes get timed against each other in
# one call, on one machine. (device_ab.sh times one change against its base.)
#   LADDER_PATCHES="benchmarks/ab/a.patch benchmarks/ab/b.patch" LADDER_STAGES="build bench" \
#   BENCH_ARGS="--head-dims 64 --impls jax_flash_sm90 cudnn --forward-only" TOTAL_LIMIT=580 \
#   bash csrc/cuda/tests/device_ladder.sh
# Send the tree without the patches applied. BENCH_ARGS gets --tag <step>, so the result files stay apart.
# TOTAL_LIMIT (seconds, optional) caps the whole ladder: each step runs under what is left of it (device_run.sh's
# TOTAL_LIMIT), and a step that would start with less than LADDER_MIN_STEP (default 60) seconds left is skipped, as
# are the steps after a patch that does not apply. The patches are reverted at the end. Everything comes back as
# $OUT/summary.log (one line per stage, prefixed by its step) and one $OUT/results.tar.gz (the device tool brings
# back only a few files).
set -uo pipefail
out=${OUT:-/tmp/device_ladder}
here=$(dirname "$(readlink -f "$0")")
stages=${LADDER_STAGES:-build bench}
bench_args=${BENCH_ARGS:-}
min_step=${LADDER_MIN_STEP:-60}
read -ra patches <<< "${LADDER_PATCHES:?LADDER_PATCHES lists the patches, applied in order on top of each other}"
mkdir -p "$out"
: > "$out/summary.log"

run_step() {  # run_step NAME
  local left=""
  if [ -n "${TOTAL_LIMIT:-}" ]; then
    left=$((TOTAL_LIMIT - SECONDS))
    if [ "$left" -lt "$min_step" ]; then
      echo "$1: skipped (${left} s left of TOTAL_LIMIT)" | tee -a "$out/summary.log"
      return 1
    fi
  fi
  mkdir -p "$out/$1"
  # shellcheck disable=SC2086  # the stage list is a word list
  OUT="$out/$1" TOTAL_LIMIT=$left BENCH_ARGS="$bench_args --tag $1" bash "$here/device_run.sh" $stages
  sed "s/^/$1: /" "$out/$1/summary.log" >> "$out/summary.log"
}

applied=()
run_step base
for patch_file in "${patches[@]}"; do
  name=$(basename "$patch_file" .patch)
  if ! patch -p1 --forward --dry-run < "$patch_file" > /dev/null; then
    echo "$name: does not apply on top of ${applied[*]:-the base}; stopping" | tee -a "$out/summary.log"
    break
  fi
  patch -p1 --forward < "$patch_file" > /dev/null
  applied+=("$patch_file")
  run_step "$name" || break
done
for ((i = ${#applied[@]} - 1; i >= 0; --i)); do patch -R -p1 < "${applied[i]}" > /dev/null; done

cat "$out/summary.log"
archive=$(mktemp --suffix=.tar.gz)
(cd "$out" && tar czf "$archive" --exclude=./summary.log . &&
  find . -mindepth 1 -maxdepth 1 ! -name summary.log -exec rm -rf {} + && mv "$archive" results.tar.gz)
