#!/bin/bash
# Packs an A/B comparison of two template sets for one GPU run (README.md): the kernel checks' code objects,
# the e4m3 GEMV harness and the MXFP4 core probe built against each set, the CLI with its libraries, and
# the bundles the step bench and `run --check` need, into KIT_DIR (about 30 MB; carry it to the GPU
# machine and start run.sh there).
#   usage: bench/ab_kit/make.sh KIT_DIR BASE_TEMPLATES NEW_TEMPLATES
# Environment: BUILD (default build/ci: dp_kernel_build, dp_kernel_check, decodepack), STATIC (default
# build/static: a decodepack configured with -DDP_LLVM_STATIC=ON, so that the kit carries no libLLVM),
# NEW_BUILD (default BUILD): the build whose dp_kernel_build and decodepack make the new set's code objects
# and bundles, for a change to the compiler's plan or codegen as well as to the templates (the harness's
# variants keep BUILD's generated entry points).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
kit=${1:?usage: make.sh KIT_DIR BASE_TEMPLATES NEW_TEMPLATES}
base=$(cd "${2:?base templates}" && pwd)
new=$(cd "${3:?new templates}" && pwd)
build=${BUILD:-$root/build/ci}
static=${STATIC:-$root/build/static}
new_build=${NEW_BUILD:-$build}
for t in "$build/tests/gpu/kernels/dp_kernel_build" "$build/tests/gpu/kernels/dp_kernel_check" "$static/tools/decodepack" \
         "$new_build/tests/gpu/kernels/dp_kernel_build" "$new_build/tools/decodepack"; do
  [ -x "$t" ] || { echo "make.sh: $t is not built (README.md)" >&2; exit 2; }
done
mkdir -p "$kit"
kit=$(cd "$kit" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { echo "== $*"; }
# The template set and the build of set $1 (base or new): tpl, b.
set_of() {
  if [ "$1" = new ]; then tpl=$new b=$new_build; else tpl=$base b=$build; fi
}

# Kernel checks' code objects, one set per template set (about 2.5 min each on 2 cores).
for v in base new; do
  set_of $v
  say "kernels ($v)"
  DECODEPACK_TEMPLATES_DIR=$tpl "$b/tests/gpu/kernels/dp_kernel_build" "$work/cub-$v" > "$work/kb-$v.log" 2>&1 ||
    grep -E "spills|written" "$work/kb-$v.log"
  tar -C "$work/cub-$v" -cf - . | xz -T2 -6 > "$kit/cub-$v.tar.xz"
done
cp "$build/tests/gpu/kernels/dp_kernel_check" "$kit/" && strip "$kit/dp_kernel_check"
# Registers and spills that differ between the sets.
join <(grep -v '^#' "$work/cub-base/usage.txt" | sort) <(grep -v '^#' "$work/cub-new/usage.txt" | sort) |
  awk '$2 != $6 || $5 != $9 {print $1, "registers", $2, "->", $6, "spills", $5, "->", $9}' > "$kit/usage-diff.txt"

say "e4m3 harness and MXFP4 probe"
DECODEPACK="$build/tools/decodepack" "$root/bench/gemv_harness/build.sh" "$work/gh" "base:-I$base" "new:-I$new" > /dev/null
cp "$work/gh/gemv_harness" "$kit/"
for v in base new; do
  set_of $v
  "$root/bench/fp4_probe/build.sh" "$work/probe-$v" "$tpl" > /dev/null
  cp "$work/probe-$v/fp4_probe" "$kit/fp4_probe-$v"
done

say "CLI and bundles"
cli=$work/cli
mkdir -p "$cli"
cp "$static/tools/decodepack" "$cli/" && strip "$cli/decodepack"
ldd "$static/tools/decodepack" | awk '/=>/ && $3 ~ /^\// {print $3}' | while read -r lib; do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libresolv.so.*|libstdc++.so.*|libgcc_s.so.*) ;;
    *) cp -L "$lib" "$cli/" ;;
  esac
done
strip --strip-unneeded "$cli"/*.so* 2>/dev/null || true
model=$root/tests/gpu/configs/kimi-linear-48b-shaped-4-layers-fp8.json
cp "$model" "$cli/"
echo '{ "targets": ["sm_90a"], "widths": [1, 8], "prefetch": { "points": ["oproj_down", "attention_moe", "next_attention", "attention_oproj"] } }' > "$work/w18.json"
echo '{ "targets": ["sm_90a"], "widths": [1, 2, 3, 4, 5, 6, 7, 8] }' > "$work/w1to8.json"
for v in base new; do
  set_of $v
  DECODEPACK_TEMPLATES_DIR=$tpl "$b/tools/decodepack" build --model "$model" --deploy "$work/w18.json" \
    -o "$cli/b48fp8-$v.dpk" -j 2 --no-weights > "$work/b48-$v.log" 2>&1 || { cat "$work/b48-$v.log"; exit 1; }
  DECODEPACK_TEMPLATES_DIR=$tpl "$b/tools/decodepack" build --model kimi-k3-tiny --deploy "$work/w1to8.json" \
    -o "$cli/k3t-$v.dpk" -j 2 --no-weights > "$work/k3t-$v.log" 2>&1 || { cat "$work/k3t-$v.log"; exit 1; }
done
tar -C "$work" -cf - cli | xz -T2 -9 > "$kit/cli.tar.xz"
cp "$root/bench/ab_kit/run.sh" "$kit/"
du -sh "$kit"
echo "kernels whose registers or spills differ: $(wc -l < "$kit/usage-diff.txt") (usage-diff.txt)"
