#!/usr/bin/env python3
"""Independent check of decodepack's FP4 indexer prefill (issue 7) against Hugging Face transformers'
DeepseekV32Indexer, which scores unquantised keys (bf16 or fp32 operands, fp32 arithmetic).

What it does
  1. HF half (torch + transformers 5.17, transformers.models.deepseek_v32.modeling_deepseek_v32): a small
     random DeepseekV32Config (hidden 512, q_lora_rank 256, index_n_heads --heads, index_head_dim 128,
     index_topk --top-k, qk_rope_head_dim 64, default RoPE with theta 10000) and ONE DeepseekV32Indexer(config,
     layer_idx=0) on --device. Weights: wq_b, wk and weights_proj normal(0, --init-std) (HF's _init_weights
     draws Linear weights this way); k_norm is HF's own nn.LayerNorm(128, eps=1e-6), given a random affine
     (weight 1 + 0.25 N(0,1), bias 0.1 N(0,1)) so that the four 32-value scale groups of a key differ in
     magnitude. The module is cast to --dtype except weights_proj, kept in fp32 as
     DeepseekV32PreTrainedModel._keep_in_fp32_modules does in a loaded model. Inputs hidden_states and q_resid
     are N(0,1) rounded to --dtype (q_resid stands for q_a_layernorm's output). Everything is drawn from one
     CPU generator seeded with --seed, so a run is reproducible whatever the device.
     Each request runs alone (batch 1: HF's padding semantics do not enter) as a prefill from empty
     (past_key_values None), exactly as DeepseekV32Attention calls it: indexer(hidden_states, q_resid, (cos,
     sin), mask[:, 0], position_ids), with cos/sin from HF's DeepseekV32RotaryEmbedding at positions
     0..S-1 and the mask from HF's create_causal_mask(..., allow_is_causal_skip=False) as DeepseekV32Model
     builds it for --attn-implementation (sdpa: boolean, masked_fill(-inf); eager: additive finfo.min). The
     mask is checked to be "position p sees 0..p".
     Captured during HF's forward by a TorchFunctionMode, unchanged (no re-implementation of HF's math):
       - the operands of HF's score matmul: q after RoPE (q.float(), [S, H, 128]) and k after k_norm + RoPE
         ([S, 128]); for --dtype bf16 these are the bf16 values converted to fp32;
       - the first operand of its head-sum matmul: the per-head weights w = weights_proj(x).float() *
         H^-0.5 ([S, H], fp32);
       - the input and output of its topk: HF's index scores [S, S] (fp32, masked) and its indices.
     HF 5.17 computes score[s, t] = sum_h w[s, h] * relu(softmax_scale * q[s, h] . k[t]) with softmax_scale =
     128^-0.5. Since relu(c x) = c relu(x) for c > 0, this is
         score[t] = weight_scale * sum_h w[h] * relu(q[h] . k[t]),   weight_scale = softmax_scale,
     with w exactly HF's weights (the n_heads^-0.5 factor inside w). The script verifies this against HF's
     own scores: max |HF - formula| <= 1e-3 * max |score| (as asked) and, tighter, every visible entry
     within HF's fp32 rounding bound T below. torch.topk returns min(index_topk, S) indices per row; for a
     row at position p with p + 1 < K the ones past the visible keys point at masked (-inf) keys in no
     particular order; those are dropped (HF's set = its visible indices; p + 1 of them).
     --query-lens Q < S: the rows are the last Q of the full prefill (positions S-Q..S-1); the rows of a
     prefill are independent, and the keys before S-Q are what a cache would hold, so this equals a chunk
     continuing a cached prefix.
  2. Files in --dir (raw little-endian, C order; request-major):
       meta.json       {"heads": H, "top_k": K, "weight_scale": s, "seq_lens": [...], "query_lens": [...]}
       keys.f32        float32 [sum(seq_lens), 128]: row cu_keys[r] + p = position p of request r
       q.f32           float32 [sum(query_lens), H, 128]: row cu_rows[r] + j = position S_r - Q_r + j
       w.f32           float32 [sum(query_lens), H]
       hf_topk.i32     int32 [sum(query_lens), K]: HF's visible indices, HF's order (best first), -1 after
       hf_scores.f32   float32, per request [Q_r, S_r] concatenated: HF's scores, -inf where masked
       hf_info.json    how the files were made (versions, dtype, seed, config), for the record only
  3. decodepack half: `DECODEPACK indexer-run BUNDLE --inputs DIR [--extra ...]` must exit 0 (its own GPU vs
     CPU-reference check passed) and leave in DIR:
       dp_topk.i32     int32 [sum(query_lens), K]: positions within the request, best first, -1 padding
       dp_keys.f32     float32 [sum(seq_lens), 128]: its MXFP4 cache read back and dequantised
       dp_q.f32        optional, float32 [sum(query_lens), H, 128]: the query values it scored with, when it
                       rounds q (e.g. to MXFP4, key.h's "query heads on the FP4 path"); without it q is HF's
  4. Checks (float64; figures with a limit, and the yes/no checks, gate; exit 1 on any failure; the rest
     of the table is information):
     a. keys: finite; equal to key.h's quantiser (numpy, written here from key.h: e = ceil(log2(max(amax,
        1e-4) / 6)) exactly, E2M1 nearest with ties to the even code); |k - k'| <= 2^e per 32-value group
        (half the largest E2M1 step) and <= half the E2M1 step at |k| / 2^e (0.25 up to 2, 0.5 up to 4, 1
        up to 6) times 2^e. Both ratios are printed.
     b. scores: |hf_t - d_t| <= B_t + T_t and <= B2_t + T_t for every visible (row, t), where
        d_t = s sum_h w_h relu(q'_h . k'_t) is the score on decodepack's keys (dp_score).
     c. top-k: dp_topk well formed (distinct positions in 0..p, -1 only after them; a row with p + 1 < K holds
        exactly 0..p); overlap |HF n DP| / min(K, p + 1) per row (mean, min: figures, no gate); every
        disagreement explained: for i in HF\\DP and j in DP\\HF, hf_i - hf_j <= A_i + A_j, with
        A = B + T + tie part, and again with B2 in place of B.
     d. decodepack's own choice: the top-k of d (ties to the lower position) against dp_topk: the same set,
        except swaps (i out, j in) with d_i - d_j <= tie(i, j); and dp_topk in descending d up to tie(a, b).

Why the bounds hold (u = 2^-24, gamma_n = n u / (1 - n u), D = 128, H heads, s = weight_scale > 0,
q, k, w the dumped HF operands, q' = dp_q or q, k' = dp_keys):
  e_t  = s sum_h w_h relu(q_h . k_t)          HF's formula in exact arithmetic on HF's own operands
  d_t  = s sum_h w_h relu(q'_h . k'_t)        the same on decodepack's operands
  M_t  = s sum_h |w_h| sum_d |q_hd k_td|      M'_t likewise with q', k'
  B_t  = s sum_h |w_h| sum_d (|q_hd| |k_td - k'_td| + |q_hd - q'_hd| |k'_td|)    (the bound asked for)
  B2_t = s sum_h |w_h| |q_h . k_t - q'_h . k'_t|                                  (per-head bound)
  T_t  = gamma_(D+H+2) M_t + 1e-12 (M_t + M'_t)
  - |e_t - d_t| <= B2_t <= B_t: relu is 1-Lipschitz, so each head moves by at most |q.k - q'.k'|, which is
    at most sum_d |q||k - k'| + |q - q'||k'|; the factor s |w_h| and the head sum follow by the triangle
    inequality. Nothing is assumed of the quantiser. B assumes every element's error points the same way
    and is ~40x the actual difference with random data, too loose to catch a wrong selection; B2 keeps each
    head's dot product exact (it can come close to the actual difference when one head dominates).
  - |hf_t - e_t| <= T_t: HF evaluates e_t in fp32 on exactly these operands (bf16 values are exact in
    fp32): a D-term dot product (error <= gamma_D sum |q k|, whatever the summation order, FMA or split-K),
    the multiply by softmax_scale (fp32 rounding of the constant and of the product: 2u), relu (exact), the
    H-term weighted sum (gamma_H relative to sum |w_h| relu(.)), and the masked_fill / + 0 of a visible entry
    (exact); gamma_a + gamma_b + gamma_a gamma_b <= gamma_(a+b). TF32 is switched off before HF runs. The
    1e-12 term covers this script's own float64 evaluation. For D = 128, H = 16: T ~ 8.7e-6 M. This is why
    no bf16 allowance is needed: the bf16 rounding of q and k happened before the dumped operands, so it is
    the same on both sides.
  - Hence |hf_t - d_t| <= B2_t + T_t <= B_t + T_t (check b).
  - decodepack's GPU evaluates d_t in fp32 (dequantised keys are exact in fp32): g_t within
    G_t = gamma_(D+H+2) M'_t of d_t. Two keys a, b are within decodepack's rounding of a tie when
    |d_a - d_b| <= tie(a, b) = 1e-5 (|d_a| + |d_b|) + G_a + G_b (1e-5 relative for fp32 accumulation as
    agreed, written as a sum so that it splits into a part per key; G for cancellation between heads of
    opposite sign; G ~ 8.7e-6 M' for H = 16). Check d.
  - If decodepack kept j and dropped i while HF kept i and dropped j: d_i - d_j <= tie(i, j) (g_j >= g_i),
    hf_i <= d_i + B_i + T_i and hf_j >= d_j - B_j - T_j, so hf_i - hf_j <= B_i + T_i + B_j + T_j + tie(i, j)
    (likewise with B2). A swap beyond that is not explained by the key quantisation (check c). Given b,
    check d implies c; c is the statement in HF's terms. The top-k overlap is the figure that tells how
    much FP4 keys change the selection.

Usage
  hf_indexer_check.py --decodepack build/dev/tools/decodepack --bundle B.dpk --dir /tmp/idx [--heads 16]
                      [--top-k 64] [--seq-lens 1,37,64,129,300] [--query-lens ...] [--dtype bf16|fp32]
                      [--extra="--world 2"]
  hf_indexer_check.py --self-test [--dir D] [--emulate-fp4-q]   steps 1, 2 and 4, with a numpy MXFP4
                      quantiser and an exact float64 top-k standing in for decodepack (no binary, no GPU
                      needed with --device cpu; still needs torch and transformers)
  hf_indexer_check.py --check-only --dir D   step 4 on files already in D (numpy only)
Exit codes: 0 pass, 1 a check failed (or decodepack exited non-zero), 2 usage/setup error, 77 skipped (no
torch, no transformers with DeepseekV32Indexer, or no CUDA GPU for --device cuda).
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

try:
    import numpy as np
except ImportError:  # numpy is needed by every mode
    print("SKIPPED: numpy is not installed")
    sys.exit(77)

SKIP = 77
HEAD_DIM = 128            # index_head_dim: values per key / per query head
GROUP = 32                # values per UE8M0 scale
AMAX_FLOOR = 1e-4         # key.h kAmaxFloor
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP32_U = 2.0 ** -24
F64_SLACK = 1e-12         # relative allowance for this script's own float64 sums
TIE_REL = 1e-5            # decodepack's fp32 accumulation, relative to |d| of each key of a pair
HF_FORMULA_REL = 1e-3     # HF's scores against the dumped formula, relative to max |score|


def gamma(n):
    return n * FP32_U / (1.0 - n * FP32_U)


def die(msg):
    print("ERROR: " + msg, file=sys.stderr)
    sys.exit(2)


def skip(msg):
    print("SKIPPED: " + msg)
    sys.exit(SKIP)


# ---- MXFP4 as compiler/indexer/key.h defines it (numpy) ---------------------------------------------------

def ue8m0_exponents(amax):
    """The smallest integer e with max(amax, 1e-4) <= 6 * 2^e, elementwise, computed exactly."""
    a = np.maximum(np.asarray(amax, dtype=np.float64), AMAX_FLOOR)
    e = np.ceil(np.log2(a / 6.0)).astype(np.int64)
    # log2 may be off by one near powers of two; 6 * 2^e is exact in float64, so these fix-ups are exact
    e = np.where(np.ldexp(6.0, e) < a, e + 1, e)
    e = np.where(np.ldexp(6.0, e - 1) >= a, e - 1, e)
    return e


def e2m1_round(v):
    """Magnitude code 0..7 of the E2M1 value nearest to |v| (|v| <= 6), ties to the even code."""
    a = np.abs(np.asarray(v, dtype=np.float64))
    dist = np.abs(a[..., None] - E2M1)
    best = dist == dist.min(axis=-1, keepdims=True)
    # at most two codes tie (adjacent ones); prefer the even one, otherwise take the only candidate
    pref = best * np.where(np.arange(8) % 2 == 0, 2, 1)
    return np.argmax(pref, axis=-1)


def mxfp4_roundtrip(x):
    """Quantise rows of 128 values to MXFP4 (key.h) and dequantise: returns (values float64, exponents
    [rows, 4]). Sign kept (a negative value that rounds to zero gives -0.0)."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] != HEAD_DIM:
        raise ValueError("MXFP4 rows must have %d values, got %s" % (HEAD_DIM, x.shape))
    if not np.isfinite(x).all():
        raise ValueError("MXFP4: non-finite input")
    g = x.reshape(x.shape[:-1] + (HEAD_DIM // GROUP, GROUP))
    e = ue8m0_exponents(np.abs(g).max(axis=-1))
    scaled = np.ldexp(g, -e[..., None])                    # exact: scaling by a power of two
    mag = E2M1[e2m1_round(scaled)]
    out = np.ldexp(np.where(np.signbit(g), -mag, mag), e[..., None])
    return out.reshape(x.shape), e


# ---- Files -----------------------------------------------------------------------------------------------

class Layout:
    """Request geometry: keys are request-major over seq_lens, query rows over query_lens."""

    def __init__(self, seq_lens, query_lens):
        self.seq_lens = list(seq_lens)
        self.query_lens = list(query_lens)
        self.cu_keys = np.concatenate([[0], np.cumsum(self.seq_lens)]).astype(np.int64)
        self.cu_rows = np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int64)
        self.cu_scores = np.concatenate(
            [[0], np.cumsum([q * s for q, s in zip(self.query_lens, self.seq_lens)])]).astype(np.int64)
        self.keys = int(self.cu_keys[-1])
        self.rows = int(self.cu_rows[-1])

    def positions(self, r):
        s, q = self.seq_lens[r], self.query_lens[r]
        return np.arange(s - q, s)


def write_raw(path, arr, dtype):
    np.ascontiguousarray(arr, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tofile(path)


def read_raw(path, dtype, shape):
    data = np.fromfile(path, dtype=np.dtype(dtype).newbyteorder("<"))
    n = int(np.prod(shape))
    if data.size != n:
        raise ValueError("%s: %d values, expected %d (shape %s)" % (path, data.size, n, tuple(shape)))
    return data.astype(dtype).reshape(shape)


def write_inputs(d, H, K, weight_scale, lay, keys, q, w, hf_topk, hf_scores, info):
    os.makedirs(d, exist_ok=True)
    meta = {"heads": H, "top_k": K, "weight_scale": weight_scale, "seq_lens": lay.seq_lens,
            "query_lens": lay.query_lens}
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    write_raw(os.path.join(d, "keys.f32"), keys, np.float32)
    write_raw(os.path.join(d, "q.f32"), q, np.float32)
    write_raw(os.path.join(d, "w.f32"), w, np.float32)
    write_raw(os.path.join(d, "hf_topk.i32"), hf_topk, np.int32)
    write_raw(os.path.join(d, "hf_scores.f32"), np.concatenate([s.ravel() for s in hf_scores]), np.float32)
    with open(os.path.join(d, "hf_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    # outputs of an earlier decodepack run would be checked against these new inputs: remove them
    for name in ("dp_topk.i32", "dp_keys.f32", "dp_q.f32"):
        p = os.path.join(d, name)
        if os.path.exists(p):
            os.remove(p)


class Inputs:
    """Everything in DIR that the checks read (numpy only)."""

    def __init__(self, d):
        with open(os.path.join(d, "meta.json")) as f:
            meta = json.load(f)
        self.H = int(meta["heads"])
        self.K = int(meta["top_k"])
        self.weight_scale = float(meta["weight_scale"])
        self.lay = Layout(meta["seq_lens"], meta["query_lens"])
        lay, H = self.lay, self.H
        self.keys = read_raw(os.path.join(d, "keys.f32"), np.float32, (lay.keys, HEAD_DIM))
        self.q = read_raw(os.path.join(d, "q.f32"), np.float32, (lay.rows, H, HEAD_DIM))
        self.w = read_raw(os.path.join(d, "w.f32"), np.float32, (lay.rows, H))
        self.hf_topk = read_raw(os.path.join(d, "hf_topk.i32"), np.int32, (lay.rows, self.K))
        flat = read_raw(os.path.join(d, "hf_scores.f32"), np.float32, (int(lay.cu_scores[-1]),))
        self.hf_scores = [flat[lay.cu_scores[r]:lay.cu_scores[r + 1]].reshape(lay.query_lens[r], lay.seq_lens[r])
                          for r in range(len(lay.seq_lens))]
        # decodepack's outputs: a missing or mis-sized file is a finding, reported by run_checks
        self.dp_errors = []
        self.dp_topk = self._dp(d, "dp_topk.i32", np.int32, (lay.rows, self.K), required=True)
        self.dp_keys = self._dp(d, "dp_keys.f32", np.float32, (lay.keys, HEAD_DIM), required=True)
        self.dp_q = self._dp(d, "dp_q.f32", np.float32, (lay.rows, H, HEAD_DIM), required=False)

    def _dp(self, d, name, dtype, shape, required):
        p = os.path.join(d, name)
        if not os.path.exists(p):
            if required:
                self.dp_errors.append("%s missing" % name)
            return None
        try:
            return read_raw(p, dtype, shape)
        except ValueError as e:
            self.dp_errors.append(str(e).replace(p, name))
            return None


# ---- Scores (float64) ------------------------------------------------------------------------------------

def exact_topk(scores, k):
    """Positions of the k largest scores, descending, ties to the lower position."""
    order = np.lexsort((np.arange(scores.size), -scores))
    return order[:k]


def request_terms(q, w, k, q2, k2, ws):
    """Per (row, key) of one request, all [Q, S] float64: e = ws sum_h w relu(q.k), d = the same with
    (q2, k2), two bounds on |e - d| (B: element by element, B2: per head) and the magnitudes M, M2."""
    Q, H, D = q.shape
    S = k.shape[0]
    q, w, k, q2, k2 = (np.asarray(a, dtype=np.float64) for a in (q, w, k, q2, k2))
    aw = np.abs(w)
    dk = np.abs(k - k2).T
    dq_same = np.array_equal(q, q2)
    out = {n: np.empty((Q, S)) for n in ("e", "d", "B", "B2", "M", "M2")}
    block = max(1, (1 << 22) // max(1, H * S))
    for b0 in range(0, Q, block):
        b1 = min(Q, b0 + block)
        n = b1 - b0
        qa = q[b0:b1].reshape(n * H, D)
        qb = q2[b0:b1].reshape(n * H, D)
        wb, awb = w[b0:b1], aw[b0:b1]

        def head_sum(weights, per_head):  # [n, H] x [n*H, S] -> [n, S]
            return ws * np.einsum("nh,nhs->ns", weights, per_head.reshape(n, H, S))

        dot_e, dot_d = qa @ k.T, qb @ k2.T
        out["e"][b0:b1] = head_sum(wb, np.maximum(dot_e, 0.0))
        out["d"][b0:b1] = head_sum(wb, np.maximum(dot_d, 0.0))
        out["B2"][b0:b1] = head_sum(awb, np.abs(dot_e - dot_d))
        bound = np.abs(qa) @ dk
        if not dq_same:
            bound += np.abs(qa - qb) @ np.abs(k2).T
        out["B"][b0:b1] = head_sum(awb, bound)
        out["M"][b0:b1] = head_sum(awb, np.abs(qa) @ np.abs(k).T)
        out["M2"][b0:b1] = head_sum(awb, np.abs(qb) @ np.abs(k2).T)
    return out


# ---- Report ----------------------------------------------------------------------------------------------

class Report:
    """Rows of (check, figure, limit, gate); prints a table and PASS/FAIL lines, decides the exit code."""

    def __init__(self):
        self.rows = []

    def figure(self, what, value, limit=None, ok=None, text=None):
        """A gate when `ok` is given (True/False), or when `limit` is given (value <= limit); else info."""
        gate = ok is not None or limit is not None
        if ok is None and limit is not None:
            ok = bool(np.isfinite(value)) and value <= limit
        self.rows.append({"what": what, "value": value, "limit": limit, "gate": gate, "ok": bool(ok) if gate
                          else True, "text": text})

    def failed(self):
        return [r for r in self.rows if r["gate"] and not r["ok"]]

    def print(self):
        width = max([len(r["what"]) for r in self.rows] + [10])
        print("\n%-*s  %14s  %10s  %s" % (width, "check", "figure", "limit", "status"))
        print("-" * (width + 42))
        for r in self.rows:
            if r["text"] is not None:
                fig = r["text"]
            elif isinstance(r["value"], (int, np.integer)):
                fig = str(int(r["value"]))
            else:
                fig = "%.4e" % r["value"]
            lim = "" if r["limit"] is None else "%.3g" % r["limit"]
            status = ("PASS" if r["ok"] else "FAIL") if r["gate"] else "info"
            print("%-*s  %14s  %10s  %s" % (width, r["what"], fig, lim, status))
        print()
        for r in self.rows:
            if r["gate"]:
                print("%s %s" % ("PASS" if r["ok"] else "FAIL", r["what"]))

    def as_json(self):
        return [{k: (float(v) if isinstance(v, (np.floating, np.integer)) else v) for k, v in r.items()}
                for r in self.rows]


# ---- Checks ----------------------------------------------------------------------------------------------

def check_hf_formula(inp, rep):
    """HF's own scores against weight_scale * sum_h w relu(q.k) on the dumped operands."""
    lay, n = inp.lay, HEAD_DIM + inp.H + 2
    max_diff, worst_ratio, max_abs = 0.0, 0.0, 0.0
    mask_ok = True
    for r in range(len(lay.seq_lens)):
        rows = slice(lay.cu_rows[r], lay.cu_rows[r + 1])
        k = inp.keys[lay.cu_keys[r]:lay.cu_keys[r + 1]]
        t = request_terms(inp.q[rows], inp.w[rows], k, inp.q[rows], k, inp.weight_scale)
        vis = np.arange(lay.seq_lens[r])[None, :] <= lay.positions(r)[:, None]
        hf = inp.hf_scores[r].astype(np.float64)
        mask_ok &= bool(np.isfinite(hf[vis]).all() and np.isneginf(hf[~vis]).all())
        diff = np.abs(hf - t["e"])[vis]
        tol = (gamma(n) * t["M"] + F64_SLACK * t["M"])[vis]
        max_abs = max(max_abs, float(np.abs(t["e"][vis]).max()))
        max_diff = max(max_diff, float(diff.max()))
        worst_ratio = max(worst_ratio, float((diff / np.maximum(tol, 1e-300)).max()))
    rep.figure("HF scores: finite where visible, -inf where masked", 0, ok=mask_ok, text="yes" if mask_ok else "no")
    rel = max_diff / max_abs if max_abs > 0 else max_diff
    rep.figure("HF scores vs formula: max|diff| / max|score|", rel, limit=HF_FORMULA_REL)
    rep.figure("HF scores vs formula: max |diff| / fp32 bound T", worst_ratio, limit=1.0)
    rep.figure("weight_scale", inp.weight_scale, text="%.9g" % inp.weight_scale)


def check_keys(inp, rep):
    """a. MXFP4 keys: finite, key.h's quantiser, error within half an E2M1 step."""
    k = inp.keys.astype(np.float64)
    kd = inp.dp_keys.astype(np.float64)
    finite = bool(np.isfinite(kd).all())
    rep.figure("a. dp_keys finite", 0, ok=finite, text="yes" if finite else "NO")
    if not finite:
        return
    ref, e = mxfp4_roundtrip(k)
    mismatch = int(np.count_nonzero(ref != kd))
    rep.figure("a. dp_keys elements off key.h's quantiser (numpy)", mismatch, ok=mismatch == 0,
               text="%d of %d" % (mismatch, kd.size))
    g = lambda a: a.reshape(a.shape[0], HEAD_DIM // GROUP, GROUP)  # noqa: E731
    scale = np.ldexp(1.0, e)[..., None]
    err = np.abs(g(k) - g(kd))
    a = np.abs(g(k)) / scale
    half_step = np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, 1.0))
    rep.figure("a. max |k - k'| / 2^e (half the largest step)", float((err / scale).max()), limit=1.0)
    rep.figure("a. max |k - k'| / (half step at |k|/2^e * 2^e)", float((err / (half_step * scale)).max()), limit=1.0)
    rel = float(np.linalg.norm(k - kd) / max(np.linalg.norm(k), 1e-300))
    rep.figure("a. ||k - k'|| / ||k|| (information)", rel)


def tie_tol(d, M2, n):
    """Per-candidate part of tie(a, b) <= tie_part(a) + tie_part(b): max(|d_a|, |d_b|) <= |d_a| + |d_b|."""
    return TIE_REL * np.abs(d) + gamma(n) * M2 + F64_SLACK * M2


def check_scores_and_topk(inp, rep):
    """b, c, d: scores within the bounds, top-k overlap and its explanation, decodepack's own choice."""
    lay, H, K, ws = inp.lay, inp.H, inp.K, inp.weight_scale
    n = HEAD_DIM + H + 2
    kd_all = inp.dp_keys.astype(np.float64)
    q2_all = inp.q if inp.dp_q is None else inp.dp_q
    bounds = ("B", "B2")
    b_ratio, b_viol = dict.fromkeys(bounds, 0.0), dict.fromkeys(bounds, 0)
    c_ratio, c_viol = dict.fromkeys(bounds, 0.0), dict.fromkeys(bounds, 0)
    b_diff, b_rel = 0.0, []
    overlaps, rows_disagree, malformed, hf_malformed = [], 0, [], []
    d_same, d_tie, d_viol, order_viol, d_ratio = 0, 0, 0, 0, 0.0
    per_request = []

    def well_formed(sel_row, want, p):
        sel = sel_row[:want]
        return (bool(np.all(sel_row[want:] == -1)) and bool(np.all((sel >= 0) & (sel <= p)))
                and np.unique(sel).size == want)

    for r in range(len(lay.seq_lens)):
        rows = slice(lay.cu_rows[r], lay.cu_rows[r + 1])
        k = inp.keys[lay.cu_keys[r]:lay.cu_keys[r + 1]]
        kd = kd_all[lay.cu_keys[r]:lay.cu_keys[r + 1]]
        t = request_terms(inp.q[rows], inp.w[rows], k, q2_all[rows], kd, ws)
        hf_all = inp.hf_scores[r].astype(np.float64)
        req_overlap = []
        for j, p in enumerate(lay.positions(r)):
            row, nvis = int(lay.cu_rows[r]) + j, int(p) + 1
            h = hf_all[j, :nvis]
            d, M, M2 = (t[x][j, :nvis] for x in ("d", "M", "M2"))
            T = gamma(n) * M + F64_SLACK * (M + M2)
            allow = {b: t[b][j, :nvis] + T for b in bounds}
            # b. scores
            diff = np.abs(h - d)
            b_diff = max(b_diff, float(diff.max()))
            b_rel.append(float(np.mean(diff / np.maximum(t["B"][j, :nvis], 1e-300))))
            for b in bounds:
                b_viol[b] += int(np.count_nonzero(diff > allow[b]))
                b_ratio[b] = max(b_ratio[b], float((diff / np.maximum(allow[b], 1e-300)).max()))
            # well-formed top-k lists (c): distinct visible positions first, -1 after
            want = min(K, nvis)
            if not well_formed(inp.dp_topk[row], want, p):
                malformed.append((r, int(p)))
                continue
            if not well_formed(inp.hf_topk[row], want, p):
                hf_malformed.append((r, int(p)))
                continue
            hf_sel, dp_sel = inp.hf_topk[row, :want], inp.dp_topk[row, :want]
            # c. overlap, and every swap explained by the bound
            req_overlap.append(np.intersect1d(hf_sel, dp_sel).size / want)
            tp = tie_tol(d, M2, n)
            only_hf, only_dp = np.setdiff1d(hf_sel, dp_sel), np.setdiff1d(dp_sel, hf_sel)
            if only_hf.size:
                rows_disagree += 1
                gap = h[only_hf][:, None] - h[only_dp][None, :]
                for b in bounds:
                    room = (allow[b] + tp)[only_hf][:, None] + (allow[b] + tp)[only_dp][None, :]
                    c_viol[b] += int(np.count_nonzero(gap > room))
                    c_ratio[b] = max(c_ratio[b], float((gap / np.maximum(room, 1e-300)).max()))
            # d. decodepack's choice against the exact top-k of d (ties to the lower position)
            ref = exact_topk(d, want)
            miss = np.setdiff1d(ref, dp_sel)
            if miss.size == 0:
                d_same += 1
            else:
                extra = np.setdiff1d(dp_sel, ref)
                gap = d[miss][:, None] - d[extra][None, :]
                room = tp[miss][:, None] + tp[extra][None, :]
                bad = int(np.count_nonzero(gap > room))
                d_viol += bad
                d_tie += int(bad == 0)
                d_ratio = max(d_ratio, float((gap / np.maximum(room, 1e-300)).max()))
            # best first: d never rises by more than tie(a, b) along the list
            rise = d[dp_sel[1:]] - d[dp_sel[:-1]]
            order_viol += int(np.count_nonzero(rise > tp[dp_sel[1:]] + tp[dp_sel[:-1]]))
        overlaps += req_overlap
        per_request.append((lay.seq_lens[r], lay.query_lens[r], req_overlap))

    checked = lay.rows - len(malformed) - len(hf_malformed)
    rep.figure("b. max |hf - d| (absolute)", b_diff)
    rep.figure("b. mean |hf - d| / B (how loose B is)", float(np.mean(b_rel)))
    rep.figure("b. max |hf - d| / (B + T)", b_ratio["B"], limit=1.0)
    rep.figure("b. max |hf - d| / (B2 + T), per-head bound", b_ratio["B2"], limit=1.0)
    rep.figure("b. entries beyond B + T, B2 + T", 0, text="%d, %d" % (b_viol["B"], b_viol["B2"]))
    rep.figure("c. dp_topk rows malformed", len(malformed), ok=not malformed,
               text="%d%s" % (len(malformed), " e.g. (req, pos) %s" % (malformed[:3],) if malformed else ""))
    rep.figure("c. hf_topk rows malformed", len(hf_malformed), ok=not hf_malformed,
               text="%d%s" % (len(hf_malformed), " e.g. (req, pos) %s" % (hf_malformed[:3],) if hf_malformed else ""))
    if overlaps:
        rep.figure("c. top-k overlap, mean", float(np.mean(overlaps)))
        rep.figure("c. top-k overlap, min", float(np.min(overlaps)))
        full = sum(o == 1.0 for o in overlaps)
        rep.figure("c. rows with full overlap", full, text="%d of %d" % (full, len(overlaps)))
    rep.figure("c. rows whose sets differ", rows_disagree)
    rep.figure("c. swaps: max (hf_i - hf_j) / allowance with B", c_ratio["B"], limit=1.0)
    rep.figure("c. swaps: max (hf_i - hf_j) / allowance with B2", c_ratio["B2"], limit=1.0)
    rep.figure("c. swaps not explained with B, with B2", 0, text="%d, %d" % (c_viol["B"], c_viol["B2"]))
    rep.figure("d. rows: same set as exact top-k of d", d_same, text="%d of %d" % (d_same, checked))
    rep.figure("d. rows differing only within fp32 ties", d_tie)
    rep.figure("d. swaps: max (d_i - d_j) / tie(i, j)", d_ratio, limit=1.0)
    rep.figure("d. swaps beyond the tie tolerance", d_viol)
    rep.figure("d. dp_topk order rises beyond tie tolerance", order_viol, ok=order_viol == 0)
    return per_request


def run_checks(d):
    """Every check on the files in d; returns the Report (not yet printed)."""
    inp = Inputs(d)
    rep = Report()
    print("checks on %s: %d requests, %d keys, %d query rows, H %d, K %d%s" % (
        d, len(inp.lay.seq_lens), inp.lay.keys, inp.lay.rows, inp.H, inp.K,
        ", decodepack's q (dp_q.f32)" if inp.dp_q is not None else ""))
    check_hf_formula(inp, rep)
    ok = not inp.dp_errors
    rep.figure("decodepack outputs readable (dp_topk, dp_keys, dp_q)", 0, ok=ok,
               text="yes" if ok else "; ".join(inp.dp_errors))
    if not ok:
        return rep
    check_keys(inp, rep)
    per_request = check_scores_and_topk(inp, rep)
    print("\nper request: seq_len query_len  overlap mean   min")
    for S, Q, ov in per_request:
        if ov:
            print("  %7d %9d  %12.4f  %.4f" % (S, Q, np.mean(ov), np.min(ov)))
        else:
            print("  %7d %9d  %12s" % (S, Q, "-"))
    return rep


# ---- Stand-in for decodepack (--self-test) ----------------------------------------------------------------

def emulate_decodepack(d, fp4_q=False):
    """What `decodepack indexer-run` writes, from key.h's quantiser and an exact float64 top-k."""
    inp = Inputs(d)
    lay, K = inp.lay, inp.K
    kd, _ = mxfp4_roundtrip(inp.keys)
    q2 = inp.q.astype(np.float64)
    if fp4_q:
        q2, _ = mxfp4_roundtrip(q2.reshape(-1, HEAD_DIM))
        q2 = q2.reshape(inp.q.shape)
        write_raw(os.path.join(d, "dp_q.f32"), q2, np.float32)
    topk = np.full((lay.rows, K), -1, dtype=np.int32)
    for r in range(len(lay.seq_lens)):
        rows = slice(lay.cu_rows[r], lay.cu_rows[r + 1])
        kr = kd[lay.cu_keys[r]:lay.cu_keys[r + 1]]
        t = request_terms(q2[rows], inp.w[rows], kr, q2[rows], kr, inp.weight_scale)
        for j, p in enumerate(lay.positions(r)):
            sel = exact_topk(t["e"][j, :p + 1], K)
            topk[lay.cu_rows[r] + j, :sel.size] = sel
    write_raw(os.path.join(d, "dp_keys.f32"), kd, np.float32)
    write_raw(os.path.join(d, "dp_topk.i32"), topk, np.int32)


# ---- HF half (torch) --------------------------------------------------------------------------------------

def import_hf():
    try:
        import torch
    except ImportError:
        skip("PyTorch is not installed")
    try:
        import transformers
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hfm
        from transformers import DeepseekV32Config
    except Exception as e:  # ImportError, or an older transformers without the model
        skip("transformers with DeepseekV32Indexer is not importable (%s)" % e)
    if not hasattr(hfm, "DeepseekV32Indexer"):
        skip("transformers %s has no DeepseekV32Indexer" % transformers.__version__)
    return torch, transformers, hfm, DeepseekV32Config


def fp32_ieee(torch):
    """No TF32 anywhere: HF's fp32 matmuls must be fp32 for the bound T to hold."""
    if hasattr(torch.backends, "fp32_precision"):  # PyTorch 2.9+
        torch.backends.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")


def make_config(DeepseekV32Config, H, K, max_pos, attn_impl):
    cfg = DeepseekV32Config(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        kv_lora_rank=64, q_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        index_n_heads=H, index_head_dim=HEAD_DIM, index_topk=K, max_position_embeddings=max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = attn_impl
    return cfg


def hf_causal_mask(torch, cfg, x, pos):
    """The 4D mask DeepseekV32Model builds (create_causal_mask with allow_is_causal_skip=False)."""
    from transformers.masking_utils import create_causal_mask
    m = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None,
                           position_ids=pos, allow_is_causal_skip=False)
    if not isinstance(m, torch.Tensor) or m.dim() != 4:
        die("create_causal_mask returned %r, expected a 4D tensor" % type(m))
    S = x.shape[1]
    tril = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
    visible = m[0, 0] if m.dtype == torch.bool else m[0, 0] == 0
    if not torch.equal(visible, tril) or (m.dtype != torch.bool and not (m[0, 0][~tril] < -1e30).all()):
        die("HF's causal mask is not 'position p sees 0..p'")
    return m


def hf_generate(args):
    """Runs HF's indexer on every request; returns (weight_scale, layout, keys, q, w, hf_topk, hf_scores, info)."""
    torch, transformers, hfm, DeepseekV32Config = import_hf()
    from torch.overrides import TorchFunctionMode

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        skip("no CUDA device visible (use --device cpu for --self-test without a GPU)")
    fp32_ieee(torch)
    dev = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    H, K, D = args.heads, args.top_k, HEAD_DIM
    lay = Layout(args.seq_lens, args.query_lens)
    cfg = make_config(DeepseekV32Config, H, K, max(4096, max(lay.seq_lens)), args.attn_implementation)

    gen = torch.Generator().manual_seed(args.seed)
    indexer = hfm.DeepseekV32Indexer(cfg, 0)
    with torch.no_grad():
        for lin in (indexer.wq_b, indexer.wk, indexer.weights_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * args.init_std)
        if not isinstance(indexer.k_norm, torch.nn.LayerNorm):
            die("HF's k_norm is %s, expected nn.LayerNorm" % type(indexer.k_norm).__name__)
        indexer.k_norm.weight.copy_(1 + 0.25 * torch.randn(D, generator=gen))
        indexer.k_norm.bias.copy_(0.1 * torch.randn(D, generator=gen))
    indexer = indexer.to(dev).eval()
    for m in (indexer.wq_b, indexer.wk, indexer.k_norm):  # weights_proj stays fp32, as
        m.to(dtype)                                       # _keep_in_fp32_modules keeps it in a loaded model
    rotary = hfm.DeepseekV32RotaryEmbedding(cfg).to(dev)
    weight_scale = float(indexer.softmax_scale)
    if abs(weight_scale - D ** -0.5) > 1e-12 or indexer.n_heads != H or indexer.head_dim != D:
        die("unexpected indexer geometry: softmax_scale %r, n_heads %r, head_dim %r"
            % (weight_scale, indexer.n_heads, indexer.head_dim))

    class Spy(TorchFunctionMode):
        """Keeps the operands of every matmul and the input/output of every topk, passes all through."""

        def __init__(self):
            super().__init__()
            self.matmuls, self.topks = [], []

        def __torch_function__(self, func, types, args_=(), kwargs=None):
            out = func(*args_, **(kwargs or {}))
            if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
                self.matmuls.append((args_[0], args_[1]))
            elif func in (torch.topk, torch.Tensor.topk):
                self.topks.append((args_[0], out))
            return out

    keys, qs, ws_, topks, scores = [], [], [], [], []
    for r, (S, Q) in enumerate(zip(lay.seq_lens, lay.query_lens)):
        x = torch.randn(1, S, cfg.hidden_size, generator=gen).to(dev, dtype)
        q_resid = torch.randn(1, S, cfg.q_lora_rank, generator=gen).to(dev, dtype)
        pos = torch.arange(S, device=dev)[None]
        cos, sin = rotary(x, pos)
        mask = hf_causal_mask(torch, cfg, x, pos)
        spy = Spy()
        with torch.no_grad(), spy:
            ret = indexer(x, q_resid, (cos, sin), mask[:, 0, :, :], pos, past_key_values=None)

        qk = [(a, b) for a, b in spy.matmuls if tuple(a.shape) == (1, S, H, D) and tuple(b.shape) == (1, 1, D, S)]
        hw = [(a, b) for a, b in spy.matmuls if tuple(a.shape) == (1, S, 1, H) and tuple(b.shape) == (1, S, H, S)]
        tk = [(a, o) for a, o in spy.topks if tuple(a.shape) == (1, S, S)]
        if len(qk) != 1 or len(hw) != 1 or len(tk) != 1:
            die("request %d: HF's indexer forward is not the one this script knows (transformers %s): matmuls "
                "%s, topk inputs %s" % (r, transformers.__version__,
                                         [(tuple(a.shape), tuple(b.shape)) for a, b in spy.matmuls],
                                         [tuple(a.shape) for a, _ in spy.topks]))
        q_op, kT_op = qk[0]
        w_op = hw[0][0]
        s_in, s_out = tk[0]
        if q_op.dtype != torch.float32 or kT_op.dtype != torch.float32 or w_op.dtype != torch.float32 \
                or s_in.dtype != torch.float32:
            die("HF's score operands are not fp32 (%s, %s, %s, %s)" % (q_op.dtype, kT_op.dtype, w_op.dtype,
                                                                          s_in.dtype))
        ret = ret[0] if isinstance(ret, tuple) else ret
        if not torch.equal(ret.long(), s_out.indices.long()):
            die("request %d: HF's returned indices differ from its topk's" % r)

        rows = slice(S - Q, S)
        k_np = kT_op[0, 0].transpose(0, 1).contiguous().cpu().numpy()
        q_np = q_op[0, rows].cpu().numpy()
        w_np = w_op[0, rows, 0, :].cpu().numpy()
        s_np = s_in[0, rows].cpu().numpy().astype(np.float32)
        vis = np.arange(S)[None, :] <= np.arange(S - Q, S)[:, None]
        s_np[~vis] = -np.inf  # HF's masked entries are -inf (sdpa) or finfo.min + score (eager)
        idx = s_out.indices[0, rows].cpu().numpy()
        hf_topk = np.full((Q, K), -1, dtype=np.int32)
        for j, p in enumerate(range(S - Q, S)):
            sel = idx[j][idx[j] <= p]  # drop the masked keys torch.topk fills short rows with
            hf_topk[j, :sel.size] = sel[:K]
        keys.append(k_np)
        qs.append(q_np)
        ws_.append(w_np)
        topks.append(hf_topk)
        scores.append(s_np)
        del spy, q_op, kT_op, w_op, s_in, s_out

    info = {"transformers": transformers.__version__, "torch": torch.__version__, "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": args.dtype, "seed": args.seed, "init_std": args.init_std,
            "attn_implementation": args.attn_implementation, "hidden_size": cfg.hidden_size,
            "q_lora_rank": cfg.q_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "index_n_heads": H, "index_head_dim": D, "index_topk": K,
            "score": "weight_scale * sum_h w[h] * relu(q[h] . k[t]); weight_scale = softmax_scale = 128^-0.5, "
                     "w = weights_proj(x).float() * n_heads^-0.5",
            "hf_scores_layout": "per request [query_len, seq_len] float32, -inf where masked, concatenated"}
    return (weight_scale, lay, np.concatenate(keys), np.concatenate(qs), np.concatenate(ws_),
            np.concatenate(topks), scores, info)


# ---- Main ------------------------------------------------------------------------------------------------

def int_list(text, what):
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        die("%s: comma-separated integers expected" % what)
    return vals


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodepack", help="decodepack CLI (needed unless --self-test / --check-only)")
    ap.add_argument("--bundle", help="bundle built with an indexer of --heads heads and top-k --top-k")
    ap.add_argument("--dir", help="directory for the inputs and decodepack's outputs (default: a new temp dir)")
    ap.add_argument("--extra", default="",
                    help="further arguments for `decodepack indexer-run`, shell words; write --extra=\"--x y\" "
                         "when they start with a dash")
    ap.add_argument("--heads", type=int, default=16,
                    help="index_n_heads (default 16); the bundle must have been built with it (decodepack's "
                         "score kernel takes multiples of 8 up to 64)")
    ap.add_argument("--top-k", type=int, default=64, help="index_topk (default 64)")
    ap.add_argument("--seq-lens", default="1,37,64,129,300", help="keys per request (default 1,37,64,129,300)")
    ap.add_argument("--query-lens", help="query rows per request, each <= its seq len (default: = seq lens)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="HF indexer dtype (default bf16). decodepack's kernels read bf16 keys and q: with fp32 "
                         "it rounds them, so its keys differ from key.h's quantiser of the fp32 keys (check a) "
                         "and, unless it writes dp_q.f32, its scores from d (check d)")
    ap.add_argument("--device", default="cuda", help="torch device for HF (default cuda)")
    ap.add_argument("--attn-implementation", choices=("sdpa", "eager"), default="sdpa",
                    help="decides the mask HF builds: boolean (sdpa, default) or additive (eager)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.02, help="std of the random projection weights")
    ap.add_argument("--self-test", action="store_true",
                    help="no decodepack: a numpy MXFP4 quantiser and exact top-k stand in for it")
    ap.add_argument("--emulate-fp4-q", action="store_true",
                    help="with --self-test: the stand-in also rounds q to MXFP4 and writes dp_q.f32")
    ap.add_argument("--check-only", action="store_true", help="only the checks, on the files already in --dir")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.check_only:
        if not args.dir:
            die("--check-only needs --dir")
        return args
    if not args.self_test and not (args.decodepack and args.bundle):
        die("--decodepack and --bundle are needed unless --self-test or --check-only")
    if args.emulate_fp4_q and not args.self_test:
        die("--emulate-fp4-q goes with --self-test")
    args.seq_lens = int_list(args.seq_lens, "--seq-lens")
    if not args.seq_lens or min(args.seq_lens) < 1:
        die("--seq-lens: at least one request, each of at least 1 key")
    args.query_lens = int_list(args.query_lens, "--query-lens") if args.query_lens else list(args.seq_lens)
    if len(args.query_lens) != len(args.seq_lens) or any(not 1 <= q <= s for q, s in
                                                         zip(args.query_lens, args.seq_lens)):
        die("--query-lens: one per request, 1 <= query_len <= seq_len")
    if args.heads < 1 or args.top_k < 1:
        die("--heads and --top-k must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.check_only:
        return finish(run_checks(args.dir), args.json)
    d = args.dir or tempfile.mkdtemp(prefix="hf-indexer-")
    os.makedirs(d, exist_ok=True)

    weight_scale, lay, keys, q, w, hf_topk, hf_scores, info = hf_generate(args)
    write_inputs(d, args.heads, args.top_k, weight_scale, lay, keys, q, w, hf_topk, hf_scores, info)
    print("HF (transformers %s, %s, %s): %d requests, %d keys, %d query rows; inputs in %s"
          % (info["transformers"], info["device_name"], args.dtype, len(lay.seq_lens), lay.keys, lay.rows, d))

    dp_rc = 0
    if args.dtype == "fp32" and not args.self_test:
        print("note: fp32 inputs; decodepack's kernels read bf16 keys and q (see --help for --dtype)")
    if args.self_test:
        emulate_decodepack(d, fp4_q=args.emulate_fp4_q)
        print("self-test: numpy MXFP4 stand-in wrote dp_keys.f32, dp_topk.i32%s"
              % (", dp_q.f32" if args.emulate_fp4_q else ""))
    else:
        cmd = [args.decodepack, "indexer-run", args.bundle, "--inputs", d] + shlex.split(args.extra)
        print("running: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        try:
            proc = subprocess.run(cmd, check=False, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            die("cannot run %s: %s" % (args.decodepack, e))
        sys.stderr.write(proc.stderr)
        dp_rc = proc.returncode
        print("decodepack exited %d" % dp_rc)
        # Exit 8 for want of a second GPU or of NCCL (a DCP bundle on a one-GPU host) is a skip, not a failure.
        if dp_rc == 8 and re.search(r"this host has \d+ CUDA device|cannot open .*nccl", proc.stderr):
            print("SKIPPED: this host lacks the GPUs or NCCL the bundle's DCP world needs")
            sys.exit(SKIP)

    rep = run_checks(d)
    if not args.self_test:
        rep.figure("decodepack indexer-run exit status", dp_rc, ok=dp_rc == 0)
    return finish(rep, args.json)


def finish(rep, json_out=None):
    rep.print()
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rep.as_json(), f, indent=1)
    failed = rep.failed()
    if failed:
        print("\nFAIL: %d check(s): %s" % (len(failed), "; ".join(r["what"] for r in failed)))
        return 1
    print("\nPASS: %d checks" % sum(r["gate"] for r in rep.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
