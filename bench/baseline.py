#!/usr/bin/env python3
"""Stock-kernel baseline for `decodepack bench`: the same decode layers built from what a user without
decodepack has, timed the same way, written in the same JSON shape (manifests/bench-result.schema.json).

  baseline.py --model CONFIG.json [--widths 1,2,4,8] [--context 4096] [--replays 100] [--json OUT]
              [--moe auto|grouped|per-expert] [--seed S] [--no-step]

What a layer is built from (DESIGN.md section 9):
  projections, dense MLP, shared expert  cuBLAS through torch.nn.functional.linear; projections that share an
                                        input are one stacked weight (q/k/v/f_a/g_a/b; q/kv_a; gate/up)
  KDA step                              fla-core: causal_conv1d_update (on the requests' gathered conv
                                        states, scattered back), fused_recurrent_kda_fwd (gate, beta sigmoid and
                                        q/k L2 norm in the kernel, states updated in place in the pool by slot),
                                        rms_norm_gated (sigmoid output gate)
  MLA decode                            absorbed MLA in PyTorch over the paged latent cache: the requests' blocks
                                        gathered (index_select), bmm/einsum scores, fp32 softmax, W_UK/W_UV by
                                        bmm. FlashInfer's MLA decode is not used: its kernels JIT-compile with
                                        nvcc on first use (minutes), longer than the whole GPU run may take
  MoE                                   sigmoid router + correction bias + top-k in torch; experts either by
                                        torch._grouped_mm over the routed rows ("grouped") or one cuBLAS call per
                                        routed expert with the routing read at capture time ("per-expert");
                                        --moe auto times both and keeps the faster per class and width
  RMSNorms                              torch.nn.functional.rms_norm
Everything runs under CUDA graphs (torch.cuda.graph), L2-cold the way decodepack's bench is: every layer of a
class has its own weights and states and one graph replays them all. Weights and states are random (the same
distributions as `decodepack synth`), NOT decodepack's bytes: equal shapes, equal byte counts. Before anything
is timed, the first layer of each class at each width is checked against a float64 torch reference of the
same inputs and states (outputs 3e-2, KDA recurrent state max(1e-3, 2^-6 x its update), conv states and
MLA cache rows 2e-2: a stock bf16 path rounds after every op; a wrong layer is off by O(1)); a class that
fails is reported as failed and not timed. The HBM read ceiling of the same run is a read-bound torch reduction.

Exit 0 when every check passed, 5 when one failed, 77 without torch, a CUDA GPU or fla.
"""

import argparse
import json
import math
import sys

FORMAT = "decodepack-bench"
SKIP = 77
# The baseline's gate asks "does it compute the same layer", not "is it as accurate as decodepack": a stock bf16
# path rounds after every op, and at 48B shapes HF transformers' own bf16 layer is up to 1.5e-2 from float64
# (issue 14). A wrong layer is off by O(1). KDA state: max(1e-3, 2^-6 x its relative update in the step).
OUT_LIMIT = 3e-2
CACHE_LIMIT = 2e-2
BYTE_FIELDS = ["dense_weights", "expert_weights", "state_read", "state_write", "kv_read", "kv_write", "act_read",
               "act_write"]


# ---- the model config (HF config.json of model_type kimi_linear) -------------------------------------------

class Cfg:
    def __init__(self, j, where="config"):
        if j.get("model_type") != "kimi_linear":
            raise SystemExit("%s: model_type %r; the baseline builds kimi_linear layers" % (where, j.get("model_type")))
        if j.get("q_lora_rank") is not None:
            raise SystemExit("%s: q_lora_rank %r; Kimi-Linear MLA has a plain q_proj" % (where, j.get("q_lora_rank")))
        self.H = j["hidden_size"]
        self.layers = j["num_hidden_layers"]
        lac = j["linear_attn_config"]
        self.kda_layers = set(lac.get("kda_layers") or [])
        self.kh, self.kd, self.kconv = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        self.P = self.kh * self.kd
        self.rank = self.kd  # f_a / g_a width (head_dim in the released models)
        self.N, self.Lr = j["num_attention_heads"], j["kv_lora_rank"]
        self.Pn, self.R, self.V = j["qk_nope_head_dim"], j["qk_rope_head_dim"], j["v_head_dim"]
        self.E, self.topk, self.I = j["num_experts"], j["num_experts_per_token"], j["moe_intermediate_size"]
        self.shared = j.get("num_shared_experts", 1)
        self.rsf = j.get("routed_scaling_factor", 1.0)
        self.renorm = j.get("moe_renormalize", True)
        self.first_dense = j.get("first_k_dense_replace", 1)
        self.freq = j.get("moe_layer_freq", 1)
        self.Id = j["intermediate_size"]
        self.eps = j.get("rms_norm_eps", 1e-5)

    def mixer(self, i):
        return "kda" if (i + 1) in self.kda_layers else "mla"

    def ffn(self, i):
        return "moe" if i >= self.first_dense and (i - self.first_dense) % self.freq == 0 else "dense"

    def layer_class(self, i):
        return self.mixer(i) + "_" + self.ffn(i)


# ---- bytes a step must move (the same accounting as compiler/bench/bytes.h) ---------------------------------

