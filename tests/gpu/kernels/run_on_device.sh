#!/bin/sh
# Runs the decode-kernel checks on a GPU machine, each case in its own process (a fault in one case
# cannot hide the others), then compute-sanitizer memcheck and racecheck on three small cases (dense and
# padded host layouts, and padded with FP8 weights).
#   usage: run_on_device.sh DIR LOG_DIR
# DIR holds dp_kernel_check and cubins/ (built elsewhere with dp_kernel_build, see RESULTS.md);
# LOG_DIR receives kernel_check.log, kernel_check.tsv and sanitizer.log.
set -u
dir=$1
logs=$2
check="$dir/dp_kernel_check"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$logs/kernel_check.log" 2>&1
"$check" "$dir/cubins" --list > "$logs/cases.txt" || exit 1
n=$(wc -l < "$logs/cases.txt")
failed=0
i=0
while [ "$i" -lt "$n" ]; do
  extra=""
  # The 48B-shaped and K3-shaped cases are timed.
  awk -F'\t' -v i="$i" '$1 == i && $2 ~ /^(kimi-linear-48b|kimi-k3) /' "$logs/cases.txt" | grep -q . && extra="--time"
  "$check" "$dir/cubins" --case "$i" --out "$logs/kernel_check.tsv" $extra >> "$logs/kernel_check.log" 2>&1 ||
    failed=$((failed + 1))
  i=$((i + 1))
done
# kimi-linear-tiny w3 q2: a padded request and spec-decode slots; the padded variant adds padded pools
# and the fused w13; the FP8 one the e4m3 weights with their block scales (fused w13 scales). The K3
# ones: the q-LoRA chain (strided rmsnorm rows, gate columns), a tensor-parallel rank's A_log offset, and
# the latent MoE with fused MXFP4 w13 and padded w2 stacks.
for name in "kimi-linear-tiny w3 q2" "kimi-linear-tiny w3 q2 padded" "kimi-linear-tiny w3 q2 padded fp8" \
            "kimi-k3-tiny w3 q2" "kimi-k3-tiny-tp2-rank1 w4 q2" "kimi-k3-tiny w3 q2 padded mxfp4"; do
  small=$(awk -F'\t' -v n="$name" '$2 == n {print $1}' "$logs/cases.txt")
  [ -n "$small" ] || { echo "no case named $name" >> "$logs/sanitizer.log"; failed=$((failed + 1)); continue; }
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool, case $small ($name)" >> "$logs/sanitizer.log"
    compute-sanitizer --tool "$tool" "$check" "$dir/cubins" --case "$small" >> "$logs/sanitizer.log" 2>&1
    echo "exit $?" >> "$logs/sanitizer.log"
  done
done
grep -E "FAIL|checks,|dp_kernel_check:" "$logs/kernel_check.log"
grep -E "==|ERROR SUMMARY|RACECHECK SUMMARY|exit" "$logs/sanitizer.log"
echo "cases: $n, processes failed: $failed"
[ "$failed" -eq 0 ]
