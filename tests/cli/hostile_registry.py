#!/usr/bin/env python3
"""`decodepack pull` against a hostile registry: a small HTTP server on loopback (standard library only)
that serves real bundles, and, per repository, misbehaves in one way: answers 5xx, resets connections,
drips a manifest a byte at a time, sends malformed or huge JSON, endless headers, bogus WWW-Authenticate
challenges and token replies, or a layer that is not the bundle its manifest describes.

Every case checks the exit code, a fragment of the message, that nothing crashed, and that an existing
output file is left exactly as it was when the pull fails. Deadlines are small (--timeout), so the whole
run takes seconds beyond the two builds.

usage: hostile_registry.py DECODEPACK
"""
import hashlib
import http.server
import io
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

exe = sys.argv[1]
OCI = "application/vnd.oci.image.manifest.v1+json"


# No credentials of the developer's reach the hostile server.
env = {k: v for k, v in os.environ.items() if not k.startswith("DECODEPACK_REGISTRY_")}
env["LC_ALL"] = "C"


def run(*args, expect=0, timeout=120):
    t0 = time.monotonic()
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=env)
    r.seconds = time.monotonic() - t0
    if r.returncode != expect:
        sys.exit(f"{args}: exit {r.returncode}, expected {expect}\n{r.stdout}{r.stderr}")
    if "Sanitizer" in r.stderr or "type must be" in r.stderr or "terminate called" in r.stderr:
        sys.exit(f"{args}: crashed or leaked a library exception:\n{r.stderr}")
    return r


def expect_in(text, *fragments):
    for f in fragments:
        if f not in text:
            sys.exit(f"message lacks {f!r}:\n{text}")
    return text


def digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def manifest_for(config, layer, **extra):
    m = {"schemaVersion": 2, "mediaType": OCI, "artifactType": "application/vnd.decodepack.bundle.v1",
         "config": {"mediaType": "application/vnd.decodepack.bundle.config.v1+json", "digest": digest(config),
                    "size": len(config)},
         "layers": [{"mediaType": "application/vnd.decodepack.bundle.layer.v1.tar", "digest": digest(layer),
                     "size": len(layer)}]}
    m.update(extra)
    return json.dumps(m, sort_keys=True, separators=(",", ":")).encode()


