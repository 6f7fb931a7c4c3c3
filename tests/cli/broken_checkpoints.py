"""Makes broken copies of the HF fixture checkpoint for the CLI tests (stdlib only).

Each function takes the destination directory and writes a whole checkpoint there that differs from
tests/fixtures/hf-kimi-linear/checkpoint in one way.
"""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(os.path.dirname(HERE), "fixtures", "hf-kimi-linear", "checkpoint")


def _read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write(path, header, body):
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)


def _copy(dst):
    shutil.copytree(FIXTURE, dst)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        return json.load(f)


def _edit_tensor(dst, name, fn):
    index = _copy(dst)
    shard = os.path.join(dst, index["weight_map"][name])
    header, body = _read(shard)
    body = fn(header, index) or body
    _write(shard, header, body)
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def missing_tensor(dst):
    """Drops a KDA beta projection from its shard and from the index."""
    name = "model.layers.2.self_attn.b_proj.weight"

    def fn(header, index):
        _, body = _read(os.path.join(dst, index["weight_map"][name]))
        begin, end = header.pop(name)["data_offsets"]
        del index["weight_map"][name]
        # Close the hole so the shard stays a valid file: only the inventory should object.
        for key, t in header.items():
            if key != "__metadata__" and t["data_offsets"][0] >= end:
                t["data_offsets"] = [t["data_offsets"][0] - (end - begin), t["data_offsets"][1] - (end - begin)]
        return body[:begin] + body[end:]
    _edit_tensor(dst, name, fn)


def wrong_shape(dst):
    """Reshapes a forget-gate B projection to the transposed shape (same bytes)."""
    name = "model.layers.1.self_attn.f_b_proj.weight"
    _edit_tensor(dst, name, lambda h, i: h[name].update(shape=list(reversed(h[name]["shape"]))))


def wrong_dtype(dst):
    """Labels a bf16 tensor F16 (same size, so the file itself stays valid)."""
    name = "model.layers.1.self_attn.q_proj.weight"
    _edit_tensor(dst, name, lambda h, i: h[name].update(dtype="F16"))
