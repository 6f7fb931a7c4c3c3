#!/usr/bin/env bash
# decodepack developer entry point (see README.md):
#   ./dev.sh demo   install what is missing, build, run the main job on the embedded default
#                   (synth a tiny model, plan, build, inspect and verify its bundle)
#   ./dev.sh test   install what is missing, build, run every CPU test (ctest, label gpu excluded)
# Both are idempotent; the packages come from Debian 12's archive. The CUDA toolkit is not a Debian
# package: it is used from /usr/local/cuda (or $DP_CUDA_ROOT) when present; without it, CUDA compile
# tests skip and say so.
set -euo pipefail
cd "$(dirname "$0")"

mode=${1:-demo}
case "$mode" in demo|test) ;; *) echo "usage: $0 demo|test" >&2; exit 2 ;; esac

packages=(
  build-essential cmake ninja-build pkg-config git ca-certificates python3
  nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev libgmock-dev
  libssl-dev libcurl4-openssl-dev libarchive-dev
  llvm-19-dev clang-19 lld-19 libclang-rt-19-dev
  docker-registry python3-jsonschema python3-pip python3-setuptools
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "== installing: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

cuda_root=${DP_CUDA_ROOT:-/usr/local/cuda}
[ -x "$cuda_root/bin/nvcc" ] || echo "== note: no CUDA toolkit at $cuda_root: sm_XX compiles and their tests are skipped"

jobs=$(nproc)
echo "== configure and build (build/ci, $jobs jobs)"
cmake --preset ci -DDP_CUDA_ROOT="$cuda_root" >/dev/null
if [ "$mode" = test ]; then
  cmake --build --preset ci -j "$jobs"
else
  cmake --build --preset ci -j "$jobs" --target decodepack   # the tool alone: no tests, no fuzzers
fi

if [ "$mode" = test ]; then
  echo "== CPU test suite"
  ctest --preset ci -j "$jobs"
  exit 0
fi

dp=build/ci/tools/decodepack
out=out/demo
mkdir -p "$out"
echo "== synth: a tiny Kimi-Linear checkpoint with the real tensor names"
"$dp" synth --preset kimi-linear-tiny -o "$out/tiny" --seed 0
echo "== plan: the default deploy (sm_90a + gfx942, TP 1, widths 1-8)"
"$dp" plan --model "$out/tiny" --deploy default
"$dp" plan --model "$out/tiny" --deploy default --json > "$out/plan.json"
echo "== build: compile and package the bundle"
"$dp" build --model "$out/tiny" --deploy default -o "$out/tiny.dpk"
echo "== inspect"
"$dp" inspect "$out/tiny.dpk"
echo "== verify (digests, code objects, weight fingerprints)"
"$dp" verify "$out/tiny.dpk" --model "$out/tiny"
echo "== plan and build of the real 48B shape (config only, no weights)"
"$dp" plan --model kimi-linear-48b-a3b --deploy default > "$out/plan-48b.txt"
head -n 3 "$out/plan-48b.txt"
"$dp" build --model kimi-linear-48b-a3b --deploy default -o "$out/kimi-linear-48b-a3b.dpk"
echo "== done: outputs under $out/"
