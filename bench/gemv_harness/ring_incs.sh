#!/bin/bash
# Writes copies of the harness's generated entry points (OUT_DIR/gen/*.inc, from build.sh) that stream
# their e4m3 weights through a shared-memory ring of N stages (templates/gemm.h, dp_ring_stream): the
# gemm kernels and the routed and dense gate/up (as block tiles) at both widths, and the routed down at
# width 1.
# With a fourth argument M, the gate/ups keep their warp tiles instead, each warp streaming its tiles
# through a ring of its own of M stages (dp_gate_up_warp_ring, what codegen plans for `rg` on them).
# A variant then takes them with -I DIR and -DRING_STAGES=N (and -DWARP_RING_STAGES=M; kern.cu sizes the
# dynamic shared memory):
#   bench/gemv_harness/ring_incs.sh OUT_DIR N DIR [M]
#   bench/gemv_harness/build.sh OUT_DIR base: "ring6:-I DIR -DRING_STAGES=6 -DGRID_U8=4160"
#   bench/gemv_harness/build.sh OUT_DIR base: "wring2:-I DIR2 -DRING_STAGES=6 -DWARP_RING_STAGES=2"
set -euo pipefail
gen=${1:?usage: ring_incs.sh OUT_DIR N DIR [M]}/gen
n=${2:?stages}
dir=${3:?directory for the edited copies}
m=${4:-}
mkdir -p "$dir"
for f in "$gen"/gemm_w1_k*_q8*.inc; do  # kEarly 1 is already the last argument
  sed -E "s/(dp_gemm_q8<[^>]*)>/\1, $n>/" "$f" > "$dir/$(basename "$f")"
done
for f in "$gen"/gemm_w8_k*_q8*.inc; do  # kEarly 0, then the ring
  sed -E "s/(dp_gemm_q8<[^>]*)>/\1, 0, $n>/" "$f" > "$dir/$(basename "$f")"
done
# moe_up and the dense gate/up, both widths: warp tiles (kWarpTiles 1, the last argument) -> warp tiles
# with a ring per warp of M stages, or block tiles with a ring of N (the width-8 routed gate/up then needs
# a block per tile: -DGRID_U8=4160)
if [ -n "$m" ]; then tiles="1, $m"; else tiles="0, $n"; fi
for f in "$gen"/moe_up_w*.inc; do
  sed -E "s/(dp_moe_up_q8<[^>]*), 1>/\1, $tiles>/" "$f" > "$dir/$(basename "$f")"
done
for f in "$gen"/mlp_up_w*.inc; do
  sed -E "s/(dp_mlp_up_q8<[^>]*), 1>/\1, $tiles>/" "$f" > "$dir/$(basename "$f")"
done
f=$(ls "$gen"/moe_down_w1_*.inc)
sed -E "s/(dp_moe_down_q8<[^>]*)>/\1, $n>/" "$f" > "$dir/$(basename "$f")"
grep -h "dp_gemm_q8<\|dp_moe_up_q8<\|dp_mlp_up_q8<\|dp_moe_down_q8<" "$dir"/*.inc | sed 's/(.*//'
