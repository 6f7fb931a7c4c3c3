#!/usr/bin/env python3
"""`decodepack generate` on a Kimi-K3 model: block attention residuals (the attention-residual buffer that
generate binds), latent MXFP4 MoE, q-LoRA MLA, safe-gate KDA; random weights (the synth fill).

One command from the repository root, given a built tree (needs the CUDA driver and a GPU; Python 3
standard library only):

    python3 tests/gpu/generate_k3_check.py --decodepack build/ci/tools/decodepack

Skips (exit 77) without a CUDA driver or GPU; exit 0 when every gate passes, 1 otherwise.

There is no Hugging Face implementation of K3 to compare with and generate has no CPU reference mode
(`run --check` compares single steps layer by layer with the float64 reference), so this gates what holds
whatever the weights are:
  1. builds a bundle of --model (default: the kimi-k3-tiny preset) for sm_90a, widths 1, 2, 4, 8
     (deploy-generate.json);
  2. 5 requests of 1, 3, 6, 10 and 17 tokens (random ids, seed 0), --max-tokens 6: the steps run at
     widths 8 (3 rows padded), 4, 2 and 1 as requests leave;
  3. runs: the batch eagerly (--logits: every fed position's fp32 logits), the batch with --graph, the
     batch at --width 8 (every step padded to 8 rows), and each request alone (width 1 throughout).
Gates (PASS/FAIL lines):
  - every run exits 0 and every logit is finite (generate fills the attention-residual buffer with NaN
    once, so a block read before its step wrote it would show here);
  - --graph: the eager run's tokens and logits, bit for bit (same kernels, same data);
  - rows stay apart: each request alone and the --width 8 batch against the eager batch, at every fed
    position up to the first one where the fed tokens differ (the prompt always; generated tokens while
    both runs agree), relative logit error ||a - b|| / ||b|| at most --limit (default 0.1). Rows that
    read another row's blocks, state or cache give errors near 1; steps at other widths (other GEMM
    instances, other rounding) give far less. Every figure is printed.
Results: WORK/summary.json (default WORK: build/ci/generate-k3-check).
"""

import argparse
import array
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77
LENGTHS = [1, 3, 6, 10, 17]
MAX_TOKENS = 6
NO_GPU = re.compile(r"CUDA driver: cannot load|CUDA_ERROR_NO_DEVICE|no CUDA device visible")

failures = []


