#!/bin/sh
# `decodepack indexer-run` as a ctest (label gpu): the indexer prefill through libdecodepack against the
# CPU reference. Skipped (exit 77, with the reason) without a CUDA driver or GPU, with fewer GPUs than the
# bundle's DCP world, or without NCCL for world > 1.
#   indexer_check.sh build DECODEPACK WORK BUNDLE MODEL DEPLOY_JSON
#   indexer_check.sh run   DECODEPACK WORK BUNDLE [indexer-run options...]
#   indexer_check.sh hf    DECODEPACK WORK BUNDLE PYTHON SCRIPT [hf_indexer_check.py options...]
set -u
mode=$1
tool=$2
work=$3
bundle=$work/$4
shift 4
skip_if_no_gpu() {  # rc, output
  if [ "$1" -eq 8 ] && printf '%s' "$2" | grep -Eq 'CUDA driver: cannot load|CUDA_ERROR_NO_DEVICE|no CUDA device visible|this host has [0-9]+ CUDA device|cannot open .*nccl'; then
    echo "skipped: this host lacks the CUDA driver, enough GPUs or NCCL for this bundle"
    exit 77
  fi
}
case "$mode" in
  build)
    mkdir -p "$work"
    exec "$tool" build --model "$1" --deploy "$2" -o "$bundle" --cache-dir "$work/cache" --no-weights -j 2
    ;;
  run)
    out=$("$tool" indexer-run "$bundle" "$@" 2>&1)
    rc=$?
    printf '%s\n' "$out"
    skip_if_no_gpu "$rc" "$out"
    exit "$rc"
    ;;
  hf)
    python=$1
    script=$2
    shift 2
    exec "$python" "$script" --decodepack "$tool" --bundle "$bundle" --dir "$work/hf-$(basename "$bundle" .dpk)" "$@"
    ;;
  *)
    echo "usage: $0 build|run|hf ..." >&2
    exit 2
    ;;
esac
