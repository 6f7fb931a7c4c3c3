#!/usr/bin/env python3
"""`build` and `synth` never delete what decodepack did not write.

An existing output is replaced only when it is decodepack's own (a bundle; a checkpoint with synth's
marker); anything else is refused with exit 2 naming the path, what is there and --force, and even with
--force only decodepack's own files are removed. An output over the input is refused even with --force.
A write error names the path and the system's reason (the file size limit stands in for a full disk).

usage: output_safety.py DECODEPACK
"""
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile

exe = sys.argv[1]


def run(*args, expect=0, limit_bytes=None, cwd=None):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write(2) fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))
    r = subprocess.run([exe, *args], capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"),
                       preexec_fn=limit if limit_bytes else None, cwd=cwd)
    if r.returncode != expect:
        sys.exit(f"{args}: exit {r.returncode}, expected {expect}\n{r.stdout}{r.stderr}")
    if r.returncode < 0 or "Sanitizer" in r.stderr:
        sys.exit(f"{args}: crashed\n{r.stderr}")
    return r


def expect_in(text, *fragments):
    for f in fragments:
        if f not in text:
            sys.exit(f"message lacks {f!r}:\n{text}")


def tree(path):
    """relative path -> sha256 of every file under path (or of path itself)."""
    if os.path.isfile(path):
        return {"": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    out = {}
    for root, dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, path)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def hidden(dirpath):
    return sorted(n for n in os.listdir(dirpath) if n.startswith(".") and (".staging-" in n or ".tmp-" in n))


