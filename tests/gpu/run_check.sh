#!/bin/sh
# `decodepack run --check` as a ctest (label gpu), skipped (exit 77) where there is no CUDA driver or GPU.
#   run_check.sh run   DECODEPACK WORK BUNDLE WIDTH [run options...]
#   run_check.sh build DECODEPACK WORK BUNDLE DEPLOY_JSON
# WORK is the runtime tests' bundle directory (tests/unit/runtime: `model` is the synth checkpoint the
# bundles were built from); $DECODEPACK_TEST_WORK replaces it with bundles built elsewhere, which are
# then used as they are (build does nothing when the bundle is there). $DP_RUN_MODEL replaces the
# checkpoint (e.g. a config file: random weights, the 48B-shaped layers).
set -u
mode=$1
tool=$2
work=${DECODEPACK_TEST_WORK:-$3}
bundle=$work/$4
model=${DP_RUN_MODEL:-$work/model}
shift 4
case "$mode" in
  build)
    if [ -n "${DECODEPACK_TEST_WORK:-}" ] && [ -e "$bundle" ]; then
      echo "using $bundle"
      exit 0
    fi
    exec "$tool" build --model "$model" --deploy "$1" -o "$bundle" --cache-dir "$work/cache" -j 2
    ;;
  run)
    width=$1
    shift
    out=$("$tool" run "$bundle" --model "$model" --width "$width" --check "$@" 2>&1)
    rc=$?
    printf '%s\n' "$out"
    if [ "$rc" -eq 8 ] && printf '%s' "$out" | grep -Eq 'CUDA driver: cannot load|CUDA_ERROR_NO_DEVICE|no CUDA device visible'; then
      echo "skipped: no CUDA driver or GPU on this host"
      exit 77
    fi
    exit "$rc"
    ;;
  *)
    echo "usage: $0 run|build ..." >&2
    exit 2
    ;;
esac