def weight_shapes(cfg, i):
    """(shape, bytes per element, is_expert) of every weight layer i reads in decode, as the checkpoint has them."""
    H, P, r = cfg.H, cfg.P, cfg.rank
    w = [([H], 2, False), ([H], 2, False)]  # input / post-attention RMSNorm
    if cfg.mixer(i) == "kda":
        w += [([P, H], 2, False)] * 3 + [([P, 1, cfg.kconv], 4, False)] * 3
        w += [([r, H], 2, False), ([P, r], 2, False), ([P], 4, False), ([1, 1, cfg.kh, 1], 4, False),
              ([cfg.kh, H], 2, False), ([r, H], 2, False), ([P, r], 2, False), ([cfg.kd], 2, False), ([H, P], 2, False)]
    else:
        w += [([cfg.N * (cfg.Pn + cfg.R), H], 2, False), ([cfg.Lr + cfg.R, H], 2, False), ([cfg.Lr], 2, False),
              ([cfg.N * (cfg.Pn + cfg.V), cfg.Lr], 2, False), ([H, cfg.N * cfg.V], 2, False)]
    if cfg.ffn(i) == "dense":
        w += [([cfg.Id, H], 2, False)] * 2 + [([H, cfg.Id], 2, False)]
    else:
        Is = cfg.I * cfg.shared
        w += [([cfg.E, H], 2, False), ([cfg.E], 4, False)]
        w += [([cfg.I, H], 2, True)] * 2 + [([H, cfg.I], 2, True)]
        w += [([Is, H], 2, False)] * 2 + [([H, Is], 2, False)]
    return w


def layer_bytes(cfg, i, seq_lens, routed, q=1, state_elem=4, conv_elem=2, kv_elem=2):
    b = dict.fromkeys(BYTE_FIELDS, 0)
    for shape, elem, expert in weight_shapes(cfg, i):
        n = math.prod(shape) * elem
        if expert:
            b["expert_weights"] += routed * n
        else:
            b["dense_weights"] += n
    W = len(seq_lens)
    if cfg.mixer(i) == "kda":
        slot = cfg.kh * cfg.kd * cfg.kd * state_elem + 3 * cfg.P * (cfg.kconv - 1) * conv_elem
        b["state_read"], b["state_write"] = W * slot, W * q * slot
    else:
        row = (cfg.Lr + cfg.R) * kv_elem
        b["kv_read"], b["kv_write"] = sum(seq_lens) * row, W * q * row
    act = W * q * cfg.H * 2
    b["act_read"] = act * (2 if i > 0 else 1)
    b["act_write"] = 2 * act
    return b


def final_norm_bytes(cfg, rows):
    b = dict.fromkeys(BYTE_FIELDS, 0)
    b["dense_weights"] = cfg.H * 2
    b["act_read"] = b["act_write"] = 2 * rows * cfg.H * 2
    return b


def add_bytes(a, b):
    return {k: a[k] + b[k] for k in BYTE_FIELDS}


def with_total(b):
    return dict(b, total=sum(b[k] for k in BYTE_FIELDS))


# ---- the JSON document --------------------------------------------------------------------------------------