with tempfile.TemporaryDirectory(prefix="dp-out-") as tmp:
    ck = f"{tmp}/ck"
    cache = ["--cache-dir", f"{tmp}/cache"]
    deploy = f"{tmp}/deploy.json"
    with open(deploy, "w") as f:
        json.dump({"targets": ["gfx942"], "tensor_parallel": 1, "widths": [1], "num_speculative_tokens": 0,
                   "kv_cache": {"dtype": "bf16", "block_size": 64}}, f)
    run("synth", "--preset", "kimi-linear-tiny", "-o", ck)
    ck_files = tree(ck)
    assert ".decodepack-synth.json" in ck_files, sorted(ck_files)

    # 1. build into the checkpoint, inside it, or around it: refused, with or without --force.
    for out, what in ((ck, "is the input model"), (f"{ck}/", "is the input model"), (f"{ck}/b.dpk", "lies inside"),
                      (f"{ck}/sub", "lies inside"), (tmp, "contains the input model")):
        for force in ([], ["--force"]):
            r = run("build", "--model", ck, "--deploy", deploy, "-o", out, *cache, *force, expect=2)
            expect_in(r.stderr, out, what)
    assert tree(ck) == ck_files, "the checkpoint was changed"
    print("ok: build -o over, inside or around the input checkpoint is refused, even with --force")

    # 2. build into a folder of someone else's files: refused; --force keeps them.
    user = f"{tmp}/user"
    os.makedirs(f"{user}/photos")
    for name in ("notes.txt", "photos/cat.jpg"):
        with open(f"{user}/{name}", "w") as f:
            f.write(f"the user's {name}")
    before = tree(user)
    r = run("build", "--model", ck, "--deploy", deploy, "-o", user, *cache, expect=2)
    expect_in(r.stderr, user, "refusing to overwrite", "notes.txt", "photos/", "--force")
    assert tree(user) == before
    r = run("build", "--model", ck, "--deploy", deploy, "-o", user, *cache, "--force")
    after = tree(user)
    for name, digest in before.items():
        assert after.get(name) == digest, f"--force removed or changed {name}"
    assert "manifest.json" in after
    print("ok: build -o DIR with other files is refused (exit 2); with --force they are kept")

    # 3. A bundle directory or archive that build wrote is replaced, not refused.
    for out in (f"{tmp}/bundle", f"{tmp}/bundle.dpk"):
        run("build", "--model", ck, "--deploy", deploy, "-o", out, *cache)
        run("build", "--model", ck, "--deploy", deploy, "-o", out, *cache)
        run("verify", out)
    # A foreign file where the archive goes: refused; replaced only with --force. A directory: never.
    junk = f"{tmp}/junk.dpk"
    with open(junk, "wb") as f:
        f.write(os.urandom(10240))
    r = run("build", "--model", ck, "--deploy", deploy, "-o", junk, *cache, expect=2)
    expect_in(r.stderr, junk, "a file of 10240 bytes", "--force")
    assert os.path.getsize(junk) == 10240
    run("build", "--model", ck, "--deploy", deploy, "-o", junk, *cache, "--force")
    run("verify", junk)
    os.makedirs(f"{tmp}/dir.dpk")
    r = run("build", "--model", ck, "--deploy", deploy, "-o", f"{tmp}/dir.dpk", *cache, "--force", expect=2)
    expect_in(r.stderr, "is a directory")
    r = run("build", "--model", ck, "--deploy", deploy, "-o", f"{tmp}/c", "--cache-dir", f"{tmp}/c/cache", expect=2)
    expect_in(r.stderr, "overlap")
    print("ok: own bundles are replaced; a foreign .dpk only with --force; a directory never by an archive")

    # 4. synth: its own checkpoint is replaced; a folder of other files is refused, and kept with --force.
    run("synth", "--preset", "kimi-linear-tiny", "-o", ck, "--seed", "1")
    ck1 = tree(ck)
    assert ck1 != ck_files and set(ck1) == set(ck_files)
    before = tree(user)
    r = run("synth", "--preset", "kimi-linear-tiny", "-o", user, expect=2)
    expect_in(r.stderr, user, "not part of a checkpoint decodepack wrote", "notes.txt", "--force")
    assert tree(user) == before
    run("synth", "--preset", "kimi-linear-tiny", "-o", user, "--force")
    after = tree(user)
    assert all(after.get(n) == d for n, d in before.items()), "synth --force removed or changed files"
    assert "config.json" in after and ".decodepack-synth.json" in after
    # The HF fixture checkpoint has no marker: synth never replaces such a directory.
    hf = f"{tmp}/hf"
    os.makedirs(hf)
    with open(f"{hf}/config.json", "w") as f:
        f.write("{}")
    r = run("synth", "--preset", "kimi-linear-tiny", "-o", hf, expect=2)
    expect_in(r.stderr, "config.json")
    with open(f"{tmp}/cfg.json", "w") as f:
        f.write(open(f"{ck}/config.json").read())
    r = run("synth", "--preset", f"{tmp}/cfg.json", "-o", f"{tmp}/cfg.json", "--force", expect=2)
    expect_in(r.stderr, "is the input config")
    # A directory named like the preset is not the preset: synth into it again replaces it.
    run("synth", "--preset", "kimi-linear-tiny", "-o", "kimi-linear-tiny", cwd=tmp)
    run("synth", "--preset", "kimi-linear-tiny", "-o", "kimi-linear-tiny", "--seed", "3", cwd=tmp)
    print("ok: synth replaces its own checkpoint, refuses other folders (exit 2), keeps their files with --force")

    # 5. A write error names the path and the system's reason, and leaves the previous output.
    r = run("synth", "--preset", "kimi-linear-tiny", "-o", ck, expect=4, limit_bytes=64 << 10)
    expect_in(r.stderr, "model-00001-of-", "File too large")
    assert tree(ck) == ck1, "a failed synth changed the previous checkpoint"
    before = tree(f"{tmp}/bundle.dpk")
    r = run("build", "--model", ck, "--deploy", deploy, "-o", f"{tmp}/bundle.dpk", *cache, expect=4,
            limit_bytes=os.path.getsize(f"{tmp}/bundle.dpk") // 2)
    expect_in(r.stderr, f"{tmp}/bundle.dpk", "File too large")
    assert tree(f"{tmp}/bundle.dpk") == before
    assert not hidden(tmp), hidden(tmp)
    print("ok: a write error (EFBIG) names the path and 'File too large', exit 4, previous output intact")
print("ok")
