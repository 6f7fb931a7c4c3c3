"""A serving host for Hugging Face's KimiLinearForCausalLM, shaped like vLLM's model runner.

    model = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    host = KimiLinearHost(model, "model.dpk")       # after weights load: binds, verifies, loads every width
    host.profile_run()                              # memory profiling (no KV, then a profiling KV cache)
    host.allocate_kv_cache(max_requests=16, max_context=4096)
    host.capture_graphs()                           # one FULL CUDA graph per width
    results = host.generate({"a": [5, 9, 13], "b": [7]}, max_new_tokens=64)

The model's own modules stay the reference path: transformers runs every prefill (one request at a
time) and every decode step the bundle's plan refuses (more requests than the widest width, no KV
bound, ...; the reason is logged). Accepted steps run the bundle's layer programs, final norm and LM
head, replayed from a CUDA graph captured per width; a step with fewer requests than its width pads the
rest (NULL_BLOCK_ID state, PAD_SLOT_ID rows). A bundle built with num_speculative_tokens 1 (q = 2)
runs speculative-verify steps: each step feeds the last token and one proposed token (prompt lookup:
the token that followed the previous occurrence of the last token) and accepts greedily.

decodepack's caches are the one copy of each request's state. transformers' cache object of a request
(kept from its prefill) is refreshed from them before transformers runs a step, and transformers'
results are written back after each token:
  KDA state   HF recurrent_states[0] [1, h, dk, dv] fp32 <-> slot, as is ("kv") or transposed ("vk")
  KDA conv    HF conv_states[0] [1, 3P, K] (the last K projection outputs, q|k|v, oldest first; its
              oldest column is never read again) <-> the slot's last K - 1 columns, q, k, v apart
  MLA latent  HF keys [1, 1, T, L] (normalised c) and values [1, 1, T, R] (k_pe) <-> row [c | k_pe] of
              token p at block block_table[p // block_size], offset p % block_size
With q = 2, slot column i holds the state after draft position i; a step reads column num_accepted - 1.
"""

import logging
import math
import time

from . import (Bundle, DecodepackError, GRAPH_FULL, GRAPH_NONE, KV_ATTN_RES, KV_CONV_K, KV_CONV_Q, KV_CONV_V,
               KV_KDA_STATE, KV_MLA_LATENT, LAYER_MODEL, NULL_BLOCK_ID, PAD_SLOT_ID, PREFETCH_ATTENTION_MOE,
               PREFETCH_ATTENTION_OPROJ, PREFETCH_NEXT_ATTENTION, PREFETCH_OPROJ_DOWN, REASON_NONE, Session, DTYPE_BF16, DTYPE_F32,
               DTYPE_F16)

log = logging.getLogger("decodepack.host")

_PREFETCH_POINTS = (PREFETCH_OPROJ_DOWN, PREFETCH_ATTENTION_MOE, PREFETCH_NEXT_ATTENTION, PREFETCH_ATTENTION_OPROJ)


# ---- Host logic without a GPU (tested on the CPU) ------------------------------------------------------

class Pool:
    """KDA state slots and MLA cache blocks. Slot 0 and block 0 are the null ones padded rows use."""

    def __init__(self, num_slots, num_blocks):
        if num_slots < 2 or num_blocks < 2:
            raise ValueError("a pool needs the null slot and block plus one more (got %d slots, %d blocks)" % (
                num_slots, num_blocks))
        self.num_slots, self.num_blocks = num_slots, num_blocks
        self._slots = list(range(num_slots - 1, 0, -1))   # pop() hands out 1, 2, ...
        self._blocks = list(range(num_blocks - 1, 0, -1))

    def take(self, slots, blocks):
        if slots > len(self._slots) or blocks > len(self._blocks):
            raise RuntimeError("out of KV cache: %d slots and %d blocks wanted, %d and %d free" % (
                slots, blocks, len(self._slots), len(self._blocks)))
        return [self._slots.pop() for _ in range(slots)], [self._blocks.pop() for _ in range(blocks)]

    def give(self, slots, blocks):
        for s in slots:
            if not 0 < s < self.num_slots or s in self._slots:
                raise ValueError("slot %d returned twice or never handed out" % s)
        for b in blocks:
            if not 0 < b < self.num_blocks or b in self._blocks:
                raise ValueError("block %d returned twice or never handed out" % b)
        self._slots.extend(reversed(slots))
        self._blocks.extend(reversed(blocks))

    @property
    def free(self):
        return len(self._slots), len(self._blocks)


