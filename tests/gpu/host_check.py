#!/usr/bin/env python3
"""The vLLM-shaped Python host (runtime/python/decodepack/host.py) on a GPU, against transformers' own
greedy generation (issue 17, item 2).

One command from the repository root, given a built tree (the CLI to build bundles, libdecodepack, the
CUDA driver, a Python with PyTorch (CUDA) and transformers 5.17):

    DECODEPACK_LIBRARY=build/ci/runtime/libdecodepack.so PYTHONPATH=runtime/python \\
        python3 tests/gpu/host_check.py --decodepack build/ci/tools/decodepack

Skips (exit 77) without torch, transformers or a CUDA GPU; exit 0 when every gate passes, 1 otherwise.

Per geometry (--geometries, default tiny and wide), on the "confident" checkpoint of generate_check.py
(written by transformers' save_pretrained, permutation LM head, so that greedy tokens are not decided
by rounding), two bundles: q = 1 (widths 1, 2, 4, 8) and q = 2 (num_speculative_tokens 1, widths 1, 2,
4, 8). The host is built after the weights load (binds and verifies them, loads every width), runs the
profiling step (no KV bound, then a profiling KV cache), binds the real cache, captures one FULL graph
per width. Then:
  A. 8 requests (prompts of 1 to 130 tokens) asking for 64, 58, ..., 22 new tokens: they leave one by
     one, so steps replay the width-8 graph with 8..5 real rows (padding), then widths 4, 2 and 1;
     steps 10-12 are forced through transformers (the host's path for refused steps: state out of and
     back into decodepack's caches, mid-run);
  B. 11 requests (the 8 and three more) at once: more than the widest width, so the plan refuses
     (TOO_MANY_REQUESTS) and transformers runs those steps, until requests leave and the graphs take
     over from the state transformers wrote;
  C. the q = 2 bundle: speculative-verify steps (greedy acceptance; proposals: HF fp32's next greedy
     token at two steps of three and a wrong token at the third, so that both outcomes occur; the
     host's own proposer, prompt lookup, rarely hits on random prompts), FULL graphs, two forced
     transformers steps.
Gates: each step's logits (first row of each request), grouped by path (graph replay, transformers),
no further from HF fp32's at the same position than HF bf16's are (mean <= 1.5x, max <= 2x; this is
what checks the state moved between the two caches: the confident checkpoint's tokens would survive a
wrong state); every request's tokens equal HF fp32's greedy tokens (full forwards, no cache) for all the tokens
it asked for, except after a divergence at a near-tie (HF fp32's top-2 gap < 2 tau(p), tau(p) the bf16
noise at that position, as in generate_check.py); the paths the run should take were taken (graph
replays with padded rows, width changes, refused steps run by transformers with their reason).
Figures: decode steps per second and tokens per second of the host (graph steps, wall time including
Python and the metadata copies) and of transformers' own bf16 cached greedy decode (batch 1), same GPU.
Results: WORK/host-summary.json.
"""

import argparse
import json
import logging
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import generate_check as gc  # noqa: E402  (HF helpers, prompts, gates)


def build(dp, ckpt, deploy, out, cache):
    gc.run(dp + ["build", "--model", ckpt, "--deploy", deploy, "-o", out, "--cache-dir", cache])


def near_tie_gate(gates, label, outputs, prompts, g32, l32, tau):
    """outputs {i: tokens}; each compared with HF fp32's greedy tokens."""
    bad, ties, full = [], [], 0
    for i, toks in sorted(outputs.items()):
        ref = g32[i % len(prompts)][:len(toks)]
        k = gc.first_divergence(toks, ref)
        if k is None:
            full += 1
            continue
        j = len(prompts[i % len(prompts)]) - 1 + k
        gap, t = gc.top2_gap(l32[i % len(prompts)][j]), tau[i % len(prompts)][j]
        print("  %s request %d: diverges at token %d of %d (HF fp32 top-2 gap %.4f, bf16 noise %.4f)" % (
            label, i, k, len(toks), gap, t))
        (ties if gap < 2 * t else bad).append(i)
    gates.check(not bad, "%s: tokens equal HF fp32's greedy tokens: %d requests all their tokens, %d part at a "
                "near-tie, %d at a larger gap" % (label, full, len(ties), len(bad)))
    return {"equal": full, "near_tie": len(ties), "bad": len(bad)}


