#!/usr/bin/env python3
"""A build killed at any moment leaves the previous bundle or none, never half of one, and the next build
removes what the killed one left behind (but never what a live build is working on).

usage: kill_build.py DECODEPACK

Builds bundle A (archive and directory), then repeatedly starts a build of a different bundle B to the
same paths and SIGKILLs it after a growing delay. After every kill the output path must hold exactly A
or exactly B (`decodepack verify` passes and the digest is A's or B's), and after the next build no
staging entry of a killed build is left beside it. Then a build of B is stopped (SIGSTOP) while it
stages, a build of A runs to the same path, and B's staging entries must survive it: once continued, B
completes and publishes.
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


def staging(out):
    """Staging entries beside `out` (hidden names that start with the output's name)."""
    d, name = os.path.split(out)
    return sorted(n for n in os.listdir(d) if n.startswith(f".{name}."))


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
        left = 0
        for delay in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0, 4.0):
            p = subprocess.Popen([exe, "build", "--model", model, "--deploy", deploy_b, "-o", out, "--no-cache", "-j", "1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)
            p.wait()
            left += bool(staging(out))
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
        # Kills while the build stages its output (its staging entries exist): those entries stay behind.
        # B's kernels come from a warm cache, so that the build reaches its staging step at once.
        cache = os.path.join(tmp, "cache")
        run("build", "--model", model, "--deploy", deploy_b, "-o", os.path.join(tmp, "warm.dpk"), "--cache-dir", cache)
        build_b = [exe, "build", "--model", model, "--deploy", deploy_b, "-o", out, "--cache-dir", cache, "-j", "1"]
        for extra in (0.0, 0.02, 0.1):
            p = subprocess.Popen(build_b, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 120
            while not staging(out) and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(extra)
            p.send_signal(signal.SIGKILL)
            p.wait()
            left += bool(staging(out))
            if digest(out) not in (a, b) and b is not None:
                sys.exit(f"{out}: neither the old nor the new bundle after a kill while staging")
        # The next build removes the killed builds' staging entries.
        run("build", "--model", model, "--deploy", deploy_a, "-o", out, "--cache-dir", os.path.join(tmp, "cache"))
        if staging(out):
            sys.exit(f"{out}: killed builds' staging entries survived the next build: {staging(out)}")
        print(f"{os.path.basename(out)}: {left} kills left staging entries; the next build removed them all")
        if left == 0:
            sys.exit("no kill left a staging entry: the test did not exercise the cleanup")

        # A live (stopped) build's staging entries are not touched by another build of the same output.
        p = subprocess.Popen(build_b, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not staging(out) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        p.send_signal(signal.SIGSTOP)
        live = staging(out)
        if not live:
            sys.exit("the build of B created no staging entry")
        run("build", "--model", model, "--deploy", deploy_a, "-o", out, "--cache-dir", os.path.join(tmp, "cache"))
        missing = [n for n in live if n not in staging(out)]
        p.send_signal(signal.SIGCONT)
        _, err = p.communicate()
        if missing:
            sys.exit(f"a build removed the staging entries {missing} of a live build")
        if p.returncode != 0:
            sys.exit(f"the stopped build failed after it was continued ({p.returncode}):\n{err}")
        if digest(out) == a or (b is not None and digest(out) != b):
            sys.exit(f"{out}: the continued build did not publish B")
        print(f"{os.path.basename(out)}: a stopped build's staging entries ({len(live)}) survived another build; "
              "continued, it published B")
print("ok")