class Registry(http.server.ThreadingHTTPServer):
    """repos: name -> dict(manifest=bytes, and optional misbehaviour); blobs: digest -> bytes."""
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos, self.blobs, self.hits = {}, {}, {}
        self.lock = threading.Lock()

    def handle_error(self, request, client_address):
        pass  # resets and abandoned connections are the point


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass

    def count(self, key):
        with self.server.lock:
            self.server.hits[key] = self.server.hits.get(key, 0) + 1
            return self.server.hits[key]

    def send(self, status, body=b"", headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def reset(self):
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/v2/":
            return self.send(200, b"{}")
        if path.startswith("/token"):
            return self.token(path)
        parts = path.split("/")  # "", "v2", repo, "manifests"|"blobs", ref
        if len(parts) != 5 or parts[2] not in self.server.repos:
            return self.send(404, b'{"errors":[{"code":"NAME_UNKNOWN","message":"no such repository"}]}')
        repo, kind, ref = self.server.repos[parts[2]], parts[3], parts[4]
        if kind == "manifests":
            return self.manifest(repo, self.count((parts[2], kind)))
        return self.blob(repo, ref, self.count((parts[2], "layer" if ref == repo.get("layer") else "config")))

    def manifest(self, repo, n):
        how = repo.get("how", "ok")
        body = repo["manifest"]
        if how == "status" and (repo["times"] < 0 or n <= repo["times"]):
            return self.send(repo["status"], repo.get("error", b'{"errors":[{"code":"UNAVAILABLE"}]}'))
        if how == "reset" and n <= repo["times"]:
            return self.reset()
        if how == "drip":
            self.send_response(200)
            self.send_header("Content-Type", OCI)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for i in range(len(body)):
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                pass
            return
        if how == "headers":
            self.send_response(200)
            try:
                for i in range(200000):
                    self.send_header(f"X-Padding-{i}", "x" * 64)
                    if i % 1000 == 0:
                        self.flush_headers()
                self.end_headers()
            except OSError:
                pass
            self.close_connection = True
            return
        if how == "auth":
            return self.send(401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', [("WWW-Authenticate", repo["challenge"])])
        if how == "raw":
            return self.send(repo["status"], body, [("Content-Type", OCI)])
        return self.send(200, body, [("Content-Type", OCI)])

    def blob(self, repo, ref, n):
        data = self.server.blobs.get(ref)
        if data is None:
            return self.send(404, b'{"errors":[{"code":"BLOB_UNKNOWN"}]}')
        is_layer = ref == repo.get("layer")
        if is_layer and repo.get("blob") == "status" and n <= repo["times"]:
            return self.send(500, b"internal error")
        if is_layer and repo.get("blob") == "cut" and n <= repo["times"]:
            # Half the layer, then the connection is reset.
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            return self.reset()
        return self.send(200, data, [("Content-Type", "application/octet-stream")])

    def token(self, path):
        replies = {"/token-badtype": b'{"token": 5}', "/token-notjson": b"<html>token</html>",
                   "/token-empty": b'{"token": ""}', "/token-ctl": b'{"token": "a\\r\\nX-Injected: 1"}'}
        self.send(200, replies.get(path, b"{}"), [("Content-Type", "application/json")])


def check_intact(path, want, case):
    with open(path, "rb") as f:
        if f.read() != want:
            sys.exit(f"{case}: {path} was changed by a failed pull")
    leftovers = [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".")]
    if leftovers:
        sys.exit(f"{case}: staging files left behind: {leftovers}")


with tempfile.TemporaryDirectory(prefix="dp-hostile-") as tmp:
    os.makedirs(f"{tmp}/docker")
    env["DOCKER_CONFIG"] = f"{tmp}/docker"
    # Two real bundles: A, and B built from another deploy (both valid, different digests).
    run("synth", "--preset", "kimi-linear-tiny", "-o", f"{tmp}/m")
    for name, widths in (("a", [1]), ("b", [1, 2])):
        with open(f"{tmp}/{name}.json", "w") as f:
            json.dump({"targets": ["gfx942"], "tensor_parallel": 1, "widths": widths, "num_speculative_tokens": 0,
                       "kv_cache": {"dtype": "bf16", "block_size": 64}}, f)
        run("build", "--model", f"{tmp}/m", "--deploy", f"{tmp}/{name}.json", "-o", f"{tmp}/{name}.dpk",
            "--cache-dir", f"{tmp}/cache")
    a = open(f"{tmp}/a.dpk", "rb").read()
    b = open(f"{tmp}/b.dpk", "rb").read()
    a_config = tarfile.open(fileobj=io.BytesIO(a)).extractfile("manifest.json").read()
    junk = random.Random(1).randbytes(10 * 1024)

    reg = Registry()
    host = f"127.0.0.1:{reg.server_address[1]}"
    threading.Thread(target=reg.serve_forever, daemon=True).start()
    for blob in (a, b, a_config, junk):
        reg.blobs[digest(blob)] = blob
    good = manifest_for(a_config, a)
    base = dict(manifest=good, layer=digest(a))
    reg.repos.update({
        "ok": base,
        "flaky": dict(base, how="status", status=503, times=2),
        "down": dict(base, how="status", status=503, times=-1),
        "missing": dict(base, how="status", status=404, times=-1,
                        error=b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"no such tag"}]}'),
        "reset": dict(base, how="reset", times=1),
        "cutlayer": dict(base, blob="cut", times=1),
        "layer500": dict(base, blob="status", times=1),
        "drip": dict(base, how="drip"),
        "badtype": dict(base, manifest=manifest_for(a_config, a, mediaType=5)),
        "badsize": dict(base, manifest=good.replace(b'"size":%d' % len(a), b'"size":-1')),
        "baddigest": dict(base, manifest=good.replace(digest(a).encode(), b"sha256:../../etc/passwd")),
        "badann": dict(base, manifest=manifest_for(a_config, a, annotations={"k": ["v"]})),
        "notjson": dict(base, manifest=b"<html>not a manifest</html>"),
        "errcode": dict(base, how="status", status=404, times=-1, error=b'{"errors":[{"code":123}]}'),
        "errdeep": dict(base, how="status", status=400, times=-1, error=b'{"errors":' + b"[" * 5000 + b"]" * 5000 + b"}"),
        "huge": dict(base, manifest=manifest_for(a_config, a, annotations={"pad": "x" * (5 << 20)})),
        "headers": dict(base, how="headers"),
        "auth-unterminated": dict(base, how="auth", challenge='Bearer realm="unterminated'),
        "auth-ftp": dict(base, how="auth", challenge='Bearer realm="ftp://127.0.0.1/token",service="x"'),
        "auth-space": dict(base, how="auth", challenge=f'Bearer realm="http://{host}/token x"'),
        "auth-garbage": dict(base, how="auth", challenge="\x01\x02=\"\"\"==,,,"),
        "auth-badtype": dict(base, how="auth", challenge=f'Bearer realm="http://{host}/token-badtype"'),
        "auth-notjson": dict(base, how="auth", challenge=f'Bearer realm="http://{host}/token-notjson"'),
        "auth-empty": dict(base, how="auth", challenge=f'Bearer realm="http://{host}/token-empty"'),
        "auth-ctl": dict(base, how="auth", challenge=f'Bearer realm="http://{host}/token-ctl"'),
        "notar": dict(base, manifest=manifest_for(a_config, junk), layer=digest(junk)),
        "otherbundle": dict(base, manifest=manifest_for(a_config, b), layer=digest(b)),
    })
    out = f"{tmp}/pulled/good.dpk"
    os.makedirs(os.path.dirname(out))
    fast = ["--timeout", "3", "--retries", "2"]

    def pull(repo, *more, expect=0, timeout=60):
        defaults = fast if "--timeout" not in more else ["--retries", "2"]
        return run("pull", f"{host}/{repo}:v1", "-o", out, *defaults, *more, expect=expect, timeout=timeout)

    pull("ok")
    check_intact(out, a, "ok")
    print("ok: a well-behaved registry serves the bundle byte for byte")

    # Transient failures are retried with backoff; 4xx is not.
    r = pull("flaky")
    expect_in(r.stderr, "HTTP 503; retrying in 0.5 s (attempt 2 of 3)", "retrying in 1.0 s (attempt 3 of 3)")
    assert reg.hits[("flaky", "manifests")] == 3, reg.hits
    r = pull("down", expect=6)
    expect_in(r.stderr, "HTTP 503", "after 3 attempts")
    assert reg.hits[("down", "manifests")] == 3, reg.hits
    r = pull("missing", expect=6)
    expect_in(r.stderr, "HTTP 404", "MANIFEST_UNKNOWN")
    assert reg.hits[("missing", "manifests")] == 1, "a 404 must not be retried"
    for repo in ("reset", "cutlayer", "layer500"):
        r = pull(repo)
        expect_in(f"[{repo}] {r.stderr}", "retrying")
        check_intact(out, a, repo)
    print("ok: 503 twice then success, 503 always (3 attempts), 404 once, reset connection, layer cut mid-way, "
          "layer 500")

    # A registry dripping its manifest is abandoned at the deadline.
    r = pull("drip", "--timeout", "2", expect=6)
    expect_in(r.stderr, "deadline of 2 s", "--timeout", f"http://{host}/v2/drip/manifests/v1")
    assert r.seconds < 15, f"drip took {r.seconds:.1f} s"
    print(f"ok: a manifest dripped at 2 bytes/s is abandoned after {r.seconds:.1f} s (--timeout 2)")

    # Malformed replies are registry errors naming the field and the URL.
    for repo, fragments in (
            ("badtype", ["field mediaType is an integer (5), expected a string"]),
            ("badsize", ["field layers[0].size is an integer (-1), expected a non-negative integer"]),
            ("baddigest", ["layers[0].digest", "not sha256"]),
            ("badann", ["field annotations.k is an array"]),
            ("notjson", ["not valid JSON"]),
            ("errcode", ["HTTP 404, 123"]),
            ("errdeep", ["HTTP 400"]),
            ("huge", ["larger than 4194304 bytes"]),
            ("headers", ["headers are larger than"]),
            ("auth-unterminated", ["HTTP 401"]),
            ("auth-ftp", ["not an https URL"]),
            ("auth-space", ["is not a URL"]),
            ("auth-garbage", ["HTTP 401"]),
            ("auth-badtype", ["field token is an integer (5), expected a string", f"http://{host}/token-badtype"]),
            ("auth-notjson", ["not valid JSON", "token-notjson"]),
            ("auth-empty", ["no \"token\" or \"access_token\" string"]),
            ("auth-ctl", ["control character"])):
        r = pull(repo, expect=6)
        expect_in(r.stderr, *fragments)
        if repo.startswith("bad") or repo == "notjson":
            expect_in(r.stderr, f"http://{host}/v2/{repo}/manifests/v1")
        check_intact(out, a, repo)
    print("ok: 17 malformed replies (types, sizes, digests, non-JSON, error codes, huge manifest, endless headers, "
          "bogus challenges and token replies): exit 6 naming the field and URL, output intact")

    # A layer that is not the bundle the manifest describes never replaces the output.
    r = pull("notar", expect=3)
    expect_in(r.stderr, "the layer is not a valid bundle archive", "layer blob " + digest(junk))
    check_intact(out, a, "notar")
    r = pull("otherbundle", expect=5)
    expect_in(r.stderr, "is not the manifest's config blob")
    check_intact(out, a, "otherbundle")
    r = pull("ok", "--digest", "sha256:" + "0" * 64, expect=5)
    expect_in(r.stderr, "expected sha256:" + "0" * 64)
    check_intact(out, a, "--digest")
    print("ok: a 10 KB non-tar layer (exit 3), a valid but different bundle (exit 5) and a wrong --digest (exit 5) "
          "leave the previous file intact")

    # The output must be a bundle (or nothing) unless --force.
    notes = f"{tmp}/pulled/notes.txt"
    with open(notes, "w") as f:
        f.write("not a bundle")
    r = run("pull", f"{host}/ok:v1", "-o", notes, *fast, expect=2)
    expect_in(r.stderr, notes, "not a bundle archive", "--force")
    assert open(notes).read() == "not a bundle"
    run("pull", f"{host}/ok:v1", "-o", notes, "--force", *fast)
    assert open(notes, "rb").read() == a
    print("ok: a file that is not a bundle is replaced only with --force")
    reg.shutdown()
print("ok")
