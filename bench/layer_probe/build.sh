#!/bin/bash
# bench/layer_probe/build.sh OUT_DIR: the chain-vs-fused probe of the FFN half (sm_90a).
set -e
here=$(cd "$(dirname "$0")" && pwd); out=${1:?output directory}; mkdir -p "$out"
nv="/usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I$here -I$here/../../templates -Xptxas -v"
$nv -c "$here/mega.cu" -o "$out/mega.o" 2> "$out/mega.usage"
$nv -DPROBE_CG=1 -c "$here/mega.cu" -o "$out/mega_cg.o" 2> "$out/mega_cg.usage"
$nv -c "$here/chain.cu" -o "$out/chain.o" 2> "$out/chain.usage"
/usr/local/cuda/bin/nvcc -o "$out/layer_probe" "$out/chain.o" "$out/mega.o" "$out/mega_cg.o"
grep -hE "Function properties|registers|spill" "$out"/mega*.usage || true
