#!/usr/bin/env python3
"""Indexer prefill timing, side by side (DESIGN.md section 9 style: a baseline and a ceiling in the same run).

  bench_indexer.py --decodepack D --bundle B [--seq-lens ...] [--query-lens ...] [--repeat N] [--json OUT]

Draws random inputs of the bundle's heads and top-k (keys [T, 128], q [rows, H, 128] and head weights, bf16
values), writes them as `decodepack indexer-run --inputs` reads them, and times on the same GPU:

  decodepack   `indexer-run --inputs DIR --repeat N --no-check`: the median of N prefills after the first
               (pack + stage the MXFP4 keys, score, top-k; through libdecodepack as a host calls it); the
               outputs must be identical across the repeats. Correctness is the tests' business
               (gpu.indexer.*, hf_indexer_check.py): the CPU reference of these sizes would take minutes.
  baseline     the same scores and selection in PyTorch, as HF's DeepseekV32Indexer computes them
               (bf16 keys, no quantisation): per request one bf16 matmul of all heads' q against the
               request's keys, relu, weighted sum over heads, causal mask, topk. CUDA events, median of N.
  ceiling      one dense bf16 GEMM doing as many multiply-adds as the causal scores need (H x 128 per
               visible (row, key) pair), torch.matmul on tensor cores: what the score's arithmetic costs at
               the GPU's matrix rate, without masking, relu, the head sum or the selection.

Prints the three times and decodepack's ratio to each; exit 1 when indexer-run fails, 77 without torch or a
CUDA GPU. Speed is reported, never gated.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SKIP = 77


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodepack", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--heads", type=int, required=True, help="the bundle's index heads")
    ap.add_argument("--top-k", type=int, required=True, help="the bundle's index top-k")
    ap.add_argument("--seq-lens", default="1,37,300,2100,4500")
    ap.add_argument("--query-lens", default=None, help="default: the seq lens (prefill from empty)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    try:
        import numpy as np
        import torch
    except ImportError as e:
        print("SKIPPED: %s" % e)
        return SKIP
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA GPU")
        return SKIP

    seq = [int(v) for v in args.seq_lens.split(",")]
    qry = [int(v) for v in args.query_lens.split(",")] if args.query_lens else list(seq)
    H, K = args.heads, args.top_k
    T, rows = sum(seq), sum(qry)
    g = torch.Generator().manual_seed(args.seed)
    keys = (torch.randn(T, 128, generator=g) * 0.5).bfloat16()
    q = torch.randn(rows, H, 128, generator=g).bfloat16()
    w = torch.randn(rows, H, generator=g) * H ** -0.5
    scale = 128 ** -0.5

    d = args.dir or tempfile.mkdtemp(prefix="dp-ix-bench-")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"heads": H, "top_k": K, "weight_scale": scale, "seq_lens": seq, "query_lens": qry}, f)
    keys.float().numpy().astype(np.float32).tofile(os.path.join(d, "keys.f32"))
    q.float().numpy().astype(np.float32).tofile(os.path.join(d, "q.f32"))
    w.numpy().astype(np.float32).tofile(os.path.join(d, "w.f32"))

    r = subprocess.run([args.decodepack, "indexer-run", args.bundle, "--inputs", d, "--repeat", str(args.repeat),
                        "--no-check", "--json"], stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        print(r.stdout)
        print("FAIL: decodepack indexer-run exited %d" % r.returncode)
        return 1
    dp = json.loads(r.stdout)
    dp_ms = statistics.median(rk["repeat_median_ms"] for rk in dp["ranks"])

    dev = torch.device("cuda")
    kd, qd, wd = keys.to(dev), q.to(dev), w.to(dev)
    key_off = [0]
    for s in seq:
        key_off.append(key_off[-1] + s)
    row_off = [0]
    for n in qry:
        row_off.append(row_off[-1] + n)

    def baseline():
        outs = []
        for r_, (s, n) in enumerate(zip(seq, qry)):
            if n == 0:
                continue
            k_r = kd[key_off[r_]:key_off[r_ + 1]]                       # [s, 128]
            q_r = qd[row_off[r_]:row_off[r_ + 1]]                       # [n, H, 128]
            w_r = wd[row_off[r_]:row_off[r_ + 1]]                       # [n, H]
            logits = torch.matmul(q_r.reshape(n * H, 128), k_r.t()).float().relu_().view(n, H, s)
            logits = (logits * w_r.unsqueeze(-1)).sum(1) * scale       # [n, s]
            pos = torch.arange(s - n, s, device=dev).unsqueeze(1)
            logits.masked_fill_(torch.arange(s, device=dev).unsqueeze(0) > pos, float("-inf"))
            outs.append(logits.topk(min(K, s), dim=-1).indices)
        return outs

    visible = sum(sum(s - n + 1 + j for j in range(n)) for s, n in zip(seq, qry))  # causal (row, key) pairs
    macs = visible * H * 128
    m = 4096
    n_cols = max(1, macs // (m * 128))
    a = torch.randn(m, 128, device=dev, dtype=torch.bfloat16)
    b = torch.randn(128, n_cols, device=dev, dtype=torch.bfloat16)

    def time_it(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeat):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        return statistics.median(times)

    base_ms = time_it(baseline)
    ceil_ms = time_it(lambda: torch.matmul(a, b))
    res = {"device": torch.cuda.get_device_name(0), "heads": H, "top_k": K, "seq_lens": seq, "query_lens": qry,
           "visible_pairs": visible, "decodepack_ms": dp_ms, "baseline_ms": base_ms, "ceiling_ms": ceil_ms,
           "decodepack_vs_baseline": base_ms / dp_ms, "ceiling_vs_decodepack": ceil_ms / dp_ms,
           "world": dp["world"], "repeat": args.repeat, "torch": torch.__version__}
    print("indexer prefill, %d heads, top-k %d, %d keys, %d rows, %d causal (row, key) pairs, world %d, on %s"
          % (H, K, T, rows, visible, dp["world"], res["device"]))
    print("  decodepack   %8.3f ms  (median of %d; pack + stage MXFP4 keys, score, top-k)" % (dp_ms, args.repeat))
    print("  baseline     %8.3f ms  (PyTorch, bf16 keys, per-request matmul + relu + head sum + topk)" % base_ms)
    print("  ceiling      %8.3f ms  (one bf16 GEMM of the same multiply-adds)" % ceil_ms)
    print("  decodepack is %.2fx the baseline's speed and takes %.1fx the ceiling's time"
          % (base_ms / dp_ms, dp_ms / ceil_ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
