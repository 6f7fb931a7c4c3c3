#!/usr/bin/env python3
"""Write a small Kimi-Linear checkpoint with Hugging Face transformers' own save_pretrained, in a geometry
that decodepack's layer programs support, for tests/gpu/hf_crosscheck.py.

Why not tests/fixtures/hf-kimi-linear/checkpoint: that fixture has KDA head dim 32 and kv_lora_rank 32,
below what the kernel templates take (KDA head dim 64/128/192/256; kv_lora_rank a multiple of 64), so a
bundle built from it has no layer programs (`decodepack plan` names the parameter) and every layer would
be the host's. This one has the shapes of the `kimi-linear-tiny` preset (manifests/presets): hidden 256,
4 layers (KDA, KDA, KDA, MLA; layer 0 dense MLP, layers 1-3 MoE), KDA 2 heads of 128, MLA 2 heads with
kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, 16 experts top-4 of width 128 plus 1 shared, dense
width 512, vocabulary 1024; about 15 MB in bf16.

Weights: transformers' own initialisation (torch.manual_seed(seed)), then, so that the checks can see a
wrong weight or a wrong use of one, every RMSNorm weight (input/post-attention/final norms, KDA o_norm,
MLA kv_a_layernorm) is set to 1 + 0.1 * N(0, 1) instead of 1, and the MoE routers'
e_score_correction_bias to U(-0.05, 0.05) instead of 0 (so the bias changes which experts are chosen
while the weights stay the unbiased scores). Cast to bfloat16 and saved (original Moonshot tensor
layout, as save_pretrained writes it: see tests/fixtures/hf-kimi-linear/NOTES.md).

--geometry wide: the same layer kinds four times wider where the kernels' parameters allow, so that the
kernels run with the block counts, K-slices and row tiles of real models rather than the tiny ones: hidden
1024, KDA 8 heads of 128, MLA 8 heads (kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128), 32 experts top-4
of width 256 plus 1 shared, dense width 2048; about 150 MB in bf16.

--lm-head-scale S multiplies lm_head.weight by S before the cast. Random weights give nearly flat logits
(top-2 gaps of 0.001 to 0.5), where bf16 rounding alone flips greedy choices; scaling the head does not
help, since it scales the rounding noise of the logits with them (measured on the H200: HF bf16's logits
sit about 5% from HF fp32's, relative, whatever the scale).

--lm-head permutation scales the embedding to rms 1 (transformers initialises it at 0.02, far below what
the layers add to the residual stream) and replaces lm_head.weight by the embedding rows in a fixed
random order, scaled: row pi(t) = c * embed_tokens[t], c chosen so that a hidden state equal to token
t's embedding scores pi(t) at about 20 after the final norm. The residual stream then still carries
the current token's embedding after every layer, so the next token is nearly always pi(current token)
and its logit leads by several units; the layers still move every logit, so they stay checked. This is
the "confident" checkpoint of tests/gpu/generate_check.py and host_check.py.

Usage: hf_make_checkpoint.py OUT_DIR [--seed 0] [--geometry tiny|wide] [--lm-head-scale S]
       [--lm-head random|permutation]
       (needs torch and transformers 5.17)
"""

import argparse
import os
import sys

GEOMETRY = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "num_shared_experts": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "model_max_length": 4096,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "linear_head_dim": 128,
    "linear_num_heads": 2,
    "linear_conv_kernel_dim": 4,
}


# The wide geometry: GEOMETRY with these changes.
WIDE = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "num_experts": 32,
    "linear_num_heads": 8,
}
GEOMETRIES = {"tiny": GEOMETRY, "wide": dict(GEOMETRY, **WIDE)}


def make(out_dir, seed=0, geometry="tiny", lm_head_scale=1.0, lm_head="random"):
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    torch.manual_seed(seed)
    geo = GEOMETRIES[geometry]
    config = KimiLinearConfig(**geo)
    for k in ("hidden_size", "kv_lora_rank", "linear_head_dim", "linear_num_heads", "num_experts"):
        if getattr(config, k) != geo[k]:
            raise SystemExit("KimiLinearConfig did not take %s=%r (got %r)" % (k, geo[k], getattr(config, k)))
    model = KimiLinearForCausalLM(config)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.1 - 0.05)
        if lm_head == "permutation":
            emb = model.model.embed_tokens.weight
            emb.mul_(1.0 / emb.pow(2).mean().sqrt())   # rms 1: the residual stream carries the token
            perm = torch.randperm(emb.shape[0], generator=g)
            c = 20.0 / (emb.norm(dim=1).mean() * emb.shape[1] ** 0.5)
            model.lm_head.weight.copy_(c * emb[torch.argsort(perm)])  # row perm[t] = c * emb[t]
        elif lm_head != "random":
            raise SystemExit("--lm-head %s: random or permutation" % lm_head)
        if lm_head_scale != 1.0:
            model.lm_head.weight.mul_(lm_head_scale)
    model = model.to(torch.bfloat16).eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    ap.add_argument("--lm-head-scale", type=float, default=1.0)
    ap.add_argument("--lm-head", choices=("random", "permutation"), default="random")
    args = ap.parse_args()
    make(args.out_dir, args.seed, args.geometry, args.lm_head_scale, args.lm_head)
    print("wrote %s" % args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