def run_geometry(args, torch, geometry, gates):
    import decodepack as dp
    from decodepack.host import KimiLinearHost
    import hf_make_checkpoint
    name = "%s-confident" % geometry
    work = os.path.join(args.work, name)
    os.makedirs(work, exist_ok=True)
    print("\n=== %s ===" % name, flush=True)
    ckpt = os.path.join(work, "checkpoint")
    hf_make_checkpoint.make(ckpt, seed=0, geometry=geometry, lm_head="permutation")
    cache = os.path.join(args.work, "cache")
    q1, q2 = os.path.join(work, "q1.dpk"), os.path.join(work, "q2.dpk")
    build(args.decodepack, ckpt, os.path.join(HERE, "deploy-generate.json"), q1, cache)
    deploy_q2 = os.path.join(work, "deploy-q2.json")
    with open(deploy_q2, "w") as f:
        json.dump({"targets": ["sm_90a"], "widths": [1, 2, 4, 8], "num_speculative_tokens": 1}, f)
    build(args.decodepack, ckpt, deploy_q2, q2, cache)

    models = gc.hf_models(torch, ckpt)
    vocab = models["fp32"].config.vocab_size
    prompts = gc.prompts_for(vocab)
    n = args.max_tokens
    g32, l32, tau, ebf = [], [], [], []
    for p in prompts:
        toks, logits = gc.hf_greedy_fp32(torch, models["fp32"], p, n)
        lbf = gc.hf_logits(torch, models["bf16"], p + toks[:-1])
        g32.append(toks)
        l32.append(logits)
        tau.append((lbf - logits).abs().max(dim=1).values.tolist())
        ebf.append(((lbf - logits).norm(dim=1) / logits.norm(dim=1)).tolist())

    def logits_gate(label, trace, outputs):
        """Each step's first-row logits against HF fp32's at the same position (while the request's tokens
        still equal HF fp32's), per path, no further than HF bf16's at those positions."""
        err = {}
        for s in trace:
            for rid, k, row in s.get("logits", []):
                i = rid % len(prompts)
                if outputs[rid][:k] != g32[i][:k] or k >= len(g32[i]):
                    continue
                j = len(prompts[i]) - 1 + k
                ref = l32[i][j]
                e = err.setdefault(s["path"], ([], []))
                e[0].append(float((row - ref).norm() / ref.norm()))
                e[1].append(ebf[i][j])
        for path, (e_host, e_bf) in sorted(err.items()):
            m, mb = sum(e_host) / len(e_host), sum(e_bf) / len(e_bf)
            gates.check(m <= 1.5 * mb and max(e_host) <= 2 * max(e_bf),
                        "%s: %s-path logits vs HF fp32 at %d positions: mean %.3e max %.3e, HF bf16 mean %.3e max %.3e"
                        % (label, path, len(e_host), m, max(e_host), mb, max(e_bf)))
        return {p: {"positions": len(e[0]), "mean": sum(e[0]) / len(e[0]), "mean_bf16": sum(e[1]) / len(e[1])}
                for p, e in err.items()}
    del models["fp32"]
    model = models["bf16"]
    out = {"geometry": geometry}

    # A and B: the q = 1 bundle
    t0 = time.perf_counter()
    host = KimiLinearHost(model, q1)
    peak = host.profile_run()
    host.allocate_kv_cache(max_requests=16, max_context=max(len(p) for p in prompts) + n + 8)
    host.capture_graphs()
    print("q1 host ready in %.1f s (profile peak %.1f MiB; graphs at widths %s)" % (
        time.perf_counter() - t0, peak / 2 ** 20, sorted(host.graphs)))
    gates.check(host.stats["reasons"].get("DP_REASON_NO_KV") == 1,
                "%s: the profiling step without KV was refused (DP_REASON_NO_KV) and run by transformers" % name)
    gates.check(sorted(host.graphs) == [1, 2, 4, 8], "%s: FULL graphs captured at widths %s" % (name, sorted(host.graphs)))
    want = {i: n - 6 * i for i in range(len(prompts))}
    res = host.generate({i: p for i, p in enumerate(prompts)}, want, force_host_steps=range(10, 13), keep_logits=True)
    trace = host.trace
    widths = []
    for s in trace:
        if s["path"] == "graph":
            w = next(w for w in host.widths if w >= s["requests"])
            if not widths or widths[-1] != w:
                widths.append(w)
    padded = sum(1 for s in trace if s["path"] == "graph" and s["requests"] not in host.widths)
    forced = sum(1 for s in trace if s["path"] == "host")
    print("A: %d steps: graph widths in order %s, %d replays with padded rows, %d steps by transformers" % (
        len(trace), widths, padded, forced))
    gates.check(widths == [8, 4, 2, 1] and padded > 0 and forced == 3,
                "%s A: requests leave one by one: graph widths %s, %d padded replays, %d forced transformers steps"
                % (name, widths, padded, forced))
    out["A"] = near_tie_gate(gates, "%s A (q=1, graphs, 3 forced host steps)" % name,
                             {i: res[i] for i in res}, prompts, g32, l32, tau)
    out["A"]["logits"] = logits_gate("%s A" % name, trace, res)
    out["A"]["trace"] = [{k: v for k, v in s.items() if k != "logits"} for s in trace]
    stats_a = json.loads(json.dumps(host.stats))

    extra = {len(prompts) + k: prompts[k] for k in range(3)}
    all_b = {i: p for i, p in enumerate(prompts)}
    all_b.update(extra)
    host.stats["reasons"] = {}
    want_b = {i: (n if i < len(prompts) else 16) for i in all_b}   # the three extra leave after 16 steps
    res_b = host.generate(all_b, want_b, keep_logits=True)
    host_steps = sum(1 for s in host.trace if s["path"] == "host")
    refused = host.stats["reasons"].get("DP_REASON_TOO_MANY_REQUESTS", 0)
    print("B: %d steps, %d by transformers (reasons %s), then %d graph replays" % (
        len(host.trace), host_steps, host.stats["reasons"], sum(1 for s in host.trace if s["path"] == "graph")))
    gates.check(refused > 0 and refused == host_steps and host.trace[-1]["path"] == "graph",
                "%s B: 11 requests: %d steps refused (TOO_MANY_REQUESTS) and run by transformers, then the graphs"
                % (name, refused))
    out["B"] = near_tie_gate(gates, "%s B (11 requests)" % name, res_b, prompts, g32, l32, tau)
    out["B"]["logits"] = logits_gate("%s B" % name, host.trace, res_b)

    # timing: a fresh run of A's requests without forced steps
    host.stats["seconds"], host.stats["tokens"] = {}, {}
    host.generate({i: p for i, p in enumerate(prompts)}, n)
    sec, tok = host.stats["seconds"].get("graph", 0.0), host.stats["tokens"].get("graph", 0)
    steps = sum(1 for s in host.trace if s["path"] == "graph")
    hf_s = [gc.hf_timed_decode(torch, model, p, n) for p in prompts]
    out["timing"] = {"host_graph_steps_per_s": steps / sec if sec else 0.0,
                     "host_graph_tokens_per_s": tok / sec if sec else 0.0,
                     "hf_bf16_cached_steps_per_s_batch1": (n - 1) * len(prompts) / sum(hf_s),
                     "hf_bf16_cached_tokens_per_s_batch1": (n - 1) * len(prompts) / sum(hf_s)}
    print("timing: host %.1f steps/s, %.1f tokens/s (graph steps, batch up to 8, wall); transformers bf16 cached "
          "decode %.1f steps/s = tokens/s (batch 1)" % (out["timing"]["host_graph_steps_per_s"],
                                                        out["timing"]["host_graph_tokens_per_s"],
                                                        out["timing"]["hf_bf16_cached_steps_per_s_batch1"]))
    out["stats_q1"] = stats_a
    host.session.close()
    del host

    # C: the q = 2 bundle, speculative verify
    host = KimiLinearHost(model, q2)
    host.profile_run()
    host.allocate_kv_cache(max_requests=16, max_context=max(len(p) for p in prompts) + n + 8)
    host.capture_graphs()
    # proposals: HF fp32's next greedy token at two steps of three, a wrong one at the third
    def proposer(r, tokens):
        k = len(tokens) - len(r.prompt)
        right = g32[r.id][k] if k < len(g32[r.id]) else 0
        return right if k % 3 else (right + 1) % vocab
    res_c = host.generate({i: p for i, p in enumerate(prompts)}, n, force_host_steps=(5, 6), proposer=proposer,
                          keep_logits=True)
    proposed = sum(1 for s in host.trace)  # steps
    replays = sum(1 for s in host.trace if s["path"] == "graph")
    forced = sum(1 for s in host.trace if s["path"] == "host")
    tok = host.stats["tokens"]
    emitted = sum(tok.values())
    print("C: q = 2: %d steps (%d graph replays, %d by transformers), %d tokens emitted (%.2f per request-step)" % (
        proposed, replays, forced, emitted, emitted / max(1, sum(s["requests"] for s in host.trace))))
    gates.check(replays > 0 and forced == 2 and emitted > sum(s["requests"] for s in host.trace),
                "%s C: speculative-verify steps replay graphs, accept some proposals (%d tokens in %d request-steps), "
                "2 forced transformers steps" % (name, emitted, sum(s["requests"] for s in host.trace)))
    out["C"] = near_tie_gate(gates, "%s C (q=2 spec verify)" % name, res_c, prompts, g32, l32, tau)
    out["C"]["logits"] = logits_gate("%s C" % name, host.trace, res_c)
    out["C"]["tokens_per_request_step"] = emitted / max(1, sum(s["requests"] for s in host.trace))
    sec = host.stats["seconds"].get("graph", 0.0)
    out["timing"]["host_q2_graph_tokens_per_s"] = host.stats["tokens"].get("graph", 0) / sec if sec else 0.0
    host.session.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodepack", default=os.path.join(ROOT, "build", "ci", "tools", "decodepack"))
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "ci", "host-check"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--geometries", default="tiny,wide")
    args = ap.parse_args()
    try:
        import torch
        from transformers import KimiLinearForCausalLM  # noqa: F401
    except ImportError as e:
        gc.skip("needs torch and transformers with KimiLinearForCausalLM (%s)" % e)
    if not torch.cuda.is_available():
        gc.skip("no CUDA GPU visible to PyTorch")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("decodepack.host").setLevel(logging.INFO)
    args.decodepack = shlex.split(args.decodepack)
    os.makedirs(args.work, exist_ok=True)
    gates = gc.Gates()
    out = [run_geometry(args, torch, g, gates) for g in args.geometries.split(",")]
    summary = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gates": gates.results,
               "geometries": out, "ok": gates.ok()}
    with open(os.path.join(args.work, "host-summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n%s: %d gates, %d failed" % ("PASS" if gates.ok() else "FAIL", len(gates.results),
                                        sum(not r["ok"] for r in gates.results)))
    return 0 if gates.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
