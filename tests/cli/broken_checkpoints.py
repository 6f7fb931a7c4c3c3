"""Makes broken copies of the HF fixture checkpoint for the CLI tests (stdlib only).

Each function takes the destination directory and writes a whole checkpoint there that differs from
tests/fixtures/hf-kimi-linear/checkpoint in one way.
"""
import json
import os
import shutil
import struct
import tarfile

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


# Hostile inputs (issue 12). Nest(n) is n "[" then n "]": the JSON library copies and prints values
# recursively, so a document nested that deep overflowed the stack.

BUNDLE_V1 = os.path.join(os.path.dirname(HERE), "fixtures", "bundle-v1", "tiny-v1.dpk")


def _nest(n):
    return "[" * n + "]" * n


def config_deep_nesting(dst):
    """The fixture with `"zz": Nest(100000)` added to config.json."""
    _copy(dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        text = f.read()
    text = text[:text.rindex("}")] + ', "zz": ' + _nest(100000) + "}\n"
    with open(path, "w") as f:
        f.write(text)


def _make_fifo(path):
    if os.path.lexists(path):
        os.remove(path)
    os.mkfifo(path)


def fifo_config(dst):
    """The fixture with config.json replaced by a FIFO that nobody writes."""
    _copy(dst)
    _make_fifo(os.path.join(dst, "config.json"))


def fifo_shard(dst):
    """The fixture with its second shard replaced by a FIFO."""
    _copy(dst)
    _make_fifo(os.path.join(dst, "model-00002-of-00003.safetensors"))


def fifo_files(dst):
    """A directory holding FIFOs named like a deploy file and a bundle."""
    os.makedirs(dst)
    for name in ("deploy.json", "tiny.dpk"):
        os.mkfifo(os.path.join(dst, name))


def unreadable_checkpoint(dst):
    """The fixture in a directory of mode 000."""
    _copy(dst)
    os.chmod(dst, 0)


def flatten_o_proj(dst):
    """Edits the checkpoint that setup wrote at dst: layer 0's o_proj [256, 256] becomes [65536] (same bytes)."""
    name = "model.layers.0.self_attn.o_proj.weight"
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        shard = os.path.join(dst, json.load(f)["weight_map"][name])
    header, body = _read(shard)
    n = 1
    for d in header[name]["shape"]:
        n *= d
    header[name]["shape"] = [n]
    _write(shard, header, body)


# FP8 checkpoints (issue 21): each edits the `synth --quantize fp8` checkpoint that setup wrote at dst.
FP8_SCALE = "model.layers.1.self_attn.q_proj.weight_scale_inv"


def _fp8_edit(dst, name, fn):
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shard = os.path.join(dst, index["weight_map"][name])
    header, body = _read(shard)
    body = fn(header, body, index) or body
    _write(shard, header, body)
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def fp8_scale_byte(dst):
    """Flips the lowest mantissa bit of the first fp32 scale of layer 1's q_proj (still a finite scale)."""
    def fn(header, body, index):
        begin = header[FP8_SCALE]["data_offsets"][0]
        return body[:begin] + bytes([body[begin] ^ 1]) + body[begin + 1:]
    _fp8_edit(dst, FP8_SCALE, fn)


def _fp8_set_scale(dst, element, value):
    def fn(header, body, index):
        at = header[FP8_SCALE]["data_offsets"][0] + 4 * element
        return body[:at] + struct.pack("<f", value) + body[at + 4:]
    _fp8_edit(dst, FP8_SCALE, fn)


def fp8_scale_nan(dst):
    """Sets the last fp32 scale ([1, 1]) of layer 1's q_proj to NaN."""
    _fp8_set_scale(dst, 3, float("nan"))


def fp8_scale_negative(dst):
    """Sets the second fp32 scale ([0, 1]) of layer 1's q_proj to -0.5."""
    _fp8_set_scale(dst, 1, -0.5)


def fp8_missing_scale(dst):
    """Drops layer 1's q_proj scale from its shard and the index (the shard stays a valid file)."""
    def fn(header, body, index):
        begin, end = header.pop(FP8_SCALE)["data_offsets"]
        del index["weight_map"][FP8_SCALE]
        for key, t in header.items():
            if key != "__metadata__" and t["data_offsets"][0] >= end:
                t["data_offsets"] = [t["data_offsets"][0] - (end - begin), t["data_offsets"][1] - (end - begin)]
        return body[:begin] + body[end:]
    _fp8_edit(dst, FP8_SCALE, fn)


def fp8_scale_shape(dst):
    """Labels layer 1's q_proj scale [2, 2] as [4, 1] (same bytes)."""
    _fp8_edit(dst, FP8_SCALE, lambda h, b, i: h[FP8_SCALE].update(shape=[4, 1]))


def fp8_scale_dtype(dst):
    """Labels layer 1's q_proj scale F32 as I32 (same bytes)."""
    _fp8_edit(dst, FP8_SCALE, lambda h, b, i: h[FP8_SCALE].update(dtype="I32"))


def fp8_extra_scale(dst):
    """Adds a weight_scale_inv for layer 1's b_proj, which the ignore list keeps bf16."""
    name = "model.layers.1.self_attn.b_proj.weight"
    extra = "model.layers.1.self_attn.b_proj.weight_scale_inv"

    def fn(header, body, index):
        header[extra] = {"dtype": "F32", "shape": [1, 2], "data_offsets": [len(body), len(body) + 8]}
        index["weight_map"][extra] = index["weight_map"][name]
        return body + bytes(8)
    _fp8_edit(dst, name, fn)


def _bundle_members():
    with tarfile.open(BUNDLE_V1) as t:
        return [(m.name, t.extractfile(m).read()) for m in t.getmembers() if m.isfile()]


def _write_dpk(path, members, hole=None):
    """A plain ustar archive of (name, bytes) members; `hole` = (name, size) adds a last member whose
    data is a hole in a sparse file (zeros that take no disk space)."""
    def header(name, size):
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0
        return info.tobuf(format=tarfile.USTAR_FORMAT)
    with open(path, "wb") as f:
        for name, data in members:
            f.write(header(name, len(data)) + data + b"\0" * (-len(data) % 512))
        if hole:
            name, size = hole
            f.write(header(name, size))
            f.seek(size + (-size % 512), os.SEEK_CUR)
        f.write(b"\0" * 1024)


def manifest_deep_nesting(dst):
    """tiny-v1 with Nest(100000) as a toolchains value of its manifest: dst/dir (a directory bundle) and
    dst/deep.dpk."""
    members = _bundle_members()
    out = []
    for name, data in members:
        if name == "manifest.json":
            m = json.loads(data)
            m["toolchains"]["zz"] = "@@"
            text = json.dumps(m, sort_keys=True, separators=(",", ":")).replace('"@@"', _nest(100000))
            data = (text + "\n").encode()
        out.append((name, data))
    for name, data in out:
        path = os.path.join(dst, "dir", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    _write_dpk(os.path.join(dst, "deep.dpk"), out)


def sparse_bundles(dst):
    """dst/big.dpk: tiny-v1 plus an unlisted 6 GB member of zeros; dst/huge-manifest.dpk: tiny-v1's code
    objects and a 1 GiB manifest.json. Both are sparse files: they take almost no disk space."""
    os.makedirs(dst)
    members = _bundle_members()
    _write_dpk(os.path.join(dst, "big.dpk"), members, hole=("zz/padding.bin", 6 * 10**9))
    _write_dpk(os.path.join(dst, "huge-manifest.dpk"), [m for m in members if m[0] != "manifest.json"],
               hole=("manifest.json", 1 << 30))


def manifest_edits(dst):
    """Directory bundles of tiny-v1 with one manifest field edited: dst/toolchain (a toolchain version that
    is an array), dst/widths (deploy.widths a string), dst/no-spec (deploy without num_speculative_tokens)."""
    members = _bundle_members()
    edits = {
        "toolchain": lambda m: m["toolchains"].update(nvidia=[1]),
        "widths": lambda m: m["deploy"].update(widths="1"),
        "no-spec": lambda m: m["deploy"].pop("num_speculative_tokens"),
    }
    for name, edit in edits.items():
        for member, data in members:
            if member == "manifest.json":
                m = json.loads(data)
                edit(m)
                data = (json.dumps(m, sort_keys=True, separators=(",", ":")) + "\n").encode()
            path = os.path.join(dst, name, member)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)


def long_tensor_name(dst):
    """The fixture with one extra 4-byte tensor whose name is 100000 bytes long (in its shard and the index)."""
    index = _copy(dst)
    shard_name = sorted(set(index["weight_map"].values()))[0]
    shard = os.path.join(dst, shard_name)
    header, body = _read(shard)
    name = "x" * 100000
    header[name] = {"dtype": "U8", "shape": [4], "data_offsets": [len(body), len(body) + 4]}
    _write(shard, header, body + b"\0" * 4)
    index["weight_map"][name] = shard_name
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
