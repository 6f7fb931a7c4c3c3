#!/usr/bin/env python3
"""Writes one broken config.json per failure mode of the config reader, plus expected.txt
(file, then the message fragments the error must contain, tab-separated).

Run from this directory: python3 make_corpus.py
"""
import copy
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = os.path.join(HERE, "..", "..", "..", "manifests", "presets")


def load(name):
    with open(os.path.join(PRESETS, name + ".json")) as f:
        return json.load(f)


tiny = load("kimi-linear-tiny")
k3 = load("kimi-k3-tiny")
k3_indexer = load("kimi-k3-tiny-indexer")
cases = []


def case(name, cfg, *fragments, raw=None):
    path = os.path.join(HERE, name)
    with open(path, "w") as f:
        f.write(raw if raw is not None else json.dumps(cfg, indent=1) + "\n")
    cases.append((name, fragments))


def mutate(base, fn):
    c = copy.deepcopy(base)
    fn(c)
    return c


case("bad-json.json", None, "bad-json.json", "invalid JSON", raw='{"model_type": "kimi_linear",\n')
case("not-object.json", None, "not-object.json", "top level", "expected an object", raw="[1, 2]\n")
case("unknown-model-type.json", mutate(tiny, lambda c: c.update(model_type="llama")),
     "model_type", '"llama"', "kimi_linear")
case("missing-hidden.json", mutate(tiny, lambda c: c.pop("hidden_size")), "missing field hidden_size")
case("hidden-string.json", mutate(tiny, lambda c: c.update(hidden_size="256")),
     "hidden_size", "a string", "expected an integer")
case("negative-layers.json", mutate(tiny, lambda c: c.update(num_hidden_layers=-4)),
     "num_hidden_layers", "-4", "positive")
case("layer-out-of-range.json",
     mutate(tiny, lambda c: c["linear_attn_config"].update(full_attn_layers=[5])),
     "linear_attn_config.full_attn_layers", "layer 5", "[1, 4]")
case("layer-zero-based.json",
     mutate(tiny, lambda c: c["linear_attn_config"].update(kda_layers=[0, 1, 2])),
     "linear_attn_config.kda_layers", "layer 0", "1-based")
case("layer-in-both.json",
     mutate(tiny, lambda c: c["linear_attn_config"].update(kda_layers=[1, 2, 3, 4])),
     "layer 4", "both")
case("layer-in-neither.json",
     mutate(tiny, lambda c: c["linear_attn_config"].update(kda_layers=[1, 2])),
     "layer 3", "neither")
case("duplicate-layer.json",
     mutate(tiny, lambda c: c["linear_attn_config"].update(kda_layers=[1, 2, 2, 3])),
     "kda_layers", "layer 2 twice")
case("topk-over-experts.json", mutate(tiny, lambda c: c.update(num_experts_per_token=32)),
     "num_experts_per_token", "32", "num_experts 16")
case("bad-activation.json", mutate(tiny, lambda c: c.update(hidden_act="gelu")),
     "hidden_act", '"gelu"', "silu")
case("rope-mla.json", mutate(tiny, lambda c: c.update(mla_use_nope=False)),
     "mla_use_nope", "not supported")
case("bad-eps.json", mutate(tiny, lambda c: c.update(rms_norm_eps=2.0)), "rms_norm_eps", "(0, 1)")
case("k3-no-text-config.json", mutate(k3, lambda c: c.pop("text_config")), "missing field text_config")
case("k3-inner-type.json", mutate(k3, lambda c: c["text_config"].update(model_type="deepseek_v3")),
     "text_config.model_type", "deepseek_v3")
case("k3-kda-list-type.json",
     mutate(k3, lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=["1"])),
     "text_config.linear_attn_config.kda_layers[0]", "a string", "expected an integer")
case("layer-types-length.json", mutate(tiny, lambda c: c.update(layer_types=["linear_attention"])),
     "layer_types", "1 entries", "num_hidden_layers = 4")
case("mlp-layer-types-value.json",
     mutate(tiny, lambda c: c.update(mlp_layer_types=["dense", "sparse", "moe2", "sparse"])),
     "mlp_layer_types[2]", '"moe2"', "dense")
case("index-partial.json", mutate(k3_indexer, lambda c: c["text_config"].pop("index_topk")),
     "missing field text_config.index_topk", "index_n_heads, index_head_dim and index_topk")
case("index-head-dim.json", mutate(k3_indexer, lambda c: c["text_config"].update(index_head_dim=64)),
     "text_config.index_head_dim is 64", "expected 128")
case("index-no-q-lora.json", mutate(k3_indexer, lambda c: c["text_config"].update(q_lora_rank=0)),
     "text_config.q_lora_rank is 0", "q-LoRA")


# Hostile inputs (issue 12): nothing may crash, allocate without bound or echo a huge value.
def nest(n):
    return "[" * n + "]" * n


tiny_text = json.dumps(tiny, indent=1)
case("deep-nesting.json", None, "deep-nesting.json", "nested deeper than 64 levels",
     raw=tiny_text[:tiny_text.rindex("}")] + ', "zz": ' + nest(100000) + "}\n")
case("duplicate-key.json", None, "key hidden_size appears more than once",
     raw=tiny_text.replace('"hidden_size": 256,', '"hidden_size": 256, "hidden_size": 512,', 1))
case("experts-2e62.json", mutate(tiny, lambda c: c.update(num_experts=2 ** 62)),
     "field num_experts is 4611686018427387904", "expected at most 16384")
case("heads-2e40.json", mutate(tiny, lambda c: c.update(num_attention_heads=2 ** 40, v_head_dim=2 ** 40)),
     "field num_attention_heads is 1099511627776", "expected at most 1024")
case("v-head-dim-2e40.json", mutate(tiny, lambda c: c.update(v_head_dim=2 ** 40)),
     "field v_head_dim is 1099511627776", "expected at most 4096")
case("hidden-too-large.json", mutate(tiny, lambda c: c.update(hidden_size=2 ** 17)),
     "field hidden_size is 131072", "expected at most 65536")
case("vocab-too-large.json", mutate(tiny, lambda c: c.update(vocab_size=2 ** 31)),
     "field vocab_size is 2147483648", "expected at most 4194304")
case("conv-kernel-too-large.json",
     mutate(tiny, lambda c: c["linear_attn_config"].update(short_conv_kernel_size=1000)),
     "field linear_attn_config.short_conv_kernel_size is 1000", "expected at most 64")
case("shared-experts-negative.json", mutate(tiny, lambda c: c.update(num_shared_experts=-1)),
     "field num_shared_experts is -1", "expected at least 0")
case("long-string.json", mutate(tiny, lambda c: c.update(model_type="x" * 100000)),
     "field model_type is", "xxx... (100000 bytes)")
case("long-key.json", None, "key", "... (100002 bytes) appears more than once",
     raw=tiny_text[:tiny_text.rindex("}")] + ', "' + "k" * 100000 + '": {"a": 1, "a": 2}}\n')

with open(os.path.join(HERE, "expected.txt"), "w") as f:
    f.write("# generated by make_corpus.py: file, then message fragments (tab-separated)\n")
    for name, frags in cases:
        f.write("\t".join((name,) + tuple(frags)) + "\n")
