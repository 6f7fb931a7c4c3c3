#!/usr/bin/env python3
"""CPU checks of the bench's files (no GPU, no torch):

  check_bench_files.py MODE DECODEPACK SOURCE_ROOT
    schema     tests/bench/bench-result-sample.json (what `bench --json` writes: the golden file of
               tests/unit/bench/result_test.cpp) and a document from bench/baseline.py's writer validate against
               manifests/bench-result.schema.json; every bytes total is its fields' sum; broken copies fail
    bytes      bench/baseline.py's byte accounting agrees with `decodepack plan --json` (the worst case: every
               request at the planned context, min(E, rows x top_k) experts) on the bench model and the 48B preset
    chart      bench/chart.py --table on the sample, with itself as the baseline; and a PNG when matplotlib is
               importable (exit 77, skipped, when it is not)
    ptx        the bench's own kernels (tooling/bench_ptx.h) assemble with ptxas for sm_90a (77 without ptxas)
    baseline   bench/baseline.py --cpu-smoke on a kimi-linear-tiny-shaped model with all four layer classes: its
               stock layers (fla's kernels replaced by pure-torch stand-ins) pass its own gate against the float64
               reference at widths 1 and 3, and its document validates (77 where torch is not importable)
"""
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

SKIP = 77


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Checker:
    def __init__(self):
        self.failures = 0

    def check(self, ok, what):
        print(("ok    " if ok else "FAIL  ") + what)
        self.failures += 0 if ok else 1


def totals_ok(doc):
    fields = ["dense_weights", "expert_weights", "state_read", "state_write", "kv_read", "kv_write", "act_read",
              "act_write"]
    bad = []

    def walk(x, where):
        if isinstance(x, dict):
            if set(fields) <= set(x) and "total" in x and sum(x[f] for f in fields) != x["total"]:
                bad.append(where)
            for k, v in x.items():
                walk(v, where + "." + k)
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, "%s[%d]" % (where, i))
    walk(doc, "$")
    return bad


def baseline_sample(root):
    b = load_module(os.path.join(root, "bench", "baseline.py"), "baseline")
    with open(os.path.join(root, "bench", "configs", "kimi-linear-48b-shaped-bench.json")) as f:
        cfg = b.Cfg(json.load(f))
    seq = [4097, 4097]
    kda = b.layer_bytes(cfg, 8, seq, 15)
    mla = b.layer_bytes(cfg, 9, seq, 16)
    classes = [b.class_entry("kda_moe", 2, [8], routed=[15], us_per_layer=[300.0, 310.0], replay_us=305.0,
                             byte_sum=kda, ceiling=4.4e12),
               b.class_entry("mla_moe", 2, [9], "failed", "the correctness gate failed: hidden")]
    steps = [b.step_entry(2, 16, us=[4000.0, 4100.0], byte_sum=b.add_bytes(kda, mla), ceiling=4.4e12)]
    gate = [{"width": 2, "checks": 8, "failed": 1, "failures": ["layer 9 (mla_moe, moe grouped) hidden 2e-02 >= 1e-02"]}]
    doc = b.result_doc("stock PyTorch", "torch 2.11", "bench/configs/x.json", "NVIDIA H200", 4096, 100, [2],
                       4 << 30, [980.0, 990.0], "torch.sum", gate, classes, steps, ["a note"])
    return b, doc


def mode_schema(dp, root):
    import jsonschema
    c = Checker()
    with open(os.path.join(root, "manifests", "bench-result.schema.json")) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    with open(os.path.join(root, "tests", "bench", "bench-result-sample.json")) as f:
        sample = json.load(f)
    errs = [e.message for e in v.iter_errors(sample)]
    c.check(not errs, "bench --json sample validates" + ("" if not errs else ": " + "; ".join(errs[:3])))
    c.check(not totals_ok(sample), "bench sample: every bytes total is its fields' sum")
    _, base = baseline_sample(root)
    errs = [e.message for e in v.iter_errors(base)]
    c.check(not errs, "baseline.py's document validates" + ("" if not errs else ": " + "; ".join(errs[:3])))
    c.check(not totals_ok(base), "baseline document: every bytes total is its fields' sum")
    broken = [
        ("an unknown top-level field", lambda d: d.update(extra=1)),
        ("another format_version", lambda d: d.update(format_version=2)),
        ("a class status outside the enum", lambda d: d["classes"][0].update(status="slow")),
        ("a bytes object without total", lambda d: d["classes"][0]["bytes"].pop("total")),
        ("a summary without median", lambda d: d["steps"][0]["us"].pop("median")),
        ("a negative share", lambda d: d["classes"][0].update(share=-0.5)),
        ("a kernel launch without its op", lambda d: d["kernels"][0]["launches"][0].pop("op")),
    ]
    for what, edit in broken:
        d = copy.deepcopy(sample)
        edit(d)
        c.check(any(True for _ in v.iter_errors(d)), "refused: " + what)
    return c.failures


