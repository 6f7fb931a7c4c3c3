#!/usr/bin/env python3
"""`decodepack doctor`: a report that exits 0 whatever is missing, as text or one JSON object.

The toolchains and devices differ between machines, so this checks the report's shape and what the
test controls: no GPU driver (DECODEPACK_CUDA_LIBRARY / DECODEPACK_HIP_LIBRARY pointing at nothing),
a missing clang (--hip-clang), a compile cache with known files (--cache-dir).

usage: doctor_cli.py DECODEPACK
"""
import json
import os
import subprocess
import sys
import tempfile

TARGETS = {"sm_90a", "gfx942"}  # at least the default deploy's


def run(exe, args, env):
    return subprocess.run([exe, "doctor"] + args, capture_output=True, text=True, env=env, timeout=120)


def main():
    exe = sys.argv[1]
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="dp-doctor-") as tmp:
        env = dict(os.environ, LC_ALL="C", DECODEPACK_CUDA_LIBRARY=os.path.join(tmp, "no-libcuda.so.1"),
                   DECODEPACK_HIP_LIBRARY=os.path.join(tmp, "no-libamdhip64.so"))
        cache = os.path.join(tmp, "cache")
        os.makedirs(os.path.join(cache, "v1", "ab"))
        for name, size in (("ab01", 100), ("ab02", 23)):
            with open(os.path.join(cache, "v1", "ab", name), "wb") as f:
                f.write(b"x" * size)

        # JSON: one object with every key, whatever this machine has.
        r = run(exe, ["--json", "--cache-dir", cache], env)
        check(r.returncode == 0, f"--json exit {r.returncode}, expected 0:\n{r.stderr}")
        rep = json.loads(r.stdout)
        check(set(rep) == {"schema_version", "decodepack", "toolchains", "drivers", "targets", "cache"}, f"top-level keys {sorted(rep)}")
        for vendor in ("nvidia", "amd"):
            t = rep["toolchains"][vendor]
            check({"found", "version", "location", "error", "targets"} <= set(t), f"toolchains.{vendor} keys {sorted(t)}")
            check(t["found"] == (t["error"] is None), f"toolchains.{vendor}: found and error disagree: {t}")
            check(not t["found"] or t["version"], f"toolchains.{vendor}: found without a version: {t}")
        for api in ("cuda", "hip"):
            d = rep["drivers"][api]
            check(d["loaded"] is False and d["devices"] == [], f"drivers.{api} with no library: {d}")
            check("cannot load" in (d["error"] or ""), f"drivers.{api}.error names no missing library: {d}")
        names = [t["name"] for t in rep["targets"]]
        check(TARGETS <= set(names) and len(names) == len(set(names)), f"targets {names}")
        for t in rep["targets"]:
            check({"name", "vendor", "gpus", "build", "build_error", "run", "run_devices", "run_error"} <= set(t),
                  f"target keys {sorted(t)}")
            check(t["build"] == (t["build_error"] is None), f"target {t['name']}: build and build_error disagree")
            check(t["run"] is False and t["run_devices"] == [] and "driver" in t["run_error"],
                  f"target {t['name']} runs without a driver: {t}")
            tc = rep["toolchains"]["nvidia" if t["name"].startswith("sm_") else "amd"]
            check(tc["found"] or not t["build"], f"target {t['name']} builds without a toolchain")
        check(rep["cache"] == {"dir": cache, "exists": True, "entries": 2, "bytes": 123, "error": None},
              f"cache {rep['cache']}")

        # No clang: gfx targets cannot be built, and the report still exits 0.
        r = run(exe, ["--json", "--hip-clang", os.path.join(tmp, "no-clang++"), "--cache-dir",
                      os.path.join(tmp, "none")], env)
        check(r.returncode == 0, f"--hip-clang missing: exit {r.returncode}, expected 0:\n{r.stderr}")
        rep = json.loads(r.stdout)
        amd = rep["toolchains"]["amd"]
        check(amd["found"] is False and "no-clang++" in amd["error"], f"toolchains.amd with a missing clang: {amd}")
        for t in rep["targets"]:
            if t["name"].startswith("gfx"):
                check(t["build"] is False and t["build_error"], f"target {t['name']} builds without clang: {t}")
        check(rep["cache"]["exists"] is False and rep["cache"]["entries"] == 0, f"missing cache: {rep['cache']}")

        # Text: the same sections.
        r = run(exe, ["--cache-dir", cache], env)
        check(r.returncode == 0, f"text exit {r.returncode}, expected 0:\n{r.stderr}")
        for frag in ("Toolchains\n", "Drivers and devices\n", "  cuda             no driver: ", "Targets          build  run\n",
                     "  sm_90a ", "  gfx942 ", "no CUDA driver", "Kernel cache\n", f"  {cache}: 2 entries, 123 bytes\n"):
            check(frag in r.stdout, f"text output lacks {frag!r}:\n{r.stdout}")

    for f in failures:
        print("FAIL:", f)
    print(f"{'FAIL' if failures else 'ok'}: doctor")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
