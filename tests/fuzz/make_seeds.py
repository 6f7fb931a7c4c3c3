#!/usr/bin/env python3
"""Writes the committed seed inputs of the fuzzers into corpus/<name>/ (standard library only).

Seeds are small valid inputs that give libFuzzer the structure to mutate from; broken inputs come from
tests/corpus/ and the presets in manifests/presets, which CMakeLists.txt passes as extra seed dirs.
Deterministic: rerunning it leaves git clean. Other files in corpus/<name>/ are committed by hand:
inputs that once made a fuzzer fail (e.g. json_config/number_overflow.json), kept so every run replays
them.
"""

import json
import os
import struct
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)] stored in order; header padded to 8 bytes like writers do."""
    header, offset, data = {}, 0, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(payload)]}
        offset += len(payload)
        data += payload
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def write(name, fname, data):
    d = os.path.join(HERE, "corpus", name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, fname), "wb") as f:
        f.write(data)


def main():
    write("safetensors", "two_tensors.safetensors", safetensors(
        [("model.layers.0.self_attn.q_proj.weight", "BF16", [2, 3], bytes(range(12))),
         ("model.layers.0.self_attn.A_log", "F32", [2], bytes(range(8)))],
        {"format": "pt"}))
    write("safetensors", "empty.safetensors", safetensors([]))
    write("safetensors", "scalar_and_empty.safetensors", safetensors(
        [("scalar", "I64", [], bytes(8)), ("empty", "U8", [0, 4], b""),
         ("experts.w", "F8_E4M3", [1, 2, 2], bytes(4)), ("scale", "F8_E8M0", [1], b"\x7f")]))

    base = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128, "tie_word_embeddings": False,
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
        "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "head_dim": 16, "num_heads": 2,
                               "short_conv_kernel_size": 4},
        "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32, "num_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "intermediate_size": 128,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.5,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
    }
    write("json_config", "kimi_linear.json", json.dumps(base, separators=(",", ":")).encode())
    text = dict(base, q_lora_rank=32, mla_use_output_gate=True, num_shared_experts=2,
                routed_expert_hidden_size=32, latent_moe_use_norm=True, hidden_act="situ",
                activation_situ_beta=4.0, activation_situ_linear_beta=25.0, attn_res_block_size=2,
                linear_attn_config=dict(base["linear_attn_config"], use_full_rank_gate=True,
                                        gate_lower_bound=-5.0))
    k3 = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}
    write("json_config", "kimi_k3.json", json.dumps(k3, separators=(",", ":")).encode())

    # A valid manifest small enough for -max_len=4096 (the long runs): tiny-v1's with one layer, two
    # weights and no kernels or files; and the same as the only member of a .dpk.
    with open(os.path.join(HERE, "corpus", "manifest", "tiny-v1.json")) as f:
        m = json.load(f)
    m.update(kernels=[], files=[], prefetch=[], layers=m["layers"][:1])
    m["ranks"] = [{"rank": 0, "weights": m["ranks"][0]["weights"][:2]}]
    m["model"]["num_layers"] = 1
    minimal = (json.dumps(m, sort_keys=True, separators=(",", ":")) + "\n").encode()
    write("manifest", "minimal.json", minimal)
    write("archive", "minimal.dpk", ustar_member("manifest.json", minimal) + bytes(1024))


def ustar_member(name, data):
    """One plain ustar member as bundle-format.md 1.1 prescribes (header, data padded to 512 bytes)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    return info.tobuf(format=tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)


if __name__ == "__main__":
    main()
