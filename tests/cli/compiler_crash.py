#!/usr/bin/env python3
"""NVRTC runs inside decodepack: a compiler crash on one kernel must end the build with one line that names
the kernel and the toolchain exit code (7), not "Segmentation fault", and leave nothing at the output path.

usage: compiler_crash.py DECODEPACK

The crash is injected (DECODEPACK_TEST_NVRTC_CRASH names the kernel whose compile raises SIGSEGV inside
NVRTC's call): NVRTC has no input known to crash it in every version. Exits 77 (skipped) where the tool
has no NVRTC (`doctor --json`: the NVIDIA toolchain is nvcc, or none).
"""
import json
import os
import subprocess
import sys
import tempfile

exe = sys.argv[1]
KERNEL = "rmsnorm_w1_h256.sm_90a"  # kimi-linear-tiny's first norm at width 1 (kernel key: name.target)

with tempfile.TemporaryDirectory(prefix="dp-crash-") as tmp:
    deploy = os.path.join(tmp, "deploy.json")
    with open(deploy, "w") as f:
        json.dump({"targets": ["sm_90a"], "widths": [1]}, f)
    doctor = subprocess.run([exe, "doctor", "--json"], capture_output=True, text=True)
    nvidia = json.loads(doctor.stdout)["toolchains"]["nvidia"]
    if not nvidia["found"] or not nvidia["version"].startswith("nvrtc"):
        print("skipped: this decodepack finds no NVRTC (the crash note guards NVRTC's in-process compile)")
        sys.exit(77)
    out = os.path.join(tmp, "out.dpk")
    base = [exe, "build", "--model", "kimi-linear-tiny", "--deploy", deploy, "-o", out, "--no-cache", "-j", "2"]
    env = dict(os.environ, DECODEPACK_TEST_NVRTC_CRASH=KERNEL)
    r = subprocess.run(base, capture_output=True, text=True, env=env)
    lines = [l for l in r.stderr.splitlines() if "crashed" in l]
    if r.returncode != 7:
        sys.exit(f"a crash in NVRTC: exit {r.returncode}, expected 7 (toolchain)\n{r.stderr[-2000:]}")
    want = f"decodepack: NVRTC "
    if len(lines) != 1 or not lines[0].startswith(want) or f"compiling kernel {KERNEL}:" not in lines[0] \
            or not lines[0].endswith("(SIGSEGV)"):
        sys.exit(f"the crash line does not name NVRTC, the kernel, the target and the signal:\n{r.stderr[-2000:]}")
    if os.path.exists(out):
        sys.exit(f"{out} exists after a crashed build")
    print(lines[0])
    # Without the hook the same build completes: the note changes nothing when nothing crashes.
    r = subprocess.run(base, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(out):
        sys.exit(f"the same build without the injected crash failed ({r.returncode}):\n{r.stderr[-2000:]}")
    print("ok: the crash is one line naming the kernel, exit 7, no output; the build without it completes")
