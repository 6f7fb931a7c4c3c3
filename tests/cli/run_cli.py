#!/usr/bin/env python3
"""CLI golden tests: runs the built `decodepack` on each case of cases.json and checks its exit code,
its stdout against a golden file, and fragments of its stderr.

usage: run_cli.py DECODEPACK CASE_NAME      (one case; ctest registers one test per case)
       run_cli.py DECODEPACK --list         (case names)
Set UPDATE_GOLDEN=1 to rewrite golden files from the current output (then review the diff).

In a case, "{tmp}" is a fresh temporary directory and "{tests}" this tests/ directory. A case's
"setup" is a list of argument lists run first (each must exit 0); "pysetup" names a function of
broken_checkpoints.py that then writes (or edits what setup wrote at) {tmp}/ck. A case's "env" adds
environment variables (values expanded like arguments) for its main command.

Hostile-input cases may also give: "timeout" (seconds; the command must end by then, default 300),
"max_rss_mb" (the command's peak resident memory must stay below), "stderr_max_bytes" (its stderr
must stay shorter: no input value is echoed whole) and "unprivileged": true (run without the
capabilities that let root read any file, so that a mode-000 directory denies access as it does for
other users).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


def expand(arg, tmp):
    return arg.replace("{tmp}", tmp).replace("{tests}", TESTS)


class Result:
    def __init__(self, returncode, stdout, stderr, max_rss_mb):
        self.returncode, self.stdout, self.stderr, self.max_rss_mb = returncode, stdout, stderr, max_rss_mb


def run_main(cmd, env, timeout):
    """Runs the case's command with its output in files; returns a Result, or None after a timeout.
    os.wait4 gives this one child's peak RSS (not the setup commands')."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                os.wait4(p.pid, 0)
                return None
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Result(p.returncode, out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace"),
                      usage.ru_maxrss / 1024)


def restore_permissions(tmp):
    # A case may leave a mode-000 directory; make everything removable again.
    for root, dirs, _ in os.walk(tmp):
        for d in dirs:
            path = os.path.join(root, d)
            if not os.path.islink(path):
                os.chmod(path, 0o755)


def run_case(exe, case):
    with tempfile.TemporaryDirectory(prefix="dp-cli-") as tmp:
        try:
            return check_case(exe, case, tmp)
        finally:
            os.chmod(tmp, 0o755)
            restore_permissions(tmp)


def check_case(exe, case, tmp):
    env = dict(os.environ, LC_ALL="C")
    for setup in case.get("setup", []):
        r = subprocess.run([exe] + [expand(a, tmp) for a in setup], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            print(f"setup {setup} exited {r.returncode}:\n{r.stderr}")
            return False
    if case.get("pysetup"):
        sys.path.insert(0, HERE)
        import broken_checkpoints
        getattr(broken_checkpoints, case["pysetup"])(os.path.join(tmp, "ck"))
    args = [expand(a, tmp) for a in case["args"]]
    env.update({k: expand(v, tmp) for k, v in case.get("env", {}).items()})
    cmd = [exe] + args
    if case.get("unprivileged") and os.geteuid() == 0:
        # root reads any file through CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH; drop them for the command.
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] + cmd
    timeout = case.get("timeout", 300)
    r = run_main(cmd, env, timeout)
    if r is None:
        print(f"still running after {timeout} s (killed): a hang")
        return False
    ok = True
    if "max_rss_mb" in case and r.max_rss_mb >= case["max_rss_mb"]:
        print(f"peak resident memory {r.max_rss_mb:.0f} MB, expected below {case['max_rss_mb']} MB")
        ok = False
    if "stderr_max_bytes" in case and len(r.stderr) >= case["stderr_max_bytes"]:
        print(f"stderr is {len(r.stderr)} bytes, expected below {case['stderr_max_bytes']}: "
              f"{r.stderr[:1000]!r}...")
        ok = False
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
