#!/usr/bin/env python3
"""Progress on stderr (common/progress.h): off a terminal a long step writes a plain line per 10% and one
at its end, each with a percentage, never one line per kernel; on a terminal one line redrawn in place
with the elapsed time and an ETA.

usage: progress_cli.py DECODEPACK CACHE_DIR   (CACHE_DIR: a compile cache kept between runs)
"""
import json
import os
import pty
import re
import subprocess
import sys
import tempfile

exe, cache = sys.argv[1], sys.argv[2]
failures = []
STEP = re.compile(r"^(compiling kernels|fingerprinting weight shards \(\d+ threads\)): (\d+)% \((\d+)/(\d+)\)")


def check(cond, msg):
    if not cond:
        failures.append(msg)


def run(*args):
    r = subprocess.run([exe, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{args}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def steps(stderr):
    """{step: [(percent, done, total), ...]} of the progress lines in `stderr`."""
    out = {}
    for line in stderr.splitlines():
        m = STEP.match(line)
        if m:
            out.setdefault(m.group(1), []).append((int(m.group(2)), int(m.group(3)), int(m.group(4))))
    return out


def check_step(label, lines, min_total):
    check(lines, f"{label}: no progress lines")
    if not lines:
        return
    check(len(lines) <= 11, f"{label}: {len(lines)} lines, at most 11 (one per 10% and the end)")
    pct, done, total = lines[-1]
    check(pct == 100 and done == total >= min_total, f"{label}: last line {lines[-1]}, want 100% of >= {min_total}")
    check([p for p, _, _ in lines] == sorted(p for p, _, _ in lines), f"{label}: percentages go back: {lines}")


with tempfile.TemporaryDirectory(prefix="dp-progress-") as tmp:
    # A default build (today's largest step: ~200 kernels) with stderr a pipe.
    r = run("build", "--model", "kimi-linear-tiny", "-o", f"{tmp}/a", "--cache-dir", cache, "-j", "2")
    lines = r.stderr.splitlines()
    check(len(lines) <= 15, f"default build: {len(lines)} stderr lines, want at most 15:\n{r.stderr}")
    check("\r" not in r.stderr and "\033" not in r.stderr, f"terminal control characters off a terminal: {r.stderr!r}")
    s = steps(r.stderr)
    check_step("default build, compiling kernels", s.get("compiling kernels"), 100)
    check(all("%" in l for l in lines if l.startswith("compiling kernels")), f"a progress line without a percentage")

    # With weights: fingerprinting is a step of its own (build, and verify --model).
    run("synth", "--preset", "kimi-linear-tiny", "-o", f"{tmp}/m")
    with open(f"{tmp}/d.json", "w") as f:
        json.dump({"targets": ["sm_90a"], "widths": [1]}, f)
    r = run("build", "--model", f"{tmp}/m", "--deploy", f"{tmp}/d.json", "-o", f"{tmp}/b", "--cache-dir", cache,
            "-j", "2")
    fp = [v for k, v in steps(r.stderr).items() if k.startswith("fingerprinting")]
    check(len(fp) == 1, f"build with weights: no fingerprinting progress:\n{r.stderr}")
    if fp:
        check_step("build, fingerprinting", fp[0], 100)
    r = run("verify", f"{tmp}/b", "--model", f"{tmp}/m", "-j", "2")
    fp = [v for k, v in steps(r.stderr).items() if k.startswith("fingerprinting")]
    check(len(fp) == 1, f"verify --model: no fingerprinting progress:\n{r.stderr}")
    if fp:
        check_step("verify, fingerprinting", fp[0], 100)

    # On a terminal: one line redrawn in place (carriage return, erase line) with elapsed time and ETA,
    # closed by the final line.
    master, slave = pty.openpty()
    p = subprocess.Popen([exe, "build", "--model", "kimi-linear-tiny", "-o", f"{tmp}/t", "--cache-dir", cache,
                          "-j", "2"], stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    check(p.wait() == 0, "build on a terminal failed")
    tty = b"".join(chunks).decode("utf-8", "replace")
    check("\r\033[2Kcompiling kernels: " in tty, f"no redrawn line on a terminal: {tty[:400]!r}")
    check("ETA " in tty, f"no ETA on a terminal: {tty[:400]!r}")
    check(re.search(r"compiling kernels: 100% \((\d+)/\1\) in ", tty), f"no final line on a terminal: {tty[-400:]!r}")

if failures:
    for f in failures:
        print("FAIL:", f)
    sys.exit(1)
print("ok: progress lines per 10% off a terminal, one redrawn line on it")
