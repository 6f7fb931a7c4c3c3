#!/usr/bin/env python3
"""push / pull through the CLI against a real registry server (Debian's docker-registry) on loopback.

usage: registry_cli.py DECODEPACK
"""
import hashlib
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


def run(*args, expect=0, env=None):
    r = subprocess.run([exe, *args], capture_output=True, text=True, env=env)
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
        assert pulled["digest"] == first["digest"], pulled
        run("pull", f"{host}/kimi/tiny@{first['manifest_digest']}", "-o", f"{tmp}/c.dpk")
        run("verify", f"{tmp}/c.dpk", "--digest", first["digest"])
        r = run("pull", f"{host}/kimi/tiny:missing", "-o", f"{tmp}/x.dpk", expect=6)
        assert "missing" in r.stderr and "404" in r.stderr, r.stderr
        assert not os.path.exists(f"{tmp}/x.dpk")
        # Progress goes to stderr as plain lines (stderr is a pipe here); --json stdout stays one object.
        pushed = run("push", f"{tmp}/a.dpk", f"{host}/kimi/progress:v1", "--json")
        json.loads(pushed.stdout)
        assert "upload layer sha256:" in pushed.stderr and "100% (" in pushed.stderr and "/s" in pushed.stderr, pushed.stderr
        pulled = run("pull", f"{host}/kimi/tiny:v1", "-o", f"{tmp}/p.dpk", "--json", "--force")
        json.loads(pulled.stdout)
        assert "download layer sha256:" in pulled.stderr and "100% (" in pulled.stderr and "/s" in pulled.stderr, pulled.stderr
        assert "\r" not in pulled.stderr and "\033" not in pulled.stderr, repr(pulled.stderr)
        quiet = run("pull", f"{host}/kimi/tiny:v1", "-o", f"{tmp}/p.dpk", "--no-progress")
        assert "download layer" not in quiet.stderr, quiet.stderr

        # A bundle directory is packed (the same bytes as build -o X.dpk) and pushed; standard OCI
        # annotations, `created` from SOURCE_DATE_EPOCH, so pushes are reproducible.
        run("build", "--model", f"{tmp}/m", "--deploy", f"{tmp}/d.json", "-o", f"{tmp}/dir", "--cache-dir", f"{tmp}/c")
        env = dict(os.environ, SOURCE_DATE_EPOCH="1764583200")
        d1 = json.loads(run("push", f"{tmp}/dir", f"{host}/kimi/tiny:dir-v1", "--json", "--image-version", "1.0",
                            "--source", "https://example.com/kimi", env=env).stdout)
        assert d1["digest"] == first["digest"], d1
        assert d1["skipped_blobs"] == 2, d1  # the packed layer is the .dpk already pushed
        d2 = json.loads(run("push", f"{tmp}/dir", f"{host}/kimi/tiny:dir-v2", "--json", "--image-version", "1.0",
                            "--source", "https://example.com/kimi", env=env).stdout)
        assert d2["manifest_digest"] == d1["manifest_digest"], (d1, d2)
        req = urllib.request.Request(f"http://{host}/v2/kimi/tiny/manifests/dir-v1",
                                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
        ann = json.loads(urllib.request.urlopen(req).read())["annotations"]
        assert ann["org.opencontainers.image.created"] == "2025-12-01T10:00:00Z", ann
        assert ann["org.opencontainers.image.title"] == "dir.dpk", ann
        assert ann["org.opencontainers.image.version"] == "1.0", ann
        assert ann["org.opencontainers.image.source"] == "https://example.com/kimi", ann
        run("pack", f"{tmp}/dir", "-o", f"{tmp}/packed.dpk")
        with open(f"{tmp}/a.dpk", "rb") as a, open(f"{tmp}/packed.dpk", "rb") as b:
            assert a.read() == b.read(), "pack of the directory differs from build -o X.dpk"
        with open(f"{tmp}/dir/extra.txt", "w") as f:
            f.write("not in the manifest")
        r = run("push", f"{tmp}/dir", f"{host}/kimi/tiny:dir-v3", expect=5)
        assert "extra.txt" in r.stderr and "not packed" in r.stderr, r.stderr

        # What `oras push` writes (see README), made with plain HTTP calls: upload both blobs, then a
        # manifest with no artifactType (the config's mediaType stands for it); decodepack pulls it.
        def upload(repo, data):
            post = urllib.request.Request(f"http://{host}/v2/{repo}/blobs/uploads/", method="POST", data=b"")
            loc = urllib.request.urlopen(post).headers["Location"]
            if loc.startswith("/"):
                loc = f"http://{host}{loc}"
            sep = "&" if "?" in loc else "?"
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            put = urllib.request.Request(f"{loc}{sep}digest={digest}", method="PUT", data=data,
                                         headers={"Content-Type": "application/octet-stream"})
            assert urllib.request.urlopen(put).status == 201
            return {"digest": digest, "size": len(data)}
        with open(f"{tmp}/a.dpk", "rb") as f:
            layer = f.read()
        config = subprocess.run(["tar", "-xOf", f"{tmp}/a.dpk", "manifest.json"], capture_output=True, check=True).stdout
        manifest = {
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.decodepack.bundle.config.v1+json", **upload("kimi/oras", config)},
            "layers": [{"mediaType": "application/vnd.decodepack.bundle.layer.v1.tar", **upload("kimi/oras", layer),
                        "annotations": {"org.opencontainers.image.title": "a.dpk"}}],
            "annotations": {"org.opencontainers.image.created": "2026-12-01T10:00:00Z"},
        }
        put = urllib.request.Request(f"http://{host}/v2/kimi/oras/manifests/v1", method="PUT",
                                     data=json.dumps(manifest).encode(),
                                     headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        assert urllib.request.urlopen(put).status == 201
        o = json.loads(run("pull", f"{host}/kimi/oras:v1", "-o", f"{tmp}/oras.dpk", "--json").stdout)
        assert o["digest"] == first["digest"], o
        with open(f"{tmp}/oras.dpk", "rb") as b:
            assert b.read() == layer, "pulled oras-style bundle differs"
        print("ok: push, push again (blobs skipped), pull by tag and by digest, byte-identical, missing tag refused, "
              "progress on stderr, directory push and pack, OCI annotations, oras-style push pulled")
    finally:
        proc.terminate()
        proc.wait()