def summary(values):
    v = sorted(values)
    if not v:
        return {"n": 0, "median": 0.0, "p10": 0.0, "p90": 0.0, "min": 0.0, "max": 0.0, "mean": 0.0}

    def pct(p):
        pos = p * (len(v) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    return {"n": len(v), "median": pct(0.5), "p10": pct(0.1), "p90": pct(0.9), "min": v[0], "max": v[-1],
            "mean": sum(v) / len(v)}


def share(total_bytes, us, ceiling):
    return total_bytes / (us * 1e-6) / ceiling if us > 0 and ceiling > 0 else 0.0


def class_entry(cls, width, layers, status="ok", reason="", routed=(), us_per_layer=(), replay_us=0.0,
                byte_sum=None, ceiling=0.0):
    byte_sum = byte_sum or dict.fromkeys(BYTE_FIELDS, 0)
    n = max(1, len(layers))
    total = sum(byte_sum[k] for k in BYTE_FIELDS)
    return {"class": cls, "width": width, "status": status, "reason": reason, "layers": list(layers),
            "routed_experts": list(routed), "us_per_layer": summary(us_per_layer), "bytes": with_total(byte_sum),
            "bytes_per_layer": with_total({k: byte_sum[k] // n for k in BYTE_FIELDS}), "replay_bytes": total,
            "share": share(total, replay_us, ceiling) if status == "ok" else 0.0}


def step_entry(width, layers, status="ok", reason="", us=(), byte_sum=None, ceiling=0.0):
    byte_sum = byte_sum or dict.fromkeys(BYTE_FIELDS, 0)
    s = summary(us)
    total = sum(byte_sum[k] for k in BYTE_FIELDS)
    tps = 1e6 / s["median"] if status == "ok" and s["median"] > 0 else 0.0
    return {"width": width, "status": status, "reason": reason, "layers": layers, "us": s,
            "bytes": with_total(byte_sum), "share": share(total, s["median"], ceiling) if status == "ok" else 0.0,
            "tokens_per_s_per_request": tps, "tokens_per_s": tps * width}


def result_doc(implementation, version, model, device, context, replays, widths, ceiling_bytes, ceiling_us,
               ceiling_method, gate, classes, steps, notes):
    cs = summary(ceiling_us)
    return {"format": FORMAT, "format_version": 1, "implementation": implementation, "version": version,
            "bundle": "", "digest": "", "model": model,
            "weights": "random (torch, the distributions of decodepack synth; not decodepack's bytes)",
            "device": device, "target": "", "context": context, "replays": replays, "prefetch": False,
            "l2_bytes": 0, "sms": 0,
            "ceiling": {"method": ceiling_method, "bytes": ceiling_bytes, "us": cs,
                        "bytes_per_s": ceiling_bytes / (cs["median"] * 1e-6) if cs["median"] > 0 else 0.0},
            "launch_floor": {"kernels": 0, "graph_us": 0.0, "stream_us": 0.0},
            "widths": list(widths), "gate": gate, "classes": classes, "steps": steps, "kernels": [], "notes": notes}


# ---- the GPU part -------------------------------------------------------------------------------------------

def cpu_shims(torch, F):
    """Pure-torch stand-ins with fla's signatures and semantics, for --cpu-smoke only: they let the wiring,
    the float64 reference, the checks and the JSON run on a host without a GPU. The GPU run uses fla."""

    def causal_conv1d_update(x, cache, weight=None, activation=None):
        # fla: cache [N, D, W] holds the last W inputs, the newest last; y = act(sum(cache * weight)).
        new = torch.cat([cache[:, :, 1:], x[:, :, None].to(cache.dtype)], -1)
        y = (new.float() * weight.float()[None]).sum(-1)
        if activation in ("silu", "swish"):
            y = y * torch.sigmoid(y)
        cache.copy_(new)
        return y.to(x.dtype), cache

    def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                                inplace_final_state=True, cu_seqlens=None, ssm_state_indices=None,
                                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                use_beta_sigmoid_in_kernel=False, **_):
        _, T, H, K = q.shape
        out = torch.zeros_like(v)
        for t in range(T):  # one token per sequence (cu_seqlens = 0..T)
            qt, kt, vt, gt = q[0, t].float(), k[0, t].float(), v[0, t].float(), g[0, t].float()
            if use_qk_l2norm_in_kernel:
                qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
            qt = qt * scale
            if use_gate_in_kernel:
                gt = -torch.exp(A_log.float())[:, None] * F.softplus(gt + dt_bias.float().view(H, K))
            b = beta[0, t].float()
            if use_beta_sigmoid_in_kernel:
                b = torch.sigmoid(b)
            idx = int(ssm_state_indices[t])
            S = initial_state[idx].float() * torch.exp(gt)[..., None]
            u = b[:, None] * (vt - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[..., None] * u[:, None, :]
            out[0, t] = torch.einsum("hkv,hk->hv", S, qt).to(out.dtype)
            initial_state[idx] = S
        return out, initial_state

    def rms_norm_gated(x, g, weight, bias, activation="swish", eps=1e-6, **_):
        xf = x.float()
        y = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * weight.float()
        y = y * torch.sigmoid(g.float()) if activation == "sigmoid" else y * g.float() * torch.sigmoid(g.float())
        return y.to(x.dtype)

    return causal_conv1d_update, rms_norm_gated, fused_recurrent_kda_fwd


def run(args, cfg):
    import torch
    import torch.nn.functional as F
    if args.cpu_smoke:
        causal_conv1d_update, rms_norm_gated, fused_recurrent_kda_fwd = cpu_shims(torch, F)
        fla_version = "none (--cpu-smoke: pure-torch stand-ins)"
    else:
        try:
            from fla.modules.causal_conv1d.ops import causal_conv1d_update
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
            import fla
            fla_version = getattr(fla, "__version__", "?")
        except ImportError as e:
            print("SKIPPED: fla-core is not importable (%s): unzip .whl/fla_core-*.whl onto PYTHONPATH" % e)
            return SKIP, None

    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    gpu = not args.cpu_smoke
    bf, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    H = cfg.H

    def uni(shape, lo, hi, dtype=bf):
        return (torch.rand(shape, generator=gen, device=dev, dtype=f32) * (hi - lo) + lo).to(dtype)

    def linear_w(rows, cols):
        a = math.sqrt(3.0 / cols)
        return uni((rows, cols), -a, a)

    # -- weights and states of every layer (distinct per layer) --
    class Layer:
        pass

    W_max = max(args.widths)
    nblk_req = (args.context + 1 + 63) // 64
    layers = []
    for i in range(cfg.layers):
        p = Layer()
        p.i, p.cls, p.mixer, p.ffn = i, cfg.layer_class(i), cfg.mixer(i), cfg.ffn(i)
        p.ln1, p.ln2 = uni((H,), 0.9, 1.1), uni((H,), 0.9, 1.1)
        if p.mixer == "kda":
            P, r, h, d = cfg.P, cfg.rank, cfg.kh, cfg.kd
            p.w_proj = torch.cat([linear_w(P, H), linear_w(P, H), linear_w(P, H), linear_w(r, H), linear_w(r, H),
                                  linear_w(h, H)])
            p.w_fb, p.w_gb = linear_w(P, r), linear_w(P, r)
            p.conv_w = uni((3 * P, cfg.kconv), -0.5, 0.5, f32)
            p.dt_bias = uni((P,), -3.0, -1.0, f32)
            p.a_log = torch.log1p(15 * torch.rand((h,), generator=gen, device=dev))
            p.o_norm = uni((d,), 0.9, 1.1)
            p.w_o = linear_w(H, P)
            slots = 1 + 2 * W_max
            p.state = uni((slots, h, d, d), -1.0, 1.0, f32)
            p.conv = uni((slots, 3 * P, cfg.kconv), -1.0, 1.0)
        else:
            p.w_qkva = torch.cat([linear_w(cfg.N * (cfg.Pn + cfg.R), H), linear_w(cfg.Lr + cfg.R, H)])
            p.kv_ln = uni((cfg.Lr,), 0.9, 1.1)
            kv_b = linear_w(cfg.N * (cfg.Pn + cfg.V), cfg.Lr).view(cfg.N, cfg.Pn + cfg.V, cfg.Lr)
            p.w_uk = kv_b[:, :cfg.Pn, :].contiguous()                    # [N, Pn, L]: q_nope -> latent
            p.w_uv_t = kv_b[:, cfg.Pn:, :].transpose(1, 2).contiguous()  # [N, L, V]: latent -> v
            del kv_b
            p.w_o = linear_w(H, cfg.N * cfg.V)
            p.cache = uni((1 + W_max * nblk_req + 2, 64, cfg.Lr + cfg.R), -1.5, 1.5)
        if p.ffn == "dense":
            p.w_gu, p.w_down = torch.cat([linear_w(cfg.Id, H), linear_w(cfg.Id, H)]), linear_w(H, cfg.Id)
        else:
            Is = cfg.I * cfg.shared
            p.w_gate, p.bias = linear_w(cfg.E, H), uni((cfg.E,), -0.05, 0.05, f32)
            p.w13 = uni((cfg.E, 2 * cfg.I, H), -math.sqrt(3.0 / H), math.sqrt(3.0 / H))
            p.w2 = uni((cfg.E, H, cfg.I), -math.sqrt(3.0 / cfg.I), math.sqrt(3.0 / cfg.I))
            p.w_sgu, p.w_sdown = torch.cat([linear_w(Is, H), linear_w(Is, H)]), linear_w(H, Is)
            p.routing = None  # per-expert: (expert ids, row index tensors) frozen at capture
        layers.append(p)
    final_norm_w = uni((H,), 0.9, 1.1)

    # -- step metadata of one width: distinct random slots and blocks, every request at `context` tokens --
    class Meta:
        pass

    def make_meta(W):
        m = Meta()
        m.W = W
        perm = torch.randperm(2 * W_max, generator=gen, device=dev)[:W] + 1
        m.slots = perm.to(torch.int32)
        m.slots_long = perm.long()
        m.cu = torch.arange(W + 1, device=dev, dtype=torch.int32)
        blocks = (torch.randperm(W_max * nblk_req + 2, generator=gen, device=dev)[:W * nblk_req] + 1).view(W, nblk_req)
        m.block_table = blocks
        m.seq_len = args.context + 1
        pos = args.context
        m.slot_mapping = blocks[:, pos // 64] * 64 + pos % 64
        return m

    # -- the fast (stock) layer --
    def rms(x, w, eps=cfg.eps):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def kda_mixer(p, x, m):
        W, P, r, h, d = m.W, cfg.P, cfg.rank, cfg.kh, cfg.kd
        proj = F.linear(x, p.w_proj)
        qkv, fa, ga, b = proj[:, :3 * P], proj[:, 3 * P:3 * P + r], proj[:, 3 * P + r:3 * P + 2 * r], proj[:, 3 * P + 2 * r:]
        cst = p.conv.index_select(0, m.slots_long)
        y, cst = causal_conv1d_update(qkv.contiguous(), cst, weight=p.conv_w, activation="silu")
        p.conv.index_copy_(0, m.slots_long, cst)
        q, k, v = (t.contiguous().view(1, W, h, d) for t in y.view(W, 3 * P).split(P, -1))
        f = F.linear(fa, p.w_fb).view(1, W, h, d)
        gout = F.linear(ga, p.w_gb)
        o, _ = fused_recurrent_kda_fwd(q=q, k=k, v=v, g=f, beta=b.contiguous().view(1, W, h), A_log=p.a_log,
                                       dt_bias=p.dt_bias, scale=d ** -0.5, initial_state=p.state,
                                       inplace_final_state=True, cu_seqlens=m.cu, ssm_state_indices=m.slots,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True)
        o = rms_norm_gated(o.view(W * h, d), gout.view(W * h, d), p.o_norm, None, activation="sigmoid", eps=1e-5)
        return F.linear(o.view(W, P), p.w_o)

    def mla_mixer(p, x, m):
        W, N, Lr, R, Pn = m.W, cfg.N, cfg.Lr, cfg.R, cfg.Pn
        qkv = F.linear(x, p.w_qkva)
        q = qkv[:, :N * (Pn + R)].view(W, N, Pn + R)
        kv = qkv[:, N * (Pn + R):]
        row = torch.cat([rms(kv[:, :Lr], p.kv_ln), kv[:, Lr:]], -1)
        p.cache.view(-1, Lr + R).index_copy_(0, m.slot_mapping, row)
        ql = torch.bmm(q[..., :Pn].transpose(0, 1), p.w_uk).transpose(0, 1)           # [W, N, L]
        qf = torch.cat([ql, q[..., Pn:]], -1)                                           # [W, N, L+R]
        T = m.seq_len
        rows = p.cache.index_select(0, m.block_table.flatten()).view(W, -1, Lr + R)[:, :T]  # [W, T, L+R]
        s = torch.bmm(qf, rows.transpose(1, 2)).float() * (Pn + R) ** -0.5              # [W, N, T]
        pr = torch.softmax(s, -1).to(bf)
        olat = torch.bmm(pr, rows[..., :Lr])                                            # [W, N, L]
        o = torch.bmm(olat.transpose(0, 1), p.w_uv_t).transpose(0, 1)                  # [W, N, V]
        return F.linear(o.reshape(W, N * cfg.V), p.w_o)

    def route(p, x2):
        s = F.linear(x2, p.w_gate).float().sigmoid()
        ids = (s + p.bias).topk(cfg.topk, -1).indices
        w = s.gather(1, ids)
        if cfg.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * cfg.rsf

    def shared(p, x2):
        g, u = F.linear(x2, p.w_sgu).chunk(2, -1)
        return F.linear(F.silu(g) * u, p.w_sdown)

    def moe_grouped(p, x2):
        W = x2.shape[0]
        ids, w = route(p, x2)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        rows = order // cfg.topk
        xs = x2.index_select(0, rows)
        # Group ends without bincount (its output size is read back to the host, which a CUDA graph
        # cannot capture): offs[e] = assignments to experts <= e.
        counts = torch.zeros(cfg.E, device=flat.device, dtype=torch.int32)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0).to(torch.int32)
        h13 = torch._grouped_mm(xs, p.w13.transpose(1, 2), offs=offs)
        g, u = h13.chunk(2, -1)
        y = torch._grouped_mm((F.silu(g) * u).contiguous(), p.w2.transpose(1, 2), offs=offs)
        y = y.float() * w.flatten().index_select(0, order)[:, None]
        out = torch.zeros(W, H, device=dev, dtype=f32).index_add_(0, rows, y)
        return (out + shared(p, x2).float()).to(bf), ids

    def moe_per_expert(p, x2):
        W = x2.shape[0]
        ids, w = route(p, x2)
        if p.routing is None or not (gpu and torch.cuda.is_current_stream_capturing()):
            # Outside capture: the routing of these rows, read back (the graph keeps it).
            experts = {}
            for row, e in enumerate(ids.flatten().tolist()):
                experts.setdefault(e, []).append(row)
            p.routing = [(e, torch.tensor(rws, device=dev)) for e, rws in sorted(experts.items())]
        out = torch.zeros(W, H, device=dev, dtype=f32)
        wf = w.flatten()
        for e, rws in p.routing:
            xr = x2.index_select(0, rws // cfg.topk)
            g, u = F.linear(xr, p.w13[e]).chunk(2, -1)
            y = F.linear(F.silu(g) * u, p.w2[e]).float() * wf.index_select(0, rws)[:, None]
            out.index_add_(0, rws // cfg.topk, y)
        return (out + shared(p, x2).float()).to(bf), ids

    moe_impl = {"grouped": moe_grouped, "per-expert": moe_per_expert}

    def layer_fwd(p, m, h, res, moe):
        if res is None:
            res = h
        else:
            res = h + res
        x = rms(res, p.ln1)
        a = kda_mixer(p, x, m) if p.mixer == "kda" else mla_mixer(p, x, m)
        res = a + res
        x2 = rms(res, p.ln2)
        if p.ffn == "dense":
            g, u = F.linear(x2, p.w_gu).chunk(2, -1)
            return F.linear(F.silu(g) * u, p.w_down), res, None
        out, ids = moe_impl[moe](p, x2)
        return out, res, ids

    # -- the float64 reference of one layer (model-family.md 3.0-3.c) --
    def ref_layer(p, m, h, res, state, conv, cache, ids_fast):
        d64 = lambda t: t.to(f64)  # noqa: E731
        res = d64(h) + (d64(res) if res is not None else 0)

        def rms64(x, w, eps=cfg.eps):
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * d64(w)

        x = rms64(res, p.ln1)
        W = m.W
        if p.mixer == "kda":
            P, r, h_, d = cfg.P, cfg.rank, cfg.kh, cfg.kd
            proj = x @ d64(p.w_proj).T
            qkv, fa, ga, b = proj[:, :3 * P], proj[:, 3 * P:3 * P + r], proj[:, 3 * P + r:3 * P + 2 * r], proj[:, 3 * P + 2 * r:]
            sl = m.slots_long
            hist = d64(conv[sl])                                       # [W, 3P, K]: the last K-1 inputs in 1..K-1
            win = torch.cat([hist[:, :, 1:], qkv[:, :, None]], -1)
            y = (win * d64(p.conv_w)[None]).sum(-1)
            y = y * torch.sigmoid(y)
            conv_new = win
            q, k, v = (t.view(W, h_, d) for t in y.split(P, -1))
            q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
            k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            f = (fa @ d64(p.w_fb).T).view(W, h_, d)
            alpha = -torch.exp(d64(p.a_log))[None, :, None] * F.softplus(f + d64(p.dt_bias).view(h_, d)[None])
            beta = torch.sigmoid(b)                                    # [W, h]
            S = d64(state[sl])                                         # [W, h, K, V]
            S = S * torch.exp(alpha)[..., None]
            u = beta[..., None] * (v - torch.einsum("whkv,whk->whv", S, k))
            S = S + k[..., None] * u[..., None, :]
            o = torch.einsum("whkv,whk->whv", S, q)
            gout = (ga @ d64(p.w_gb).T).view(W, h_, d)
            o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + 1e-5) * d64(p.o_norm) * torch.sigmoid(gout)
            a = o.reshape(W, P) @ d64(p.w_o).T
            extra = (S, conv_new)
        else:
            N, Lr, R, Pn = cfg.N, cfg.Lr, cfg.R, cfg.Pn
            qkv = x @ d64(p.w_qkva).T
            q = qkv[:, :N * (Pn + R)].view(W, N, Pn + R)
            kv = qkv[:, N * (Pn + R):]
            row = torch.cat([rms64(kv[:, :Lr], p.kv_ln), kv[:, Lr:]], -1)
            c = d64(cache).view(-1, Lr + R).clone()
            c[m.slot_mapping] = row
            ql = torch.einsum("wnp,npl->wnl", q[..., :Pn], d64(p.w_uk))
            T = m.seq_len
            rows = c.view(-1, 64, Lr + R)[m.block_table].view(W, -1, Lr + R)[:, :T]
            s = (torch.einsum("wnl,wtl->wnt", ql, rows[..., :Lr]) +
                 torch.einsum("wnr,wtr->wnt", q[..., Pn:], rows[..., Lr:])) * (Pn + R) ** -0.5
            olat = torch.einsum("wnt,wtl->wnl", torch.softmax(s, -1), rows[..., :Lr])
            o = torch.einsum("wnl,nlv->wnv", olat, d64(p.w_uv_t))
            a = o.reshape(W, N * cfg.V) @ d64(p.w_o).T
            extra = (row,)
        res = a + res
        x2 = rms64(res, p.ln2)
        if p.ffn == "dense":
            gu = x2 @ d64(p.w_gu).T
            g, u = gu.chunk(2, -1)
            return (g * torch.sigmoid(g) * u) @ d64(p.w_down).T, res, extra
        s = torch.sigmoid(x2 @ d64(p.w_gate).T)
        sel = s + d64(p.bias)
        top = sel.topk(cfg.topk + 1, -1)
        ids = top.indices[:, :cfg.topk]
        near = (top.values[:, cfg.topk - 1] - top.values[:, cfg.topk]) < 1e-3
        ids = torch.where(near[:, None], ids_fast.to(ids.dtype), ids)  # a near tie may go either way
        w = s.gather(1, ids)
        if cfg.renorm:
            w = w / w.sum(-1, keepdim=True)
        w = w * cfg.rsf
        out = torch.zeros_like(x2)
        for t in range(W):
            for j in range(cfg.topk):
                e = int(ids[t, j])
                g, u = (x2[t] @ d64(p.w13[e]).T).chunk(2, -1)
                out[t] += w[t, j] * ((g * torch.sigmoid(g) * u) @ d64(p.w2[e]).T)
        gu = x2 @ d64(p.w_sgu).T
        g, u = gu.chunk(2, -1)
        out = out + (g * torch.sigmoid(g) * u) @ d64(p.w_sdown).T
        return out, res, extra

    def rel(a, b):
        a, b = a.to(f64), b.to(f64)
        den = torch.linalg.vector_norm(b)
        return float(torch.linalg.vector_norm(a - b) / den) if den > 0 else float(torch.linalg.vector_norm(a))

    def check(p, m, moe):
        """The fast layer against the float64 reference, from the same inputs and states. -> failures"""
        h = uni((m.W, H), -1.0, 1.0)
        res = uni((m.W, H), -1.0, 1.0) if p.i > 0 else None
        before = {}
        if p.mixer == "kda":
            before = {"state": p.state.clone(), "conv": p.conv.clone()}
        else:
            before = {"cache": p.cache.clone()}
        p.routing = None
        out, res_out, ids = layer_fwd(p, m, h, res, moe)
        if gpu:
            torch.cuda.synchronize()
        want, want_res, extra = ref_layer(p, m, h, res, before.get("state"), before.get("conv"), before.get("cache"),
                                          ids)
        errs = [("hidden", rel(out, want), OUT_LIMIT), ("residual", rel(res_out, want_res), OUT_LIMIT)]
        sl = m.slots_long if p.mixer == "kda" else None
        if p.mixer == "kda":
            S_new, conv_new = extra
            S_old = before["state"][sl].to(f64)
            upd = float(torch.linalg.vector_norm(S_new - S_old) / torch.linalg.vector_norm(S_new))
            errs.append(("kda state", rel(p.state[sl], S_new), max(1e-3, 2 ** -6 * upd)))
            errs.append(("conv state", rel(p.conv[sl], conv_new), CACHE_LIMIT))
        else:
            errs.append(("latent rows", rel(p.cache.view(-1, cfg.Lr + cfg.R)[m.slot_mapping], extra[0]), CACHE_LIMIT))
        for k, v in before.items():  # leave the states as they were
            getattr(p, k).copy_(v)
        return [(q, e, lim) for q, e, lim in errs], [("%s %.3e >= %.0e" % (q, e, lim)) for q, e, lim in errs
                                                      if not (e < lim)]

    # -- timing --
    def time_graph(fn, replays):
        if not gpu:  # --cpu-smoke: host time of eager calls (no graphs), for the shape of the output only
            import time
            us = []
            for _ in range(replays):
                t = time.perf_counter()
                fn()
                us.append((time.perf_counter() - t) * 1e6)
            return us
        fn()  # eager warm-up: Triton autotuning and fla's caches outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
        for _ in range(3):
            g.replay()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
        ev[0].record()
        for i in range(replays):
            g.replay()
            ev[i + 1].record()
        torch.cuda.synchronize()
        us = [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(replays)]
        del g
        return us

    def chain(ls, m, moe, final=False):
        h0 = uni((m.W, H), -1.0, 1.0)
        r0 = uni((m.W, H), -1.0, 1.0)

        def fn():
            h, res = h0, (r0 if ls[0].i > 0 else None)
            for p in ls:
                h, res, _ = layer_fwd(p, m, h, res, moe)
            if final:
                res = h + res
                h = rms(res, final_norm_w)
            return h
        return fn

    # -- the ceiling: a read-bound reduction over 4 GiB --
    ceiling_bytes = 4 << 30
    if gpu:
        big = torch.ones(ceiling_bytes // 8, dtype=torch.int64, device=dev)
        for _ in range(2):
            big.sum()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(16)]
        ev[0].record()
        for i in range(15):
            big.sum()
            ev[i + 1].record()
        torch.cuda.synchronize()
        ceiling_us = [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(15)]
        del big
    else:
        ceiling_us = [1e6] * 15  # --cpu-smoke: a placeholder, 4.3 GB/s
    ceiling = ceiling_bytes / (summary(ceiling_us)["median"] * 1e-6)
    print("ceiling: %.3f TB/s (torch.sum over 4 GiB of int64)" % (ceiling / 1e12), file=sys.stderr, flush=True)

    has_grouped = gpu and hasattr(torch, "_grouped_mm")
    moes = ["grouped", "per-expert"] if args.moe == "auto" else [args.moe]
    if not has_grouped:
        moes = [x for x in moes if x != "grouped"] or ["per-expert"]
    by_class = {}
    for p in layers:
        by_class.setdefault(p.cls, []).append(p)

    gate, classes, steps, notes = [], [], [], []
    notes.append("weights and states are random with decodepack synth's distributions, not decodepack's bytes; "
                 "bytes use decodepack's accounting (compiler/bench/bytes.h) with this run's own routing")
    notes.append("MLA: absorbed MLA in PyTorch (paged blocks gathered, bmm, fp32 softmax); FlashInfer not used (its "
                 "MLA kernels JIT-compile with nvcc for minutes on first use)")
    doc = lambda: result_doc(  # noqa: E731
        "stock PyTorch: cuBLAS linears, fla-core KDA (causal_conv1d_update, fused_recurrent_kda, rms_norm_gated), "
        "absorbed MLA in torch, torch._grouped_mm or per-expert cuBLAS MoE, CUDA graphs",
        "torch %s, fla-core %s" % (torch.__version__, fla_version), args.model,
        torch.cuda.get_device_name(0) if gpu else "cpu (--cpu-smoke)", args.context, args.replays, args.widths, ceiling_bytes, ceiling_us,
        "torch.sum over 4 GiB of int64 (a read-bound reduction)", gate, classes, steps, notes)

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc(), f, indent=2)
                f.write("\n")

    any_failed = False
    with torch.inference_mode():
        for W in args.widths:
            m = make_meta(W)
            g = {"width": W, "checks": 0, "failed": 0, "failures": []}
            failed_cls, chosen = set(), {}
            seq = [m.seq_len] * W
            for cls, ls in sorted(by_class.items()):
                for moe in (moes if ls[0].ffn == "moe" else moes[:1]):
                    try:
                        errs, bad = check(ls[0], m, moe)
                    except Exception as e:  # a library refusing these shapes is a failed class, not a crash
                        errs, bad = [("run", float("nan"), 0)], ["%s: %s" % (type(e).__name__, e)]
                    print("width %d: check of layer %d (%s, moe %s): %s" % (
                        W, ls[0].i, cls, moe, ", ".join("%s %.2e (limit %.0e)" % e for e in errs)), file=sys.stderr)
                    g["checks"] += len(errs)
                    g["failed"] += len(bad)
                    g["failures"] += ["layer %d (%s, moe %s) %s" % (ls[0].i, cls, moe, b) for b in bad]
                    if bad:
                        failed_cls.add((cls, moe))
            gate.append(g)
            print("width %d: gate %d checks, %d failed" % (W, g["checks"], g["failed"]), file=sys.stderr, flush=True)
            any_failed |= g["failed"] > 0

            routed = {}
            for cls, ls in sorted(by_class.items()):
                best = None
                for moe in (moes if ls[0].ffn == "moe" else moes[:1]):
                    if (cls, moe) in failed_cls:
                        continue
                    try:
                        us = time_graph(chain(ls, m, moe), args.replays)
                    except Exception as e:  # e.g. a kernel that cannot be captured
                        notes.append("width %d, %s, moe %s: not timed: %s: %s" % (W, cls, moe, type(e).__name__, e))
                        continue
                    if best is None or summary(us)["median"] < summary(best[1])["median"]:
                        best = (moe, us)
                if best is None:
                    why = [f for f in g["failures"] if "(%s," % cls in f]
                    classes.append(class_entry(cls, W, [p.i for p in ls], "failed" if why else "error",
                                               ("the correctness gate failed: " + "; ".join(why)) if why else
                                               "not timed (see notes)"))
                    continue
                moe, us = best
                chosen[cls] = moe
                # Each layer's own routing of this step's input, for its bytes.
                byte_sum = dict.fromkeys(BYTE_FIELDS, 0)
                rt = []
                h, res = uni((W, H), -1.0, 1.0), uni((W, H), -1.0, 1.0)
                for p in ls:
                    h, res, ids = layer_fwd(p, m, h, res if p.i > 0 else None, moe)
                    n = int(ids.unique().numel()) if ids is not None else 0
                    if ids is not None:
                        rt.append(n)
                    routed[p.i] = n
                    byte_sum = add_bytes(byte_sum, layer_bytes(cfg, p.i, seq, n))
                per_layer = [u / len(ls) for u in us]
                classes.append(class_entry(cls, W, [p.i for p in ls], routed=rt, us_per_layer=per_layer,
                                           replay_us=summary(us)["median"], byte_sum=byte_sum, ceiling=ceiling))
                if ls[0].ffn == "moe":
                    notes.append("width %d, %s: MoE by %s (--moe %s)" % (W, cls, moe, args.moe))
                print("width %d: %s %.1f us per layer" % (W, cls, summary(per_layer)["median"]), file=sys.stderr,
                      flush=True)
                save()
            if args.no_step:
                continue
            bad = sorted({c for c, _ in failed_cls if c not in chosen})
            if bad:
                steps.append(step_entry(W, cfg.layers, "failed", "the correctness gate failed: " + ", ".join(bad)))
            else:
                moe_step = chosen.get(next((c for c in chosen if c.endswith("_moe")), ""), moes[0])
                us = time_graph(chain(layers, m, moe_step, final=True), args.replays)
                byte_sum = dict.fromkeys(BYTE_FIELDS, 0)
                for p in layers:
                    byte_sum = add_bytes(byte_sum, layer_bytes(cfg, p.i, seq, routed.get(p.i, 0)))
                byte_sum = add_bytes(byte_sum, final_norm_bytes(cfg, W))
                steps.append(step_entry(W, cfg.layers, us=us, byte_sum=byte_sum, ceiling=ceiling))
                print("width %d: whole step %.1f us" % (W, summary(us)["median"]), file=sys.stderr, flush=True)
            save()
    return (5 if any_failed else 0), doc()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF config.json of the model (kimi_linear), e.g. bench/configs/...")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--moe", choices=["auto", "grouped", "per-expert"], default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-step", action="store_true", help="skip the whole step")
    ap.add_argument("--json", help="write the result here (manifests/bench-result.schema.json)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="test only: run on the CPU with pure-torch stand-ins for fla's kernels (a small config)")
    args = ap.parse_args(argv)
    try:
        args.widths = sorted({int(w) for w in args.widths.split(",")})
    except ValueError:
        ap.error("--widths %r: expected integers like 1,2,4,8" % args.widths)
    if not args.widths or args.widths[0] < 1:
        ap.error("--widths: batch widths are >= 1")
    if args.replays < 5:
        ap.error("--replays %d: expected >= 5" % args.replays)
    if args.context < 1:
        ap.error("--context %d: expected >= 1" % args.context)
    with open(args.model) as f:
        cfg = Cfg(json.load(f), args.model)
    try:
        import torch
    except ImportError as e:
        print("SKIPPED: %s" % e)
        return SKIP
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("SKIPPED: no CUDA GPU")
        return SKIP
    rc, doc = run(args, cfg)
    if doc is not None:
        print(table(doc))
    return rc


def table(doc):
    lines = ["baseline: %s (%s); ceiling %.3f TB/s" % (doc["device"], doc["version"],
                                                        (doc["ceiling"]["bytes_per_s"] or 0) / 1e12)]
    for g in doc["gate"]:
        lines.append("gate width %d: %d checks, %d failed" % (g["width"], g["checks"], g["failed"]))
        lines += ["  FAIL " + f for f in g["failures"]]
    lines.append("%-14s %5s %10s %8s  %s" % ("layer class", "width", "us/layer", "share", "status"))
    for c in doc["classes"]:
        lines.append("%-14s %5d %10.1f %7.1f%%  %s" % (c["class"], c["width"], c["us_per_layer"]["median"],
                                                      100 * c["share"], c["status"]))
    for s in doc["steps"]:
        lines.append("%-14s %5d %10.1f %7.1f%%  %s" % ("whole step", s["width"], s["us"]["median"], 100 * s["share"],
                                                      s["status"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
