#!/bin/bash
# The GPU side of an A/B kit (make.sh): base against new, the most telling measurements first, until a
# deadline. Every result goes to a log of its own under a folder that is packed into OUT_TGZ after each
# step, so a run cut short keeps what it measured.
#   usage: KIT/run.sh KIT DEADLINE_SECONDS OUT_TGZ
# Order: the e4m3 harness; the MXFP4 probe (base set); the K3-shaped MXFP4 kernels at width 1 (timed),
# base, new; the 48B-shaped FP8 whole step at width 1, base, new, base, new, then once each with the
# prefetch tables off; its per-kernel tables at width 1,
# base, new; the K3 kernels at width 4 (timed);
# the new set's kernel checks of the K3-tiny MXFP4 and the FP8 cases; `run --check --graph` of the new
# K3-tiny bundle at widths 1, 3, 8; the MXFP4 probe (new set); hardware counters of the new set's
# quantized GEMVs (ncu), last.
set -u
kit=$(cd "${1:?usage: run.sh KIT DEADLINE_SECONDS OUT_TGZ}" && pwd)
deadline=${2:?deadline}
tgz=${3:?output archive}
out=$(mktemp -d)/ab
mkdir -p "$out"
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$out/log.txt"; tar -czf "$tgz" -C "$(dirname "$out")" ab; }
left() { [ $(($(date +%s) - t0 + $1)) -lt "$deadline" ]; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$out/smi.txt" 2>&1
work=$(mktemp -d)
for v in base new; do
  mkdir -p "$work/cub-$v"
  xz -dc "$kit/cub-$v.tar.xz" | tar -C "$work/cub-$v" -xf -
done
xz -dc "$kit/cli.tar.xz" | tar -C "$work" -xf -
cli=$work/cli
dp="env LD_LIBRARY_PATH=$cli $cli/decodepack"
chk=$kit/dp_kernel_check
"$chk" "$work/cub-base" --list > "$out/cases.txt"
case_of() { awk -F'\t' -v n="$1" '$2 == n {print $1}' "$out/cases.txt"; }
say "unpacked; $($dp --version 2>&1 | head -1)"
timeout 90 "$kit/gemv_harness" > "$out/gemv.txt" 2>&1; say "harness rc $?"
timeout 60 "$kit/fp4_probe-base" 20 > "$out/probe-base.txt" 2>&1; say "probe base rc $?"
k1=$(case_of "kimi-k3 w1 q1 mxfp4"); k4=$(case_of "kimi-k3 w4 q1 mxfp4")
for v in base new; do timeout 60 "$chk" "$work/cub-$v" --case "$k1" --time > "$out/k3-w1-$v.txt" 2>&1; say "K3 w1 $v rc $?"; done
model=$cli/kimi-linear-48b-shaped-4-layers-fp8.json
for pass in 1 2; do
  for v in base new; do
    left 80 || { say "no time for the step bench ($v, pass $pass)"; continue; }
    timeout 100 $dp bench "$cli/b48fp8-$v.dpk" --model "$model" --widths 1 --replays 50 --no-kernels \
      > "$out/step-w1-$v-$pass.txt" 2>&1
    say "step w1 $v pass $pass rc $? $(grep -A1 '^whole step' "$out/step-w1-$v-$pass.txt" | tail -1 | awk '{print $4, "us"}')"
  done
done
# The same step with the prefetch tables off, one pass each: the kit's bundles carry four prefetch points,
# the default deploy at TP 1 none, and beside kda_step and mla_prep a prefetch window costs each 3-4 us
# in sequence (2026-12-08).
for v in base new; do
  left 60 || { say "no time for the step bench without prefetch ($v)"; break; }
  timeout 100 $dp bench "$cli/b48fp8-$v.dpk" --model "$model" --widths 1 --replays 50 --no-kernels --prefetch off \
    > "$out/step-w1-$v-noprefetch.txt" 2>&1
  say "step w1 $v prefetch off rc $? $(grep -A1 '^whole step' "$out/step-w1-$v-noprefetch.txt" | tail -1 | awk '{print $4, "us"}')"
done
# The per-kernel tables of each set at width 1 (each kernel alone and in sequence): which kernel a step
# difference comes from.
for v in base new; do
  left 90 || { say "no time for the per-kernel table ($v)"; break; }
  timeout 120 $dp bench "$cli/b48fp8-$v.dpk" --model "$model" --widths 1 --replays 30 > "$out/kernels-w1-$v.txt" 2>&1
  say "per-kernel table w1 $v rc $?"
done
for v in base new; do
  left 75 || break
  timeout 100 "$chk" "$work/cub-$v" --case "$k4" --time > "$out/k3-w4-$v.txt" 2>&1; say "K3 w4 $v rc $?"
done
for c in $(awk -F'\t' '$2 ~ /^kimi-k3-tiny .*mxfp4$/ || $2 ~ / fp8$/ {print $1}' "$out/cases.txt"); do
  left 25 || { say "no time for case $c"; break; }
  timeout 40 "$chk" "$work/cub-new" --case "$c" > "$out/check-new-$c.txt" 2>&1
  say "check new case $c rc $? $(grep -E 'checks,' "$out/check-new-$c.txt" | tail -1)"
done
for w in 1 3 8; do
  left 30 || { say "no time for run --check w$w"; break; }
  timeout 40 $dp run "$cli/k3t-new.dpk" --model kimi-k3-tiny --width "$w" --check --graph --steps 3 --context 3000 \
    > "$out/run-k3t-new-w$w.txt" 2>&1
  say "run --check K3-tiny new w$w rc $? $(grep -E 'checks' "$out/run-k3t-new-w$w.txt" | tail -1)"
done
left 30 && { timeout 60 "$kit/fp4_probe-new" 20 > "$out/probe-new.txt" 2>&1; say "probe new rc $?"; }
# Hardware counters of the new set's quantized GEMVs (one launch each; the clocks are left alone, so the
# durations are not figures to compare): stall reasons, issue rate, SM activity, DRAM throughput.
ncu_sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats"
ncu_sections="$ncu_sections --section Occupancy --section LaunchStats --section InstructionStats"
ncu_stalls="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
k65=$(case_of "kimi-linear-48b w1 q1 fp8")
for spec in "$k1:moe_down_w1_d3584_i3072_e896_k16_s0_q41\$" "$k1:moe_up_w1_d3584_i3072_e896_k16_s0_act1_q41\$" \
            "$k65:(mlp_up|moe_up|moe_down|gemm)_w1_.*q81\$"; do
  left 60 || { say "no time for the profile of ${spec#*:}"; break; }
  # shellcheck disable=SC2086
  timeout 120 ncu --clock-control none $ncu_sections --metrics "$ncu_stalls" -k "regex:${spec#*:}" -c 4 \
    "$chk" "$work/cub-new" --case "${spec%%:*}" > "$out/ncu-${spec%%:*}-$(echo "${spec#*:}" | tr -dc 'a-z0-9_' | cut -c1-24).txt" 2>&1
  say "profile ${spec#*:} rc $?"
done
say done
