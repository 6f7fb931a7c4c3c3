#!/bin/bash
# bench/fp4_probe/build.sh OUT_DIR [TEMPLATES_DIR]: the MXFP4 core probe (sm_90a), against the templates of
# this checkout (or TEMPLATES_DIR); registers and spills of both kernels in OUT_DIR/probe.usage.
set -e
here=$(cd "$(dirname "$0")" && pwd); out=${1:?output directory}; mkdir -p "$out"
tpl=${2:-$here/../../templates}
/usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I"$tpl" -Xptxas -v \
  "$here/probe.cu" -o "$out/fp4_probe" 2> "$out/probe.usage"
grep -E "registers|spill" "$out/probe.usage" || true