def mode_bytes(dp, root):
    b = load_module(os.path.join(root, "bench", "baseline.py"), "baseline")
    c = Checker()
    with tempfile.TemporaryDirectory() as tmp:
        deploy = os.path.join(tmp, "deploy.json")
        with open(deploy, "w") as f:
            json.dump({"targets": ["sm_90a"], "widths": [1, 8]}, f)
        for model, cfg_path in [(os.path.join(root, "bench", "configs", "kimi-linear-48b-shaped-bench.json"), None),
                                ("kimi-linear-48b-a3b", os.path.join(root, "manifests", "presets",
                                                                     "kimi-linear-48b-a3b.json"))]:
            r = subprocess.run([dp, "plan", "--model", model, "--deploy", deploy, "--json"], capture_output=True,
                               text=True)
            if r.returncode != 0:
                c.check(False, "decodepack plan %s: %s" % (model, r.stderr))
                continue
            plan = json.loads(r.stdout)
            with open(cfg_path or model) as f:
                cfg = b.Cfg(json.load(f))
            for sb in plan["ranks"][0]["step_bytes"]:
                w = sb["width"]
                tot = dict.fromkeys(b.BYTE_FIELDS, 0)
                for i in range(cfg.layers):
                    tot = b.add_bytes(tot, b.layer_bytes(cfg, i, [4096] * w, min(cfg.E, w * cfg.topk)))
                tot = b.add_bytes(tot, b.final_norm_bytes(cfg, w))
                name = "%s width %d" % (os.path.basename(model), w)
                c.check(tot["dense_weights"] + tot["expert_weights"] == sb["weights"],
                        "%s: weights %d == plan's %d" % (name, tot["dense_weights"] + tot["expert_weights"],
                                                         sb["weights"]))
                for k in ["state_read", "state_write", "kv_read", "kv_write"]:
                    c.check(tot[k] == sb[k], "%s: %s %d == plan's %d" % (name, k, tot[k], sb[k]))
    return c.failures


def mode_chart(dp, root):
    c = Checker()
    chart = os.path.join(root, "bench", "chart.py")
    sample = os.path.join(root, "tests", "bench", "bench-result-sample.json")
    r = subprocess.run([sys.executable, chart, "--table", sample, "--baseline", sample], capture_output=True, text=True)
    c.check(r.returncode == 0 and "speedup" in r.stdout and "1.00x" in r.stdout and "failed" in r.stdout,
            "chart.py --table with a baseline:\n" + r.stdout + r.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        _, base = baseline_sample(root)
        bpath = os.path.join(tmp, "baseline.json")
        with open(bpath, "w") as f:
            json.dump(base, f)
        r = subprocess.run([sys.executable, chart, "--table", sample, "--baseline", bpath], capture_output=True,
                           text=True)
        c.check(r.returncode == 0 and "kda_moe" in r.stdout, "chart.py --table with baseline.py's document")
        bad = os.path.join(tmp, "bad.json")
        with open(bad, "w") as f:
            json.dump({"format": "something-else"}, f)
        r = subprocess.run([sys.executable, chart, "--table", bad], capture_output=True, text=True)
        c.check(r.returncode != 0 and "not a decodepack bench result" in r.stderr, "chart.py refuses another format")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("SKIPPED: matplotlib is not importable here; the PNG is drawn on the GPU host")
            return c.failures or SKIP
        png = os.path.join(tmp, "chart.png")
        r = subprocess.run([sys.executable, chart, png, sample, "--baseline", bpath, "--title", "test"],
                           capture_output=True, text=True)
        with open(png, "rb") if os.path.exists(png) else open(os.devnull, "rb") as f:
            head = f.read(8)
        c.check(r.returncode == 0 and head == b"\x89PNG\r\n\x1a\n", "chart.py draws a PNG " + r.stderr)
    return c.failures


def mode_ptx(dp, root):
    ptxas = shutil.which("ptxas") or next((p for p in ["/usr/local/cuda/bin/ptxas"] if os.path.exists(p)), None)
    if not ptxas:
        print("SKIPPED: no ptxas (CUDA toolkit) here")
        return SKIP
    with open(os.path.join(root, "tooling", "bench_ptx.h")) as f:
        text = f.read()
    ptx = text[text.index('R"PTX(') + len('R"PTX('):text.index(')PTX"')]
    c = Checker()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "bench.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "bench.cubin")],
                           capture_output=True, text=True)
        c.check(r.returncode == 0, "ptxas -arch=sm_90a tooling/bench_ptx.h\n" + r.stdout + r.stderr)
        c.check("0 bytes spill" in r.stdout + r.stderr, "no register spills")
        for entry in ["dp_bench_read", "dp_bench_empty"]:
            c.check(entry in r.stdout + r.stderr, "entry " + entry)
    return c.failures


