#!/usr/bin/env python3
"""The --json contract (README.md "JSON output"): every command given --json prints exactly one JSON
object on stdout, on success and on failure, valid against its schema manifests/cli/<command>.schema.json;
a failure's object has error.code / error.exit / error.message, error.exit is the exit status, and stderr
shows the same message. Each command runs at least once succeeding (where this machine can: `run` and
`indexer-run` need a GPU, push/pull a registry server) and at least once failing.

usage: json_contract.py DECODEPACK SOURCE_DIR
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jsonschema
try:
    import referencing  # jsonschema >= 4.18
except ImportError:     # Debian 12's python3-jsonschema 4.10: RefResolver
    referencing = None

import local_registry
from local_registry import free_port

exe, root = sys.argv[1], sys.argv[2]
SCHEMAS = os.path.join(root, "manifests", "cli")
CODES = {1: "internal", 2: "usage", 3: "input", 4: "io", 5: "verify", 6: "registry", 7: "toolchain", 8: "device"}
COMMANDS = ["synth", "plan", "build", "inspect", "verify", "pack", "push", "pull", "run", "indexer-run", "generate", "doctor"]


def load(path):
    with open(path) as f:
        return json.load(f)


# Each schema refers to error.schema.json and (plan, inspect) to the deploy and manifest schemas by
# relative file names, resolved here as a validator resolves them beside the files.
if referencing:
    registry = referencing.Registry()
    for name in os.listdir(SCHEMAS):
        registry = registry.with_resource(name, referencing.Resource.from_contents(load(os.path.join(SCHEMAS, name))))
    for name in ("deploy.schema.json", "bundle-manifest.schema.json"):
        registry = registry.with_resource("../" + name, referencing.Resource.from_contents(
            load(os.path.join(root, "manifests", name))))
validators = {}
for cmd in COMMANDS + ["error"]:
    path = os.path.join(SCHEMAS, f"{cmd}.schema.json")
    schema = load(path)
    jsonschema.Draft202012Validator.check_schema(schema)
    if referencing:
        validators[cmd] = jsonschema.Draft202012Validator(schema, registry=registry)
    else:  # relative references resolved against the schema file's own URI
        resolver = jsonschema.RefResolver("file://" + os.path.abspath(path), schema)
        validators[cmd] = jsonschema.Draft202012Validator(schema, resolver=resolver)

failures = []
seen = {cmd: set() for cmd in COMMANDS}  # "ok" / "error" per command


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def run(*args, expect=0, env=None, schema=None):
    """Runs `decodepack ARGS` (which hold --json), checks the contract, returns the parsed object."""
    r = subprocess.run([exe, *args], capture_output=True, text=True, env=env)
    label = " ".join(args)
    if not check(r.returncode == expect, f"{label}: exit {r.returncode}, expected {expect}\n{r.stdout}{r.stderr}"):
        return None
    try:
        obj = json.loads(r.stdout)  # the whole of stdout: one object and nothing else
    except json.JSONDecodeError as e:
        check(False, f"{label}: stdout is not one JSON document ({e}):\n{r.stdout}")
        return None
    if not check(isinstance(obj, dict), f"{label}: stdout is not a JSON object"):
        return None
    cmd = schema or args[0]
    errors = sorted(validators[cmd].iter_errors(obj), key=lambda e: list(e.absolute_path))
    for e in errors[:3]:
        check(False, f"{label}: not valid against manifests/cli/{cmd}.schema.json at "
                     f"/{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}")
    check(obj.get("schema_version") == 1, f"{label}: schema_version is {obj.get('schema_version')!r}")
    if expect == 0:
        check("error" not in obj, f"{label}: exit 0 with an error member")
    else:
        err = obj.get("error") or {}
        check(err.get("exit") == expect, f"{label}: error.exit {err.get('exit')}, exit status {expect}")
        check(err.get("code") == CODES.get(expect), f"{label}: error.code {err.get('code')!r} for exit {expect}")
        # stderr shows the message too (verify lists each problem there; the error names the first).
        first = err.get("message", "").split(" (first: ")[-1].rstrip(")")
        check(first[:60] in r.stderr, f"{label}: stderr lacks the message {first[:60]!r}:\n{r.stderr}")
    if cmd in seen:
        seen[cmd].add("ok" if expect == 0 else "error")
    return obj


with tempfile.TemporaryDirectory(prefix="dp-json-") as tmp:
    cache = os.path.join(tmp, "cache")
    deploy = os.path.join(tmp, "d.json")
    with open(deploy, "w") as f:
        json.dump({"targets": ["sm_90a"], "widths": [1]}, f)

    # Failures common to every command: a command line CLI11 or decodepack refuses.
    run("biuld", "--json", expect=2, schema="error")
    for cmd in COMMANDS:
        run(cmd, "--json", "--bogus", expect=2)

    synth = run("synth", "--preset", "kimi-linear-tiny", "-o", f"{tmp}/m", "--json")
    run("synth", "--preset", "kimi-linear-tiyn", "-o", f"{tmp}/m2", "--json", expect=2)

    plan = run("plan", "--model", f"{tmp}/m", "--deploy", deploy, "--json")
    run("plan", "--model", "kimi-k3", "--json")  # a quantized model: model.quantization
    # An FP8 checkpoint: synth says --quantize, plan's model.quantization counts the e4m3 and scale bytes.
    synth8 = run("synth", "--preset", "kimi-linear-tiny", "--quantize", "fp8", "-o", f"{tmp}/m8", "--json")
    plan8 = run("plan", "--model", f"{tmp}/m8", "--deploy", deploy, "--json")
    if synth8 and plan8:
        q = plan8["model"].get("quantization") or {}
        check(synth8["quantize"] == "fp8" and q.get("method") == "fp8", f"fp8: synth {synth8}, plan {q}")
        check(0 < q.get("scale_bytes", 0) < q.get("quantized_bytes", 0) < plan8["model"]["checkpoint_bytes"],
              f"fp8 bytes: {q}")
        check(q.get("scales") == q.get("quantized_weights"), f"fp8: one scale tensor per FP8 weight: {q}")
    run("plan", "--model", "kimi-linear-tiny", "--deploy", f"{tmp}/missing.json", "--json", expect=4)

    built = run("build", "--model", f"{tmp}/m", "--deploy", deploy, "-o", f"{tmp}/b", "--cache-dir", cache, "-j", "2",
                "--json")
    with open(f"{tmp}/not-a-bundle", "w") as f:
        f.write("x")
    run("build", "--model", "kimi-linear-tiny", "--deploy", deploy, "-o", f"{tmp}/not-a-bundle", "--cache-dir", cache,
        "--json", expect=2)

    inspect = run("inspect", f"{tmp}/b", "--json")
    run("inspect", os.path.join(root, "tests", "cli", "cases.json"), "--json", expect=3)

    verified = run("verify", f"{tmp}/b", "--model", f"{tmp}/m", "--json")
    packed = run("pack", f"{tmp}/b", "-o", f"{tmp}/b.dpk", "--json")
    run("pack", f"{tmp}/missing", "-o", f"{tmp}/x.dpk", "--json", expect=4)

    # Key names mean one thing everywhere: `bundle` the bundle's path, `digest` its digest.
    if built and inspect and verified and packed and plan and synth:
        check(built["bundle"] == inspect["bundle"] == verified["bundle"] == f"{tmp}/b", "bundle paths differ")
        check(built["digest"] == inspect["digest"] == verified["digest"] == packed["digest"], "digests differ")
        check(packed["bundle"] == f"{tmp}/b.dpk" and packed["directory"] == f"{tmp}/b", f"pack: {packed}")
        check(verified["fingerprints_checked"] == built["fingerprints"] > 0, "fingerprints: build and verify differ")
        # The weight counts: plan and inspect agree per rank; the checkpoint has more tensors (embeddings, LM head).
        for key in ("weight_entries", "decode_tensors", "decode_bytes"):
            check(plan["ranks"][0][key] == inspect["ranks"][0][key],
                  f"{key}: plan {plan['ranks'][0][key]}, inspect {inspect['ranks'][0][key]}")
        check(plan["model"]["checkpoint_tensors"] == synth["checkpoint_tensors"], "checkpoint tensors differ")
        check(synth["checkpoint_tensors"] > inspect["ranks"][0]["decode_tensors"] > inspect["ranks"][0]["weight_entries"],
              "counts are not checkpoint > decode tensors > entries")

    # verify's failure is its report with an error member (exit 5); stdout is still one object.
    shutil.copytree(f"{tmp}/b", f"{tmp}/tampered")
    kernel = next(os.path.join(d, n) for d, _, ns in os.walk(f"{tmp}/tampered/kernels") for n in ns)
    with open(kernel, "r+b") as f:
        f.write(b"\0\0\0\0")
    bad = run("verify", f"{tmp}/tampered", "--json", expect=5)
    if bad:
        check(bad["ok"] is False and bad["problems"], f"verify of a tampered bundle: {bad}")

    # push / pull: refused connections everywhere; a real server where one is installed.
    run("push", f"{tmp}/b.dpk", f"127.0.0.1:{free_port()}/kimi/tiny:v1", "--json", "--retries", "0", expect=6)
    run("pull", f"127.0.0.1:{free_port()}/kimi/tiny:v1", "-o", f"{tmp}/p.dpk", "--json", "--retries", "0", expect=6)
    server = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    if os.path.exists(server):
        with local_registry.serve(server, tmp) as host:
            pushed = run("push", f"{tmp}/b.dpk", f"{host}/kimi/tiny:v1", "--json")
            pulled = run("pull", f"{host}/kimi/tiny:v1", "-o", f"{tmp}/p.dpk", "--json")
            run("pull", f"{host}/kimi/tiny:missing", "-o", f"{tmp}/q.dpk", "--json", expect=6)
            if pushed and pulled and packed:
                check(pushed["digest"] == pulled["digest"] == packed["digest"], "push/pull digests differ")
                check(pulled["archive_digest"] == packed["archive_digest"], "pull/pack archive digests differ")
                check(pushed["bundle"] == f"{tmp}/b.dpk" and pulled["bundle"] == f"{tmp}/p.dpk", "push/pull paths")
    else:
        print("note: docker-registry is not installed; push and pull are checked failing only")

    # run, indexer-run and generate need a GPU: here they fail (no driver: exit 8), with a usage error,
    # or on a bad prompts file (refused before any GPU work).
    env = dict(os.environ, DECODEPACK_CUDA_LIBRARY=os.path.join(tmp, "no-libcuda.so"))
    run("run", f"{tmp}/b.dpk", "--width", "1", "--json", expect=8, env=env)
    run("run", f"{tmp}/b.dpk", "--width", "3", "--json", expect=2, env=env)
    run("indexer-run", f"{tmp}/b.dpk", "--json", expect=3, env=env)
    prompts = os.path.join(root, "tests", "cli", "prompts")
    run("generate", f"{tmp}/b.dpk", "--model", f"{tmp}/m", "--prompts", os.path.join(prompts, "one-request.txt"),
        "--max-tokens", "2", "--json", expect=8, env=env)
    run("generate", f"{tmp}/b.dpk", "--model", f"{tmp}/m", "--prompts", os.path.join(prompts, "one-request.txt"),
        "--width", "3", "--json", expect=2, env=env)
    run("generate", f"{tmp}/b.dpk", "--model", f"{tmp}/m", "--prompts", os.path.join(prompts, "non-numeric.txt"),
        "--json", expect=3, env=env)

    doctor = run("doctor", "--json", "--cache-dir", cache)

    for cmd in COMMANDS:
        want = {"error"} if cmd in ("run", "indexer-run", "generate") else {"ok", "error"}
        if cmd in ("push", "pull") and not os.path.exists(server):
            want = {"error"}
        check(want <= seen[cmd], f"{cmd}: checked {sorted(seen[cmd])}, want {sorted(want)}")

if failures:
    for f in failures:
        print("FAIL:", f)
    sys.exit(1)
print("ok: --json of", ", ".join(COMMANDS), "valid against manifests/cli/, on success and on failure")