class Request:
    def __init__(self, rid, prompt, max_new_tokens):
        if not prompt:
            raise ValueError("request %r: an empty prompt" % (rid,))
        self.id = rid
        self.prompt = list(prompt)
        self.output = []          # generated tokens
        self.max_new_tokens = max_new_tokens
        self.slots = []           # q KDA state slots (column i: the state after draft position i)
        self.blocks = []          # MLA cache blocks
        self.context = 0          # tokens whose state and latent rows are in the caches
        self.accepted = 1         # tokens the previous step accepted: the step reads slot column accepted - 1
        self.hf_cache = None      # transformers' cache object from the prefill (refreshed before use)
        self.proposed = self.accepted_drafts = 0

    @property
    def tokens(self):
        return self.prompt + self.output

    @property
    def done(self):
        return len(self.output) >= self.max_new_tokens


def step_metadata(requests, width, q, cols, block_size):
    """The step's per-row metadata at `width` (requests padded with the null slot and block, seq_len 0,
    PAD_SLOT_ID rows, position 0, one accepted token), as plain lists."""
    n = len(requests)
    if n > width:
        raise ValueError("%d requests at width %d" % (n, width))
    state, table, seq_lens, accepted, positions, slots = [], [], [], [], [], []
    for r in requests:
        state.append(list(r.slots))
        table.append(r.blocks + [NULL_BLOCK_ID] * (cols - len(r.blocks)))
        seq_lens.append(r.context + q)
        accepted.append(r.accepted)
        for i in range(q):
            p = r.context + i
            positions.append(p)
            slots.append(r.blocks[p // block_size] * block_size + p % block_size)
    for _ in range(width - n):
        state.append([NULL_BLOCK_ID] * q)
        table.append([NULL_BLOCK_ID] * cols)
        seq_lens.append(0)
        accepted.append(1)
        positions += [0] * q
        slots += [PAD_SLOT_ID] * q
    return {"state_indices": state, "block_table": table, "seq_lens": seq_lens, "num_accepted": accepted,
            "positions": positions, "slot_mapping": slots}


def propose(tokens):
    """Prompt lookup: the token that followed the latest earlier occurrence of the last token; else the
    last token again."""
    last = tokens[-1]
    for i in range(len(tokens) - 2, -1, -1):
        if tokens[i] == last:
            return tokens[i + 1]
    return last


def accept(drafts, argmaxes):
    """Greedy verification of one request's step. drafts: the q fed tokens (the last token, then the
    proposals); argmaxes: the greedy choice after each. Returns the emitted tokens (1 .. q): the
    proposals the model agrees with, then its own next choice."""
    out = []
    for i, g in enumerate(argmaxes):
        out.append(g)
        if i + 1 >= len(drafts) or drafts[i + 1] != g:
            break
    return out


# ---- The host ------------------------------------------------------------------------------------------

def hf_weight(name, params):
    """transformers' runtime tensor for a bundle weight (checkpoint naming, "{e}" for expert groups) and
    the name it came from. transformers 5.17 fuses what the checkpoint keeps apart:
      self_attn.{q,k,v}_conv1d.weight [P,1,K]   <- self_attn.conv1d.weight [3P,1,K] rows [iP, (i+1)P)
      self_attn.{f_a_proj,f_b_proj}.weight, self_attn.{dt_bias,A_log} <- self_attn.forget_gate.*
      block_sparse_moe.*                          <- mlp.*
      block_sparse_moe.experts.{e}.w1 (gate)      <- mlp.experts.gate_up_proj[:, :I, :]  (a view, [E, I, H])
      block_sparse_moe.experts.{e}.w3 (up)        <- mlp.experts.gate_up_proj[:, I:, :]  (a view)
      block_sparse_moe.experts.{e}.w2 (down)      <- mlp.experts.down_proj                ([E, H, I])
      everything else (the dense layer's mlp.* too) under the same name."""
    import re
    m = re.match(r"(model\.layers\.\d+\.)(.*)$", name)
    if not m:
        return params[name], name
    p, rest = m.group(1), m.group(2)
    cm = re.match(r"self_attn\.([qkv])_conv1d\.weight$", rest)
    if cm:
        full = params[p + "self_attn.conv1d.weight"]
        n = full.shape[0] // 3
        i = "qkv".index(cm.group(1))
        return full[i * n:(i + 1) * n], "%sself_attn.conv1d.weight[%d:%d]" % (p, i * n, (i + 1) * n)
    fm = re.match(r"self_attn\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$", rest)
    if fm:
        n = p + "self_attn.forget_gate." + fm.group(1)
        return params[n], n
    if rest.startswith("block_sparse_moe."):
        rest = "mlp." + rest[len("block_sparse_moe."):]
    em = re.match(r"mlp\.experts\.\{e\}\.(w[123])\.weight$", rest)
    if em:
        which = em.group(1)
        if p + "mlp.experts.gate_up_proj" in params:
            if which == "w2":
                n = p + "mlp.experts.down_proj"
                return params[n], n
            gu = params[p + "mlp.experts.gate_up_proj"]
            im = gu.shape[1] // 2
            if which == "w1":
                return gu[:, :im, :], p + "mlp.experts.gate_up_proj[:, :%d]" % im
            return gu[:, im:, :], p + "mlp.experts.gate_up_proj[:, %d:]" % im
        import torch  # a layout with one module per expert: stacked copies
        alt = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[which]
        parts, e = [], 0
        while True:
            hit = next((c for c in (p + "mlp.experts.%d.%s.weight" % (e, which),
                                    p + "mlp.experts.%d.%s.weight" % (e, alt)) if c in params), None)
            if hit is None:
                break
            parts.append(params[hit])
            e += 1
        if not parts:
            raise KeyError(p + "mlp.experts.* (%s)" % which)
        return torch.stack(parts), p + "mlp.experts.{e}.%s (stacked copy)" % which
    n = p + rest
    return params[n], n


def _torch_dtype(code):
    import torch
    table = {DTYPE_BF16: torch.bfloat16, DTYPE_F32: torch.float32, DTYPE_F16: torch.float16}
    if code not in table:
        raise DecodepackError(0, "dtype code %d: the host binds bf16, f16 and f32 tensors only" % code)
    return table[code]


class KimiLinearHost:
    """Serves greedy decode of an HF KimiLinearForCausalLM (on a CUDA device, bf16) with a bundle built
    from the same checkpoint for tensor_parallel 1."""

    def __init__(self, model, bundle, prefetch=True):
        import torch
        self.torch = torch
        self.model = model
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle(bundle)
        info = self.bundle.info
        cfg = model.config
        self.device = next(model.parameters()).device
        if self.device.type != "cuda":
            raise ValueError("the model is on %s; move it to a CUDA device first" % self.device)
        kinds = ["kda" if t == "linear_attention" else "mla" for t in cfg.layer_types]
        for what, got, want in (("layers", info["num_layers"], cfg.num_hidden_layers),
                                ("hidden size", info["hidden_size"], cfg.hidden_size),
                                ("vocabulary", info["vocab_size"], cfg.vocab_size),
                                ("tensor_parallel", info["tensor_parallel"], 1)):
            if got != want:
                raise ValueError("bundle %s: %s %s, the model %s" % (info["digest"][:19], what, got, want))
        for l, kind in enumerate(kinds):
            if self.bundle.layer(l)["mixer"] != kind:
                raise ValueError("layer %d: the bundle's mixer is %s, the model's %s" % (
                    l, self.bundle.layer(l)["mixer"], kind))
        self.kinds, self.cfg, self.info = kinds, cfg, info
        self.q = info["q"]
        self.widths = sorted(info["widths"])
        self.deploy = info["deploy"]
        self.session = Session(self.bundle, device=self.device.index or 0, rank=0, tensor_parallel=1,
                               num_speculative_tokens=self.q - 1, prefetch=prefetch)
        self._keep = self._bind_weights()
        self.session.finalize_weights()
        self.session.verify_weights()   # the bound bytes against the bundle's fingerprints
        self._lm_head = model.lm_head.weight.detach()
        self._embed = model.model.embed_tokens.weight.detach()
        self.session.bind_lm_head(self._lm_head)
        self.session.load_kernels()     # every width, before profiling and graph capture
        self.caches = {}
        self.pool = None
        self.graphs = {}
        self.stats = {"steps": 0, "host_steps": 0, "graph_replays": 0, "eager_steps": 0, "reasons": {},
                      "seconds": {}, "tokens": {}}
        log.info("bundle %s: widths %s, q %d, %d weights bound (%d as copies)", info["digest"][:19], self.widths,
                 self.q, len(self._keep), self._copies)

    # -- weights
    def _bind_weights(self):
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        keep, self._copies = [], 0
        for w in self.bundle.weights(0):
            src, src_name = hf_weight(w.name, params)
            want = _torch_dtype(w.dtype)
            t = src.detach()
            # kernels read dense rows at 16-byte aligned addresses (expert e at base + e * stride)
            views = [t[e] for e in range(t.shape[0])] if w.experts else [t]
            if t.dtype != want or not all(v.is_contiguous() and v.data_ptr() % 16 == 0 for v in views):
                t = t.to(want, copy=True).contiguous()
                self._copies += 1
            keep.append(t)
            try:
                if w.experts:
                    self.session.bind_expert_weights(w.name, t)
                else:
                    self.session.bind_weight(w.name, t)
            except DecodepackError as e:
                raise DecodepackError(e.code, "binding %s from the model's %s %s: %s" % (
                    w.name, src_name, tuple(t.shape), e.message)) from None
        return keep

    # -- KV caches
    def _bind_kv(self, num_slots, num_blocks):
        torch = self.torch
        self._release_kv()
        for l, kind in enumerate(self.kinds):
            wanted = [(KV_KDA_STATE, num_slots), (KV_CONV_Q, num_slots), (KV_CONV_K, num_slots),
                      (KV_CONV_V, num_slots)] if kind == "kda" else [(KV_MLA_LATENT, num_blocks)]
            for k, count in wanted:
                d = self.session.kv_layout(l, k, count)
                t = torch.zeros(d["shape"], dtype=_torch_dtype(d["dtype"]), device=self.device)
                self.session.bind_kv(l, k, t)
                self.caches[(l, k)] = t
        if getattr(self.cfg, "attn_res_block_size", 0):  # K3 block attention residuals: the model's one buffer
            d = self.session.kv_layout(LAYER_MODEL, KV_ATTN_RES, self.widths[-1] * self.q)
            t = torch.zeros(d["shape"], dtype=_torch_dtype(d["dtype"]), device=self.device)
            self.session.bind_kv(LAYER_MODEL, KV_ATTN_RES, t)
            self.caches[(LAYER_MODEL, KV_ATTN_RES)] = t
        mla = [l for l, kind in enumerate(self.kinds) if kind == "mla"]
        self.block_size = self.caches[(mla[0], KV_MLA_LATENT)].shape[1] if mla else \
            self.deploy["kv_cache"]["block_size"]
        self.pool = Pool(num_slots, num_blocks)

    def _release_kv(self):
        if self.caches:
            self.session.release_kv()
        self.caches = {}
        self.graphs = {}   # captured against the released caches
        self.pool = None

    def profile_run(self):
        """vLLM's memory profiling, in two parts: (1) a dummy step of the widest width with no KV bound:
        the plan refuses (REASON_NO_KV) and transformers runs it; (2) a profiling KV cache (the null
        slot and block plus one per row), bound, a padded dummy step of the widest width through the
        bundle, and released. Returns the peak bytes torch allocated."""
        torch = self.torch
        W = self.widths[-1]
        plan = self.session.plan(W, [self.q] * W)
        log.info("profile run, no KV bound: %s (%s) -> transformers runs it", plan.reason_name, plan.message)
        self.stats["reasons"][plan.reason_name] = self.stats["reasons"].get(plan.reason_name, 0) + 1
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.no_grad():
            self.model(input_ids=torch.zeros((W, self.q), dtype=torch.long, device=self.device), use_cache=False)
        self._bind_kv(1 + W * self.q, 1 + W)
        self.cols = 1
        self._alloc_io()
        plan = self._plan([], W, GRAPH_NONE)
        if plan.reason != REASON_NONE:
            raise RuntimeError("the profiling step was refused: %s: %s" % (plan.reason_name, plan.message))
        self._fill([], [], plan.width)
        self._enqueue(plan)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self._release_kv()
        self.io = None
        log.info("profile run: peak %.1f MiB allocated by torch", peak / 2 ** 20)
        return peak

    def allocate_kv_cache(self, max_requests, max_context):
        """The real caches: q slots per request and enough blocks for max_context tokens (+ q) each."""
        mla = [l for l, kind in enumerate(self.kinds) if kind == "mla"]
        bs = self.session.kv_layout(mla[0], KV_MLA_LATENT, 1)["shape"][1] if mla else \
            self.deploy["kv_cache"]["block_size"]
        self.cols = math.ceil((max_context + self.q) / bs)
        self._bind_kv(1 + max_requests * self.q, 1 + max_requests * self.cols)
        self.max_context = max_context
        self._alloc_io()
        log.info("KV cache: %d slots, %d blocks of %d tokens (%d per request), %.1f MiB", self.pool.num_slots,
                 self.pool.num_blocks, self.block_size, self.cols,
                 sum(t.numel() * t.element_size() for t in self.caches.values()) / 2 ** 20)

    def _alloc_io(self):
        torch, dev = self.torch, self.device
        W, q, H, V = self.widths[-1], self.q, self.cfg.hidden_size, self.cfg.vocab_size
        R, C = W * q, self.cols
        z = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
        # The step's metadata lives in two device tensors (int64: ids, positions, slot mapping; int32:
        # state indices, block table, seq lens, accepted counts), each filled from a pinned staging copy
        # with one asynchronous copy per step.
        self._i64 = z(3 * R, dtype=torch.long)
        self._i32 = z(R + W * C + 2 * W, dtype=torch.int32)
        self._stage64 = torch.zeros(3 * R, dtype=torch.long).pin_memory()
        self._stage32 = torch.zeros(R + W * C + 2 * W, dtype=torch.int32).pin_memory()
        i32 = self._i32
        self.io = {"ids": self._i64[:R], "positions": self._i64[R:2 * R], "slot_mapping": self._i64[2 * R:],
                   "state_indices": i32[:R].view(W, q), "block_table": i32[R:R + W * C].view(W, C),
                   "seq_lens": i32[R + W * C:R + W * C + W], "num_accepted": i32[R + W * C + W:],
                   "hid": [z(R, H, dtype=torch.bfloat16) for _ in range(2)],
                   "res": [z(R, H, dtype=torch.bfloat16) for _ in range(2)],
                   "norm": z(R, H, dtype=torch.bfloat16), "norm_res": z(R, H, dtype=torch.bfloat16),
                   "logits": z(R, V, dtype=torch.float32)}
        self.graphs = {}

    # -- steps through the bundle
    def _plan(self, reqs, width, graph_mode):
        m = step_metadata(reqs, max(width, len(reqs)), self.q, self.cols, self.block_size)
        n = len(reqs) if reqs else width
        return self.session.plan(n, [self.q] * n, num_accepted=m["num_accepted"][:n],
                                 state_indices=m["state_indices"][:n], state_indices_stride=self.q,
                                 block_table=m["block_table"][:n], block_table_stride=self.cols,
                                 block_table_cols=self.cols, graph_mode=graph_mode)

    def _fill(self, reqs, fed, width):
        """The step's inputs into the static buffers: two asynchronous copies from pinned staging
        (stream-ordered before the launches; the staging is written only once the stream is idle, which
        it already is between steps since the host reads each step's logits). Rows past `width` are left as zeros: nothing reads them."""
        torch = self.torch
        W, q, C = self.widths[-1], self.q, self.cols
        R = W * q
        m = step_metadata(reqs, width, q, C, self.block_size)
        rows = width * q
        pad = lambda v, n: v + [0] * (n - len(v))  # noqa: E731
        ids = [t for row in fed for t in row]
        l64 = pad(ids, R) + pad(m["positions"], R) + pad(m["slot_mapping"], R)
        l32 = (pad([s for row in m["state_indices"] for s in row], R) +
               pad([b for row in m["block_table"] for b in row], W * C) + pad(m["seq_lens"], W) +
               pad(m["num_accepted"], W))
        assert len(ids) <= rows
        torch.cuda.current_stream(self.device).synchronize()  # the previous copies out of the staging are done
        self._stage64.copy_(torch.tensor(l64, dtype=torch.long))
        self._stage32.copy_(torch.tensor(l32, dtype=torch.int32))
        self._i64.copy_(self._stage64, non_blocking=True)
        self._i32.copy_(self._stage32, non_blocking=True)

    def _enqueue(self, plan):
        """The whole decode step on the current stream: embedding rows, every layer program (ping-pong
        buffers; layer 0 has no residual input), the final norm and the LM head."""
        torch, io, s = self.torch, self.io, self.session
        stream = torch.cuda.current_stream(self.device)
        rows = plan.width * self.q
        torch.index_select(self._embed, 0, io["ids"][:rows], out=io["hid"][0][:rows])
        meta = dict(positions=io["positions"], state_indices=io["state_indices"], block_table=io["block_table"],
                    block_table_stride=self.cols, seq_lens=io["seq_lens"], slot_mapping=io["slot_mapping"],
                    num_accepted=io["num_accepted"])
        L = len(self.kinds)
        for l in range(L):
            for point in _PREFETCH_POINTS:
                s.prefetch_fork(point, l, plan.width, stream=stream)
            s.launch_layer(plan, l, stream=stream, hidden=io["hid"][l % 2], residual=None if l == 0 else io["res"][l % 2],
                           out=io["hid"][(l + 1) % 2], residual_out=io["res"][(l + 1) % 2], **meta)
        s.launch_final_norm(plan, hidden=io["hid"][L % 2], residual=io["res"][L % 2], out=io["norm"],
                            residual_out=io["norm_res"], stream=stream)
        s.prefetch_join(stream=stream)
        s.launch_lm_head(plan, io["norm"], io["logits"], stream=stream)

    def capture_graphs(self):
        """One FULL CUDA graph per width, planned at capture (the plan is baked in) with every row padded."""
        torch = self.torch
        if self.pool is None:
            raise RuntimeError("capture_graphs: allocate_kv_cache first (graphs bake in the caches' addresses)")
        for W in self.widths:
            plan = self._plan([], W, GRAPH_FULL)
            if plan.reason != REASON_NONE or plan.width != W:
                log.info("width %d: no graph (%s %s)", W, plan.reason_name, plan.message)
                continue
            self._fill([], [], W)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):   # warm-up outside the capture
                self._enqueue(plan)
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._enqueue(plan)
            self.graphs[W] = g
        torch.cuda.synchronize(self.device)
        log.info("captured FULL graphs at widths %s", sorted(self.graphs))

    # -- requests
    def add_request(self, rid, prompt, max_new_tokens):
        """Prefill through transformers (one request), its state into the caches; returns the Request
        with its first generated token."""
        torch = self.torch
        r = Request(rid, prompt, max_new_tokens)
        need = len(r.prompt) + max_new_tokens + self.q
        if need > self.cols * self.block_size:
            raise ValueError("request %r: %d prompt tokens + %d new need %d cache rows, at most %d per request" % (
                rid, len(r.prompt), max_new_tokens, need, self.cols * self.block_size))
        r.slots, r.blocks = self.pool.take(self.q, math.ceil(need / self.block_size))
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([r.prompt], device=self.device), use_cache=True)
        r.hf_cache = out.past_key_values
        for i in range(self.q):  # every column starts from the prompt's state
            self._from_hf(r, column=i, positions=range(len(r.prompt)) if i == 0 else ())
        r.context = len(r.prompt)
        r.output.append(int(torch.argmax(out.logits[0, -1])))
        return r

    def remove_request(self, r):
        self.pool.give(r.slots, r.blocks)
        r.slots, r.blocks, r.hf_cache = [], [], None

    def step(self, reqs, force_host=False, proposer=None):
        """One decode (q = 1) or verify (q = 2) step for `reqs`; appends the emitted tokens to each
        request and returns the step's fp32 logits [len(reqs), q, vocab]. proposer(request, tokens) gives
        the next proposal after `tokens` (default: prompt lookup, propose())."""
        torch = self.torch
        t0 = time.perf_counter()
        fed = []
        for r in reqs:
            row = [r.tokens[-1]]
            while len(row) < self.q:
                row.append(proposer(r, r.tokens + row[1:]) if proposer else propose(r.tokens + row[1:]))
            fed.append(row)
        plan = self._plan(reqs, len(reqs), GRAPH_FULL if self.graphs else GRAPH_NONE)
        self.stats["steps"] += 1
        host_before = self.stats["host_steps"]
        if plan.reason == REASON_NONE and not force_host and plan.lm_head() and \
                all(plan.layer_kernel(l) for l in range(len(self.kinds))):
            self._fill(reqs, fed, plan.width)
            if plan.width in self.graphs:
                self.graphs[plan.width].replay()
                self.stats["graph_replays"] += 1
            else:
                self._enqueue(plan)
                self.stats["eager_steps"] += 1
            logits = self.io["logits"][:len(reqs) * self.q].view(len(reqs), self.q, -1).clone()
        else:
            why = "forced" if force_host and plan.reason == REASON_NONE else (
                "%s: %s" % (plan.reason_name, plan.message) if plan.reason != REASON_NONE else "a layer has no program")
            key = "forced" if why == "forced" else plan.reason_name
            self.stats["reasons"][key] = self.stats["reasons"].get(key, 0) + 1
            self.stats["host_steps"] += 1
            log.info("step of %d requests: transformers runs it (%s)", len(reqs), why)
            logits = torch.stack([self._hf_step(r, row) for r, row in zip(reqs, fed)])
        greedy = torch.argmax(logits, dim=-1).tolist()   # waits for the step
        path = "host" if self.stats["host_steps"] > host_before else "graph" if plan.width in self.graphs else "eager"
        self.stats["seconds"][path] = self.stats["seconds"].get(path, 0.0) + time.perf_counter() - t0
        for r, row, g in zip(reqs, fed, greedy):
            emitted = accept(row, g)
            self.stats["tokens"][path] = self.stats["tokens"].get(path, 0) + len(emitted)
            r.proposed += self.q - 1
            r.accepted_drafts += len(emitted) - 1
            r.context += len(emitted)
            r.accepted = len(emitted)
            r.output.extend(emitted[:r.max_new_tokens - len(r.output)])
        return logits

    def generate(self, prompts, max_new_tokens, force_host_steps=(), proposer=None, keep_logits=False):
        """Continuous batching: every request joins (prefill), the running ones step together, finished
        ones leave, and the step's width follows the batch. prompts: {id: [token ids]}; max_new_tokens:
        an int or {id: int}. Returns {id: tokens} and keeps per-step records in self.trace (keep_logits:
        with each request's first-row logits, on the CPU, as (id, tokens generated before the step, row))."""
        todo = list(prompts.items())
        running, done, self.trace = [], {}, []
        while todo or running:
            while todo:
                rid, p = todo[0]
                n = max_new_tokens[rid] if isinstance(max_new_tokens, dict) else max_new_tokens
                slots, blocks = self.pool.free
                if slots < self.q or blocks < math.ceil((len(p) + n + self.q) / self.block_size):
                    if not running:
                        raise RuntimeError("request %r does not fit the KV cache even alone" % (rid,))
                    break   # joins when a running request leaves
                todo.pop(0)
                running.append(self.add_request(rid, p, n))
            for r in [r for r in running if r.done]:
                done[r.id] = r.output[:r.max_new_tokens]
                self.remove_request(r)
            running = [r for r in running if r.slots]
            if not running:
                continue
            step_no = self.stats["steps"]
            before = (self.stats["host_steps"], self.stats["graph_replays"])
            k = [len(r.output) for r in running]
            logits = self.step(running, force_host=step_no in force_host_steps, proposer=proposer)
            self.trace.append({"requests": len(running),
                               "path": "host" if self.stats["host_steps"] > before[0] else
                               "graph" if self.stats["graph_replays"] > before[1] else "eager"})
            if keep_logits:
                rows = logits[:, 0].double().cpu()
                self.trace[-1]["logits"] = [(r.id, k[i], rows[i]) for i, r in enumerate(running)]
        return done

    # -- transformers' cache <-> decodepack's caches
    def _conv_cols(self, t):
        return t.shape[1] if self.deploy["conv_state"]["layout"] == "sd" else t.shape[2]

    def _from_hf(self, r, column, positions):
        """transformers' cache of request r -> its slot column `column` (KDA) and the latent rows of
        `positions` (MLA)."""
        torch = self.torch
        for l, kind in enumerate(self.kinds):
            lay = r.hf_cache.layers[l]
            if kind == "kda":
                slot = r.slots[column]
                st = self.caches[(l, KV_KDA_STATE)]
                s = lay.recurrent_states[0][0]
                st[slot] = (s if self.deploy["kda_state"]["layout"] == "kv" else s.transpose(-1, -2)).to(st.dtype)
                conv = lay.conv_states[0][0]
                P = conv.shape[0] // 3
                for i, k in enumerate((KV_CONV_Q, KV_CONV_K, KV_CONV_V)):
                    t = self.caches[(l, k)]
                    part = conv[i * P:(i + 1) * P, -self._conv_cols(t):]
                    t[slot] = (part.transpose(0, 1) if self.deploy["conv_state"]["layout"] == "sd" else part).to(t.dtype)
            else:
                positions = list(positions)
                if not positions:
                    continue
                t = self.caches[(l, KV_MLA_LATENT)]
                keys, values = lay.keys[0, 0], lay.values[0, 0]
                Lr, R = keys.shape[-1], values.shape[-1]
                idx = torch.tensor(positions, device=self.device)
                rows = torch.cat([keys[idx], values[idx]], dim=-1).to(t.dtype)
                flat = t.view(-1, t.shape[-1])
                dest = torch.tensor([r.blocks[p // self.block_size] * self.block_size + p % self.block_size
                                     for p in positions], device=self.device)
                flat[dest, :Lr + R] = rows

    def _to_hf(self, r):
        """r's caches (slot column accepted - 1, latent rows [0, context)) -> transformers' cache object."""
        torch = self.torch
        slot = r.slots[r.accepted - 1]
        for l, kind in enumerate(self.kinds):
            lay = r.hf_cache.layers[l]
            if kind == "kda":
                st = self.caches[(l, KV_KDA_STATE)][slot]
                hs = lay.recurrent_states[0]
                hs[0].copy_(st if self.deploy["kda_state"]["layout"] == "kv" else st.transpose(-1, -2))
                conv = lay.conv_states[0][0]
                P = conv.shape[0] // 3
                conv.zero_()
                for i, k in enumerate((KV_CONV_Q, KV_CONV_K, KV_CONV_V)):
                    t = self.caches[(l, k)]
                    part = t[slot] if self.deploy["conv_state"]["layout"] == "ds" else t[slot].transpose(0, 1)
                    conv[i * P:(i + 1) * P, -part.shape[1]:] = part.to(conv.dtype)
            else:
                t = self.caches[(l, KV_MLA_LATENT)]
                Lr, R = lay.keys.shape[-1], lay.values.shape[-1]
                flat = t.view(-1, t.shape[-1])
                src = torch.tensor([r.blocks[p // self.block_size] * self.block_size + p % self.block_size
                                    for p in range(r.context)], device=self.device)
                rows = flat[src]
                lay.keys = rows[:, :Lr].to(lay.keys.dtype).reshape(1, 1, r.context, Lr).contiguous()
                lay.values = rows[:, Lr:Lr + R].to(lay.values.dtype).reshape(1, 1, r.context, R).contiguous()

    def _hf_step(self, r, fed):
        """transformers runs r's step token by token from r's caches; each token's state goes to its slot
        column, its latent row to its position. Returns fp32 logits [q, vocab]."""
        torch = self.torch
        self._to_hf(r)
        out = []
        with torch.no_grad():
            for i, tok in enumerate(fed):
                o = self.model(input_ids=torch.tensor([[tok]], device=self.device), past_key_values=r.hf_cache,
                               use_cache=True)
                out.append(o.logits[0, -1].float())
                self._from_hf(r, column=i, positions=[r.context + i])
        return torch.stack(out)
