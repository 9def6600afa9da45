#!/usr/bin/env bash
# A/B of a source change on one GPU machine, in one device call: device_run.sh's stages $AB_STAGES on the tree as
# sent (the change), then on the tree with the patch $AB_PATCH reverted (the base: `patch -R -p1`), each into its own
# folder ($OUT/change, $OUT/base). For changes a runtime switch cannot select (a bench_env_ab.py A/B in one process
# is the better test where one can). The build stage rebuilds the second time since the sources differ.
#   git diff main my-branch -- csrc > ab.patch      (untracked, so it travels with the tree)
#   AB_PATCH=ab.patch AB_STAGES="build bench ncu_vs_cudnn" BENCH_ARGS="--head-dims 64 128 --impls jax_flash_sm90
#   cudnn" bash csrc/cuda/tests/device_ab.sh
# Each half's build links a carried prebuilt*/ library whose stamp matches its sources where one does (device_run.sh
# prebuild with PREBUILT_DIR=prebuilt_<name> for the patched tree), else compiles the kernels.
# BENCH_ARGS gets --tag change / --tag base appended, so the two result files stay apart. AB_LIMIT (seconds, optional)
# caps each half (device_run.sh's TOTAL_LIMIT); by default TOTAL_LIMIT, if set, is split between the halves.
set -uo pipefail
out=${OUT:-/tmp/device_ab}
patch_file=${AB_PATCH:?AB_PATCH names the change as a patch against the base}
stages=${AB_STAGES:-build bench}
half=${AB_LIMIT:-${TOTAL_LIMIT:+$((TOTAL_LIMIT / 2))}}
here=$(dirname "$(readlink -f "$0")")
bench_args=${BENCH_ARGS:-}

run_half() {  # run_half NAME
  mkdir -p "$out/$1"
  # shellcheck disable=SC2086  # the stage list is a word list
  OUT="$out/$1" TOTAL_LIMIT=${half:-} BENCH_ARGS="$bench_args --tag $1" bash "$here/device_run.sh" $stages
  sed "s/^/$1: /" "$out/$1/summary.log" >> "$out/summary.log"
}

run_half change
if ! patch -R -p1 --dry-run < "$patch_file" > /dev/null; then
  echo "AB_PATCH does not revert cleanly on this tree; no base run" | tee -a "$out/summary.log"
  exit 1
fi
patch -R -p1 < "$patch_file" > /dev/null
run_half base
cat "$out/summary.log"
