#!/usr/bin/env python3
"""CLI golden tests: runs the built `decodepack` on each case of cases.json and checks its exit code,
its stdout against a golden file, and fragments of its stderr.

usage: run_cli.py DECODEPACK CASE_NAME      (one case; ctest registers one test per case)
       run_cli.py DECODEPACK --list         (case names)
Set UPDATE_GOLDEN=1 to rewrite golden files from the current output (then review the diff).

In a case, "{tmp}" is a fresh temporary directory and "{tests}" this tests/ directory. A case's
"setup" is a list of argument lists run first (each must exit 0); "pysetup" names a function of
broken_checkpoints.py that writes a broken checkpoint to {tmp}/ck. A case's "env" adds environment
variables (values expanded like arguments) for its main command.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


def expand(arg, tmp):
    return arg.replace("{tmp}", tmp).replace("{tests}", TESTS)


def run_case(exe, case):
    with tempfile.TemporaryDirectory(prefix="dp-cli-") as tmp:
        env = dict(os.environ, LC_ALL="C")
        if case.get("pysetup"):
            sys.path.insert(0, HERE)
            import broken_checkpoints
            getattr(broken_checkpoints, case["pysetup"])(os.path.join(tmp, "ck"))
        for setup in case.get("setup", []):
            r = subprocess.run([exe] + [expand(a, tmp) for a in setup], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                print(f"setup {setup} exited {r.returncode}:\n{r.stderr}")
                return False
        args = [expand(a, tmp) for a in case["args"]]
        env.update({k: expand(v, tmp) for k, v in case.get("env", {}).items()})
        r = subprocess.run([exe] + args, capture_output=True, text=True, env=env, timeout=300)
        ok = True
        if r.returncode != case.get("exit", 0):
            print(f"exit code {r.returncode}, expected {case.get('exit', 0)}\nstderr:\n{r.stderr}")
            ok = False
        if r.returncode < 0 or "Sanitizer" in r.stderr:
            print(f"crashed: {r.returncode}\n{r.stderr}")
            ok = False
        for frag in case.get("stderr_contains", []):
            if expand(frag, tmp) not in r.stderr:
                print(f"stderr lacks {frag!r}:\n{r.stderr}")
                ok = False
        for frag in case.get("stdout_contains", []):
            if expand(frag, tmp) not in r.stdout:
                print(f"stdout lacks {frag!r}:\n{r.stdout[:2000]}")
                ok = False
        golden = case.get("golden")
        if golden:
            path = os.path.join(HERE, "golden", golden)
            if os.environ.get("UPDATE_GOLDEN"):
                with open(path, "w") as f:
                    f.write(r.stdout)
            else:
                with open(path) as f:
                    want = f.read()
                if want != r.stdout:
                    import difflib
                    diff = difflib.unified_diff(want.splitlines(), r.stdout.splitlines(), "golden", "actual",
                                                lineterm="", n=2)
                    print(f"stdout differs from golden/{golden}:")
                    print("\n".join(list(diff)[:80]))
                    ok = False
        return ok


def main():
    exe = sys.argv[1]
    with open(os.path.join(HERE, "cases.json")) as f:
        cases = json.load(f)
    if sys.argv[2] == "--list":
        print(";".join(c["name"] for c in cases))
        return 0
    case = next((c for c in cases if c["name"] == sys.argv[2]), None)
    if case is None:
        print(f"no case {sys.argv[2]}")
        return 2
    return 0 if run_case(exe, case) else 1


if __name__ == "__main__":
    sys.exit(main())
