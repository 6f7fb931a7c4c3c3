#!/bin/sh
# Packs what bench/run_on_device.sh needs on a GPU host that lacks this machine's libraries:
#   KIT/bin/decodepack        the CLI (debug info stripped)
#   KIT/lib/                  every shared library it loads (ldd) except the C and C++ runtimes
#   KIT/glibc/                the C and C++ runtimes and the dynamic loader, used only where the host's
#                             glibc is older than the one the CLI was built against (run_on_device.sh
#                             then starts the CLI through KIT/glibc/ld-linux-x86-64.so.2)
#   KIT/bundles/              the bundles the run times, built here (sm_90a): the 48B-shaped bench model
#                             (bench/configs) and the kimi-linear-48b-a3b preset, widths 1, 2, 4, 8
# then KIT.tar.xz, the one file to carry (run_on_device.sh unpacks it), and the fla-core wheel the
# baseline needs into .whl/ at the repository root.
#   usage: bench/make_device_kit.sh [BUILD_DIR [KIT_DIR]]      (defaults: build/ci, build/device-kit)
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build/ci}
kit=${2:-$root/build/device-kit}
dp=$build/tools/decodepack
[ -x "$dp" ] || { echo "make_device_kit.sh: $dp is not built (cmake --build --preset ci --target decodepack)" >&2; exit 2; }

rm -rf "$kit" "$kit.tar.xz"
mkdir -p "$kit/bin" "$kit/lib" "$kit/glibc" "$kit/bundles"
cp "$dp" "$kit/bin/decodepack"
strip --strip-debug "$kit/bin/decodepack"

# Libraries: the C runtime (glibc), libstdc++ and libgcc_s go to glibc/ (a newer host's own are used
# instead), everything else to lib/. libcuda.so.1, opened at run time, is the host's.
ldd "$dp" | awk '/=>/ && $3 ~ /^\// {print $3}' | while read -r lib; do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libresolv.so.*|libstdc++.so.*|libgcc_s.so.*) dest=glibc ;;
    *) dest=lib ;;
  esac
  cp -L "$lib" "$kit/$dest/"
done
# The loader, and the glibc pieces libcuda itself needs (it predates glibc 2.34's merge).
for lib in /lib64/ld-linux-x86-64.so.2 /lib/x86_64-linux-gnu/libpthread.so.0 /lib/x86_64-linux-gnu/libdl.so.2 \
           /lib/x86_64-linux-gnu/librt.so.1 /lib/x86_64-linux-gnu/libm.so.6 /lib/x86_64-linux-gnu/libc.so.6; do
  [ -e "$lib" ] && cp -L "$lib" "$kit/glibc/"
done
strip --strip-unneeded "$kit"/lib/*.so* 2>/dev/null || true
chmod +x "$kit/glibc/ld-linux-x86-64.so.2"

# Bundles (deterministic; the kernel cache makes a rebuild fast).
"$dp" build --model "$root/bench/configs/kimi-linear-48b-shaped-bench.json" --deploy "$root/bench/deploy-bench.json" \
  -o "$kit/bundles/bench-48b-shaped.dpk" -j 2
"$dp" build --model kimi-linear-48b-a3b --deploy "$root/bench/deploy-bench.json" \
  -o "$kit/bundles/kimi-linear-48b-a3b.dpk" -j 2

# The baseline's KDA kernel (pure Python + Triton: one wheel for any platform).
mkdir -p "$root/.whl"
ls "$root"/.whl/fla_core-*.whl >/dev/null 2>&1 ||
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$root/.whl" fla-core

tar -C "$(dirname "$kit")" -cf - "$(basename "$kit")" | xz -T2 -6 > "$kit.tar.xz"
du -sh "$kit" "$kit.tar.xz" "$root/.whl"
echo "carry: $(realpath --relative-to="$root" "$kit.tar.xz") and .whl"