def mode_baseline(dp, root):
    try:
        import torch  # noqa: F401
        import jsonschema
    except ImportError as e:
        print("SKIPPED: %s (the baseline runs on the GPU host)" % e)
        return SKIP
    c = Checker()
    with open(os.path.join(root, "manifests", "presets", "kimi-linear-tiny.json")) as f:
        cfg = json.load(f)
    # Four layers, one of each class: kda_dense, mla_dense, kda_moe, mla_moe.
    cfg["linear_attn_config"]["kda_layers"] = [1, 3]
    cfg["linear_attn_config"]["full_attn_layers"] = [2, 4]
    cfg["first_k_dense_replace"] = 2
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "config.json")
        with open(model, "w") as f:
            json.dump(cfg, f)
        out = os.path.join(tmp, "baseline.json")
        r = subprocess.run([sys.executable, os.path.join(root, "bench", "baseline.py"), "--cpu-smoke", "--model", model,
                            "--widths", "1,3", "--context", "100", "--replays", "5", "--json", out],
                           capture_output=True, text=True, timeout=600)
        print(r.stdout[-3000:])
        c.check(r.returncode == 0, "baseline.py --cpu-smoke exit %d\n%s" % (r.returncode, r.stderr[-3000:]))
        if not os.path.exists(out):
            return c.failures + 1
        with open(out) as f:
            doc = json.load(f)
        with open(os.path.join(root, "manifests", "bench-result.schema.json")) as f:
            v = jsonschema.Draft202012Validator(json.load(f))
        errs = [e.message for e in v.iter_errors(doc)]
        c.check(not errs, "the smoke run's document validates" + ("" if not errs else ": " + "; ".join(errs[:3])))
        c.check(all(g["failed"] == 0 and g["checks"] > 0 for g in doc["gate"]), "every check of the gate passed")
        got = sorted({(x["class"], x["width"]) for x in doc["classes"] if x["status"] == "ok"})
        want = sorted((k, w) for k in ["kda_dense", "kda_moe", "mla_dense", "mla_moe"] for w in [1, 3])
        c.check(got == want, "every class at every width measured: %s" % got)
        c.check(all(s["status"] == "ok" for s in doc["steps"]) and len(doc["steps"]) == 2, "the whole step at both widths")
    return c.failures


def main():
    mode, dp, root = sys.argv[1], sys.argv[2], sys.argv[3]
    rc = {"schema": mode_schema, "bytes": mode_bytes, "chart": mode_chart, "ptx": mode_ptx,
          "baseline": mode_baseline}[mode](dp, root)
    if rc == SKIP:
        return SKIP
    print("%s: %s" % (mode, "FAILED" if rc else "ok"))
    return 1 if rc else 0


if __name__ == "__main__":
    sys.exit(main())
