"""A real OCI registry (Debian's docker-registry) on a free loopback port, for the CLI tests."""
import contextlib
import os
import socket
import subprocess
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@contextlib.contextmanager
def serve(server, tmp):
    """Runs `server` with its storage under tmp; yields "127.0.0.1:PORT" once /v2/ answers."""
    port = free_port()
    config = os.path.join(tmp, "config.yml")
    with open(config, "w") as f:
        f.write(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp}/data\n"
                f"http:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen([server, "serve", config], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
                break
            except Exception:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"registry {server} did not start on port {port}")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()
