#!/bin/bash
# Builds the e4m3 GEMV harness: the FP8 entry points the product generates for the 48B-shaped model
# (tests/gpu/configs/kimi-linear-48b-shaped-4-layers-fp8.json, widths 1 and 8), once per variant of the
# templates, linked into one binary that times and compares them (README.md).
#   usage: bench/gemv_harness/build.sh OUT_DIR [NAME:NVCC_FLAGS ...]     (default: one variant "base:")
# A variant's flags come before the repository's templates on the include path, so -I DIR with a copy
# of templates/ (or -D of a macro the templates read) makes a variant.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:?usage: build.sh OUT_DIR [NAME:NVCC_FLAGS ...]}
shift
[ $# -gt 0 ] || set -- "base:"
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
dp=${DECODEPACK:-$root/build/ci/tools/decodepack}
[ -x "$dp" ] || { echo "build.sh: $dp is not built (or set DECODEPACK)" >&2; exit 2; }
mkdir -p "$out/gen"
out=$(cd "$out" && pwd)
deploy="$out/gen/deploy.json"
echo '{"targets":["sm_90a"],"widths":[1,8]}' > "$deploy"
"$dp" build --model "$root/tests/gpu/configs/kimi-linear-48b-shaped-4-layers-fp8.json" --deploy "$deploy" \
  -o "$out/gen/bundle" --force --no-weights --emit-source "$out/gen/src" > "$out/gen/build.log" 2>&1
for w in 1 8; do
  for k in gemm_w${w}_k4096_na2304_q81 gemm_w${w}_k9216_na2304_q81 \
           gemm_w${w}_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32_q87 mlp_up_w${w}_d2304_i9216_act0_q81 \
           moe_up_w${w}_d2304_i1024_e256_k8_s1024_act0_q81 moe_down_w${w}_d2304_i1024_e256_k8_s1024_q81$([ $w = 8 ] && echo _sk264); do
    # The entry point without its C linkage, so that each variant's copy can be renamed by a macro.
    sed -n '/^#include/,$p' "$out/gen/src/$k.sm_90a.cu" | sed 's/extern "C" //' > "$out/gen/$k.inc"
  done
done
# Each kernel's grid as the product launches it (the generated source's "launch:" line), unless a
# variant sets its own with -DGRID_<kernel>=N.
: > "$out/gen/grids.h"
for w in 1 8; do
  for pair in "O:gemm_w${w}_k4096_na2304_q81" "D:gemm_w${w}_k9216_na2304_q81" \
              "Q:gemm_w${w}_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32_q87" "M:mlp_up_w${w}_d2304_i9216_act0_q81" \
              "U:moe_up_w${w}_d2304_i1024_e256_k8_s1024_act0_q81" \
              "N:moe_down_w${w}_d2304_i1024_e256_k8_s1024_q81$([ $w = 8 ] && echo _sk264)"; do
    grid=$(sed -n 's/^\/\/ launch: .* grid \([0-9]*\) blocks.*/\1/p' "$out/gen/src/${pair#*:}.sm_90a.cu")
    [ -n "$grid" ] || { echo "build.sh: no launch line in ${pair#*:}" >&2; exit 1; }
    printf '#ifndef GRID_%s%s\n#define GRID_%s%s %s\n#endif\n' "${pair%%:*}" $w "${pair%%:*}" $w "$grid" >> "$out/gen/grids.h"
  done
done
objs=(); decls=; list=; i=0
for spec in "$@"; do
  name=${spec%%:*}; flags=${spec#*:}
  # shellcheck disable=SC2086
  "$nvcc" -std=c++17 -O3 -arch=sm_90a -DVAR=v$i $flags -I"$root/templates" -I"$out/gen" -c "$here/kern.cu" \
    -o "$out/k$i.o" -Xptxas -v 2>&1 | grep -E "registers|spill" | sed "s/^/[$name] /" > "$out/k$i.usage" || true
  objs+=("$out/k$i.o"); decls="$decls DECL(v$i)"; list="$list {\"$name\", run_v$i},"
  i=$((i + 1))
done
printf '#define VARIANT_DECLS %s\n#define VARIANT_LIST %s\n' "$decls" "$list" > "$out/variants.h"
"$nvcc" -std=c++17 -O2 -arch=sm_90a -include "$out/variants.h" "$here/main.cu" "${objs[@]}" -o "$out/gemv_harness"
echo "built $out/gemv_harness ($i variant(s)); registers and spills per kernel: $out/k*.usage"
