#!/usr/bin/env python3
"""A build killed at any moment leaves the previous bundle or none, never half of one.

usage: kill_build.py DECODEPACK

Builds bundle A (archive and directory), then repeatedly starts a build of a different bundle B to the
same paths and SIGKILLs it after a growing delay. After every kill the output path must hold exactly A
or exactly B (`decodepack verify` passes and the digest is A's or B's).
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

exe = sys.argv[1]


def run(*args):
    r = subprocess.run([exe, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{args} failed ({r.returncode}):\n{r.stderr}")
    return r.stdout


def digest(path):
    r = subprocess.run([exe, "verify", path, "--json"], capture_output=True, text=True)
    report = json.loads(r.stdout) if r.stdout.strip() else None
    if r.returncode != 0 or not report or not report["ok"]:
        sys.exit(f"{path} is not an intact bundle after a killed build (exit {r.returncode}):\n{r.stdout}{r.stderr}")
    return report["digest"]


with tempfile.TemporaryDirectory(prefix="dp-kill-") as tmp:
    deploy_a = os.path.join(tmp, "a.json")
    deploy_b = os.path.join(tmp, "b.json")
    for path, widths in ((deploy_a, [1]), (deploy_b, [1, 2, 3])):
        with open(path, "w") as f:
            json.dump({"targets": ["sm_90a", "gfx942"], "tensor_parallel": 1, "widths": widths,
                       "num_speculative_tokens": 0, "kv_cache": {"dtype": "bf16", "block_size": 64}}, f)
    model = os.path.join(tmp, "model")
    run("synth", "--preset", "kimi-linear-tiny", "-o", model)
    for out in (os.path.join(tmp, "out.dpk"), os.path.join(tmp, "outdir")):
        run("build", "--model", model, "--deploy", deploy_a, "-o", out, "--cache-dir", os.path.join(tmp, "cache"))
        a = digest(out)
        b = None
        seen = {"a": 0, "b": 0}
        for delay in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0, 4.0):
            p = subprocess.Popen([exe, "build", "--model", model, "--deploy", deploy_b, "-o", out, "--no-cache", "-j", "1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)
            p.wait()
            d = digest(out)
            if d == a:
                seen["a"] += 1
            else:
                if b is None:
                    b = d
                if d != b:
                    sys.exit(f"{out}: digest {d} is neither the old bundle's {a} nor the new one's {b}")
                seen["b"] += 1
                # Put A back so the next kill again races a replacement.
                run("build", "--model", model, "--deploy", deploy_a, "-o", out, "--cache-dir", os.path.join(tmp, "cache"))
        print(f"{os.path.basename(out)}: after 7 kills, old bundle {seen['a']} times, new bundle {seen['b']} times")
        if seen["a"] == 0:
            sys.exit("no kill landed before the rename: the test did not exercise a killed build")
print("ok")