def gate(ok, what):
    print(("PASS: " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        failures.append(what)


def run(cmd):
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode == 8 and NO_GPU.search(r.stderr):
        print("SKIPPED: no CUDA driver or GPU on this host")
        sys.exit(SKIP)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        print("FAIL: %s exited %d" % (" ".join(cmd), r.returncode))
        sys.exit(1)
    return r.stdout


def write_prompts(path, prompts):
    with open(path, "w") as f:
        for p in prompts:
            f.write(" ".join(str(t) for t in p) + "\n")


def generate(dp, bundle, model, prompts, path, extra, logits):
    write_prompts(path, prompts)
    out = json.loads(run(dp + ["generate", bundle, "--model", model, "--prompts", path, "--max-tokens",
                               str(MAX_TOKENS), "--json", "--logits", logits] + extra))
    v = out["vocab_size"]
    data = array.array("f")
    with open(logits, "rb") as f:
        data.frombytes(f.read())
    if sys.byteorder != "little":
        data.byteswap()
    rows = []  # per request: [fed positions][vocab]
    for q in out["requests"]:
        first, n = q["logits_row"], len(q["argmax"])
        rows.append([data[(first + i) * v:(first + i + 1) * v] for i in range(n)])
    return out, rows


def fed(q):
    return q["prompt"] + q["tokens"][:-1]


def rel_error(a, b):
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    den = math.sqrt(sum(y * y for y in b))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def compare(name, got, got_rows, ref, ref_rows, ids, limit, summary):
    """got's requests against ref's (request ids `ids`), at the positions where both were fed the same
    tokens so far."""
    worst = 0.0
    for k, (i, g, r) in enumerate(zip(ids, got["requests"], ref["requests"])):
        fg, fr = fed(g), fed(r)
        same = 0
        while same < min(len(fg), len(fr)) and fg[same] == fr[same]:
            same += 1
        errs = [rel_error(got_rows[k][p], ref_rows[k][p]) for p in range(same)]
        m = max(errs) if errs else 0.0
        worst = max(worst, m)
        print("  %s (request %d): %d of %d positions compared (prompt %d), rel. error mean %.3e max %.3e; tokens %s" %
              (name, i, same, len(fr), len(r["prompt"]), sum(errs) / max(len(errs), 1), m,
               "equal" if g["tokens"] == r["tokens"] else "differ"))
        summary.append({"run": name, "request": i, "positions": same, "errors": errs,
                        "tokens_equal": g["tokens"] == r["tokens"]})
    gate(worst <= limit, "%s: largest relative logit error %.3e <= %g" % (name, worst, limit))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodepack", required=True, help="the decodepack command line (may hold spaces)")
    ap.add_argument("--model", default="kimi-k3-tiny", help="preset, config file or checkpoint directory")
    ap.add_argument("--deploy", default=os.path.join(HERE, "deploy-generate.json"))
    ap.add_argument("--work", default="build/ci/generate-k3-check")
    ap.add_argument("--limit", type=float, default=0.1)
    a = ap.parse_args()
    dp = shlex.split(a.decodepack)
    os.makedirs(a.work, exist_ok=True)
    w = lambda name: os.path.join(a.work, name)

    bundle = w("k3.dpk")
    run(dp + ["build", "--model", a.model, "--deploy", a.deploy, "-o", bundle, "--cache-dir", w("cache"), "-j", "2"])
    vocab = json.loads(run(dp + ["inspect", bundle, "--json"]))["manifest"]["model"]["vocab_size"]
    rnd = random.Random(0)
    prompts = [[rnd.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]

    eager, eager_rows = generate(dp, bundle, a.model, prompts, w("prompts.txt"), [], w("eager.bin"))
    widths = [s["width"] for s in eager["steps"]]
    print("eager: %d steps at widths %s" % (len(widths), sorted(set(widths), reverse=True)))
    finite = all(math.isfinite(x) for req in eager_rows for row in req for x in row)
    gate(finite, "eager: every logit finite (%d positions)" % sum(len(r) for r in eager_rows))

    graph, graph_rows = generate(dp, bundle, a.model, prompts, w("prompts.txt"), ["--graph"], w("graph.bin"))
    gate([q["tokens"] for q in graph["requests"]] == [q["tokens"] for q in eager["requests"]],
         "--graph: the eager run's tokens")
    gate(graph_rows == eager_rows, "--graph: the eager run's logits, bit for bit")

    summary = []
    padded, padded_rows = generate(dp, bundle, a.model, prompts, w("prompts.txt"), ["--width", "8"], w("w8.bin"))
    gate(all(math.isfinite(x) for req in padded_rows for row in req for x in row), "--width 8: every logit finite")
    compare("--width 8", padded, padded_rows, eager, eager_rows, range(len(prompts)), a.limit, summary)
    for i, p in enumerate(prompts):
        alone, alone_rows = generate(dp, bundle, a.model, [p], w("alone%d.txt" % i), [], w("alone%d.bin" % i))
        ref = dict(eager, requests=[eager["requests"][i]])
        compare("request %d alone" % i, alone, alone_rows, ref, [eager_rows[i]], [i], a.limit, summary)

    with open(w("summary.json"), "w") as f:
        json.dump({"model": a.model, "bundle": bundle, "steps": eager["steps"], "device_ms": eager["device_ms"],
                   "graph_device_ms": graph["device_ms"], "comparisons": summary, "failures": failures}, f, indent=1)
    print("%d gate(s) failed" % len(failures) if failures else "all gates passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
