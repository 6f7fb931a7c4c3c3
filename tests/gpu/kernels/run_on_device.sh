#!/bin/sh
# Runs the decode-kernel checks on a GPU machine, each case in its own process (a fault in one case
# cannot hide the others), then compute-sanitizer memcheck and racecheck on one small case.
#   usage: run_on_device.sh DIR LOG_DIR
# DIR holds dp_kernel_check and cubins/ (built elsewhere with dp_kernel_build, see RESULTS.md);
# LOG_DIR receives kernel_check.log, kernel_check.tsv and sanitizer.log.
set -u
dir=$1
logs=$2
check="$dir/dp_kernel_check"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$logs/kernel_check.log" 2>&1
n=$("$check" "$dir/cubins" --count) || exit 1
failed=0
i=0
while [ "$i" -lt "$n" ]; do
  extra=""
  [ "$i" -eq $((n - 1)) ] && extra="--time"  # the last case is the 48B-shaped one
  "$check" "$dir/cubins" --case "$i" --out "$logs/kernel_check.tsv" $extra >> "$logs/kernel_check.log" 2>&1 ||
    failed=$((failed + 1))
  i=$((i + 1))
done
small=10  # kimi-linear-tiny w3 q2: a padded request and spec-decode slots
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool, case $small" >> "$logs/sanitizer.log"
  compute-sanitizer --tool "$tool" "$check" "$dir/cubins" --case "$small" >> "$logs/sanitizer.log" 2>&1
  echo "exit $?" >> "$logs/sanitizer.log"
done
grep -E "FAIL|checks,|dp_kernel_check:" "$logs/kernel_check.log"
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit" "$logs/sanitizer.log"
echo "cases: $n, processes failed: $failed"
[ "$failed" -eq 0 ]
