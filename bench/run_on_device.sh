#!/bin/sh
# The GPU run of issue 14, in one go, on an NVIDIA GPU host (an H200: well within 8 minutes):
#   1. unpacks the device kit (bench/make_device_kit.sh: decodepack, its libraries, the bundles) and
#      finds how to start decodepack there (with the kit's libraries, else through the kit's loader);
#   2. records the device, driver and clocks (nvidia-smi) and the commit;
#   3. decodepack bench on the 48B-shaped bench model (bench/configs: 4 layers of each class), widths
#      1, 2, 4, 8, context 4096: ceiling, gate, classes, whole step, per-kernel breakdown -> bench.json;
#   4. the stock-kernel baseline on the same shapes (bench/baseline.py; fla-core from .whl/) -> baseline.json;
#   5. the chart (chart.png) and, while time is left, the kimi-linear-48b-a3b preset's whole step at widths 1 and 8
#      (27 layers, 90 GiB of random weights) -> bench-48b.json;
#   6. prints the summary table last.
# Every stage has a time limit; a stage that fails or runs out of time is reported and the others go on
# (bench and baseline rewrite their JSON as they go, so a stopped stage keeps what it measured).
#   usage: bench/run_on_device.sh OUTDIR        (from the repository root or anywhere)
# Environment: DP_KIT (default build/device-kit), DP_BENCH_REPLAYS (default 100), DP_COMMIT (the commit
# measured, recorded in device.txt, where the copy has no .git), DP_STAGES (default "bench baseline 48b": which
# of the three measurements to run; e.g. DP_STAGES=48b gives the 48B preset the whole time budget), DP_BENCH_FLAGS
# (more options for the bench model's `decodepack bench`, e.g. --no-prefetch).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: bench/run_on_device.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
kit=${DP_KIT:-$root/build/device-kit}
replays=${DP_BENCH_REPLAYS:-100}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
say() { echo "[$(elapsed) s] $*" | tee -a "$out/run.log"; }
want() { case " ${DP_STAGES:-bench baseline 48b} " in *" $1 "*) return 0 ;; esac; return 1; }
: > "$out/run.log"

# ---- 1. the kit ----------------------------------------------------------------------------------------
if [ ! -x "$kit/bin/decodepack" ]; then
  [ -f "$kit.tar.xz" ] || { say "no $kit or $kit.tar.xz: run bench/make_device_kit.sh on the build machine"; exit 2; }
  say "unpacking $kit.tar.xz"
  if command -v xz >/dev/null 2>&1; then
    xz -dc "$kit.tar.xz" | tar -C "$(dirname "$kit")" -xf -
  else
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$kit.tar.xz" "$(dirname "$kit")"
  fi
fi
# The host's glibc may be older than the build machine's: then the kit's loader and C runtime start the
# CLI; the host's libcuda.so.1 is named explicitly (the kit's loader does not read the host's paths the
# same way).
# DP: the command that starts decodepack (paths without spaces).
if LD_LIBRARY_PATH="$kit/lib" "$kit/bin/decodepack" --version > /dev/null 2>&1; then
  DP="env LD_LIBRARY_PATH=$kit/lib $kit/bin/decodepack"
  say "decodepack: the kit's libraries with the host's C runtime"
elif "$kit/glibc/ld-linux-x86-64.so.2" --library-path "$kit/lib:$kit/glibc" "$kit/bin/decodepack" --version > /dev/null 2>&1; then
  DP="$kit/glibc/ld-linux-x86-64.so.2 --library-path $kit/lib:$kit/glibc $kit/bin/decodepack"
  libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 / {print $NF; exit}')
  [ -n "$libcuda" ] && export DECODEPACK_CUDA_LIBRARY="$libcuda"
  say "decodepack: the kit's loader and C runtime (host glibc too old); driver ${libcuda:-libcuda.so.1}"
else
  say "decodepack does not start here:"
  LD_LIBRARY_PATH="$kit/lib" ldd "$kit/bin/decodepack" 2>&1 | grep -i "not found" | tee -a "$out/run.log"
  exit 2
fi

