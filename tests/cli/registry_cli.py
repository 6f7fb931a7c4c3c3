#!/usr/bin/env python3
"""push / pull through the CLI against a real registry server (Debian's docker-registry) on loopback.

usage: registry_cli.py DECODEPACK
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

exe = sys.argv[1]
server = shutil.which("docker-registry") or "/usr/bin/docker-registry"
if not os.path.exists(server):
    sys.exit("docker-registry is not installed (Debian package docker-registry; ./dev.sh installs it)")


def run(*args, expect=0):
    r = subprocess.run([exe, *args], capture_output=True, text=True)
    if r.returncode != expect:
        sys.exit(f"{args}: exit {r.returncode}, expected {expect}\n{r.stdout}{r.stderr}")
    return r


with tempfile.TemporaryDirectory(prefix="dp-reg-") as tmp:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with open(os.path.join(tmp, "config.yml"), "w") as f:
        f.write(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp}/data\n"
                f"http:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen([server, "serve", os.path.join(tmp, "config.yml")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
                break
            except Exception:
                time.sleep(0.1)
        else:
            sys.exit("registry did not start")
        host = f"127.0.0.1:{port}"
        run("synth", "--preset", "kimi-linear-tiny", "-o", f"{tmp}/m")
        with open(f"{tmp}/d.json", "w") as f:
            json.dump({"targets": ["sm_90a"], "tensor_parallel": 1, "widths": [1, 2], "num_speculative_tokens": 0,
                       "kv_cache": {"dtype": "bf16", "block_size": 64}}, f)
        run("build", "--model", f"{tmp}/m", "--deploy", f"{tmp}/d.json", "-o", f"{tmp}/a.dpk", "--cache-dir", f"{tmp}/c")
        first = json.loads(run("push", f"{tmp}/a.dpk", f"{host}/kimi/tiny:v1", "--json").stdout)
        assert first["uploaded_blobs"] == 2, first
        again = json.loads(run("push", f"{tmp}/a.dpk", f"{host}/kimi/tiny:v2", "--json").stdout)
        assert again["uploaded_blobs"] == 0 and again["skipped_blobs"] == 2, again
        pulled = json.loads(run("pull", f"{host}/kimi/tiny:v1", "-o", f"{tmp}/b.dpk", "--json").stdout)
        with open(f"{tmp}/a.dpk", "rb") as a, open(f"{tmp}/b.dpk", "rb") as b:
            assert a.read() == b.read(), "pulled bundle differs from the pushed one"
        assert pulled["bundle_digest"] == first["bundle_digest"], pulled
        run("pull", f"{host}/kimi/tiny@{first['manifest_digest']}", "-o", f"{tmp}/c.dpk")
        run("verify", f"{tmp}/c.dpk", "--digest", first["bundle_digest"])
        r = run("pull", f"{host}/kimi/tiny:missing", "-o", f"{tmp}/x.dpk", expect=6)
        assert "missing" in r.stderr and "404" in r.stderr, r.stderr
        assert not os.path.exists(f"{tmp}/x.dpk")
        print("ok: push, push again (blobs skipped), pull by tag and by digest, byte-identical, missing tag refused")
    finally:
        proc.terminate()
        proc.wait()