# ---- 2. what ran where -----------------------------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: ${DP_COMMIT:-$(git -C "$root" rev-parse HEAD 2>/dev/null || echo "unknown (set DP_COMMIT)")}"
  echo "decodepack: $($DP --version)"
  echo "command: bench/run_on_device.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,pstate \
    --format=csv 2>&1
  nvidia-smi -q -d CLOCK 2>&1 | sed -n '1,60p'
} > "$out/device.txt"
say "device: $(sed -n 's/^NVIDIA\(.*\)/NVIDIA\1/p' "$out/device.txt" | head -1)"

bundles=$kit/bundles
model=$root/bench/configs/kimi-linear-48b-shaped-bench.json
export DECODEPACK_TEMPLATES_DIR="$root/templates"  # only for a bundle built here, when the kit has none
for b in bench-48b-shaped kimi-linear-48b-a3b; do
  [ -e "$bundles/$b.dpk" ] && continue
  say "building $b.dpk here (the kit has none; needs NVRTC)"
  m=$model; [ "$b" = kimi-linear-48b-a3b ] && m=kimi-linear-48b-a3b
  $DP build --model "$m" --deploy "$root/bench/deploy-bench.json" -o "$bundles/$b.dpk" -j 8 >> "$out/run.log" 2>&1 ||
    say "building $b.dpk failed"
done

# ---- 3. decodepack bench ------------------------------------------------------------------------------------
if want bench; then
  say "decodepack bench: bench-48b-shaped, widths 1,2,4,8, context 4096 ${DP_BENCH_FLAGS:-}"
  timeout 230 $DP bench "$bundles/bench-48b-shaped.dpk" --model "$model" --widths 1,2,4,8 --context 4096 \
    --replays "$replays" ${DP_BENCH_FLAGS:-} --json "$out/bench.json" > "$out/bench.txt" 2> "$out/bench.log"
  say "decodepack bench exit $? (124: out of time)"
fi

# ---- 4. the stock-kernel baseline ---------------------------------------------------------------------------
pylib=$root/build/pylib
if ls "$root"/.whl/fla_core-*.whl > /dev/null 2>&1 && [ ! -d "$pylib/fla" ]; then
  mkdir -p "$pylib"
  for w in "$root"/.whl/*.whl; do
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$pylib"
  done
fi
if want baseline; then
  say "baseline: stock PyTorch + fla on the same shapes"
  timeout 170 env PYTHONPATH="$pylib${PYTHONPATH:+:$PYTHONPATH}" python3 "$root/bench/baseline.py" --model "$model" \
    --widths 1,2,4,8 --context 4096 --replays "$replays" --json "$out/baseline.json" > "$out/baseline.txt" \
    2> "$out/baseline.log"
  say "baseline exit $? (124: out of time)"
fi

# ---- 5. chart, the 48B preset's whole step --------------------------------------------------------------
if [ -s "$out/bench.json" ]; then
  base=""; [ -s "$out/baseline.json" ] && base="--baseline $out/baseline.json"
  # shellcheck disable=SC2086
  python3 "$root/bench/chart.py" "$out/chart.png" "$out/bench.json" $base --title "decodepack bench, 48B-shaped layers" \
    >> "$out/run.log" 2>&1 || say "chart: not drawn (see run.log)"
fi
left=$(( 440 - $(elapsed) ))
if want 48b && [ "$left" -gt 150 ]; then
  say "decodepack bench: kimi-linear-48b-a3b whole step (27 layers), ${left} s left"
  timeout $(( left - 10 )) $DP bench "$bundles/kimi-linear-48b-a3b.dpk" --widths 1,8 --context 4096 --replays 30 \
    --no-kernels --json "$out/bench-48b.json" > "$out/bench-48b.txt" 2> "$out/bench-48b.log"
  say "48B preset exit $? (124: out of time)"
else
  say "skipping the 48B preset's whole step (${left} s left)"
fi

# ---- 6. summary ------------------------------------------------------------------------------------------
echo
echo "== summary ($(elapsed) s; files in $out)"
grep -E "^(ceiling|launch floor|gate)" "$out/bench.txt" 2>/dev/null
if [ -s "$out/bench.json" ]; then
  base=""; [ -s "$out/baseline.json" ] && base="--baseline $out/baseline.json"
  # shellcheck disable=SC2086
  python3 "$root/bench/chart.py" --table "$out/bench.json" $base
fi
[ -s "$out/bench-48b.json" ] && { echo; echo "kimi-linear-48b-a3b:"; python3 "$root/bench/chart.py" --table "$out/bench-48b.json" | grep -E "decodepack:|whole step|class"; }
exit 0
