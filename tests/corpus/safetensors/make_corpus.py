#!/usr/bin/env python3
"""Writes one small broken safetensors file per failure mode, plus expected.txt.

Each line of expected.txt is `<file name>\t<fragment>`; the parser's error for that file must contain
every fragment listed for it (tests/unit/model/safetensors_test.cpp, SafetensorsCorpus). The files are
committed; run this script again (python3 make_corpus.py) after changing it or the messages.

Standard library only. Output is deterministic, so rerunning it leaves git clean.
"""

import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def header_bytes(header):
    """Compact JSON of a dict (or raw text/bytes given verbatim)."""
    if isinstance(header, bytes):
        return header
    if isinstance(header, str):
        return header.encode("utf-8")
    return json.dumps(header, separators=(",", ":")).encode("utf-8")


def file_bytes(header, data_size, length=None):
    """Length prefix (`length` lies when given), header, then `data_size` bytes of filler."""
    h = header_bytes(header)
    n = len(h) if length is None else length
    return struct.pack("<Q", n) + h + bytes((i * 37) & 0xFF for i in range(data_size))


# (file name, bytes, [expected message fragments])
CASES = [
    ("truncated.safetensors", b"\x10\x00\x00",
     ["truncated.safetensors: file is 3 bytes, expected at least 8"]),
    ("header_length_lies.safetensors", file_bytes({}, 0, length=4096),
     ["header_length_lies.safetensors: header length 4096", "8 + 4096 > file size 10"]),
    ("header_too_large.safetensors", file_bytes({}, 0, length=100_000_001),
     ["header length 100000001", "exceeds the limit of 100000000 bytes"]),
    ("bad_json.safetensors", file_bytes('{"w": {"dtype": "U8",', 0),
     ["bad_json.safetensors: header is not valid JSON"]),
    ("bad_utf8.safetensors", file_bytes(b'{"w\xc3\x28": 1}', 0),
     ["bad_utf8.safetensors: header is not valid JSON", "ill-formed UTF-8", "\\xc3("]),
    ("not_object.safetensors", file_bytes("[]", 0),
     ["not_object.safetensors: header is an array ([]), expected a JSON object"]),
    ("metadata_not_strings.safetensors", file_bytes({"__metadata__": {"format": 1}}, 0),
     ["__metadata__ key format is an integer (1), expected a string"]),
    ("missing_dtype.safetensors", file_bytes({"w": {"shape": [1], "data_offsets": [0, 1]}}, 1),
     ["tensor w: missing field dtype"]),
    ("missing_shape.safetensors", file_bytes({"w": {"dtype": "U8", "data_offsets": [0, 1]}}, 1),
     ["tensor w: missing field shape"]),
    ("missing_data_offsets.safetensors", file_bytes({"w": {"dtype": "U8", "shape": [1]}}, 1),
     ["tensor w: missing field data_offsets"]),
    ("unknown_dtype.safetensors", file_bytes({"w": entry("Q4_K", [4], 0, 4)}, 4),
     ["tensor w: dtype \"Q4_K\" is not supported", "expected one of BOOL"]),
    ("negative_dim.safetensors", file_bytes({"w": entry("U8", [4, -1], 0, 4)}, 4),
     ["tensor w: shape[1] is -1, expected a non-negative integer"]),
    ("non_integer_dim.safetensors", file_bytes({"w": entry("U8", [1.5], 0, 1)}, 1),
     ["tensor w: shape[0] is a number (1.5), expected a non-negative integer"]),
    ("overflow_dims.safetensors", file_bytes({"w": entry("BF16", [2**32, 2**32, 2], 0, 2)}, 2),
     ["tensor w: shape [4294967296, 4294967296, 2] has more elements than fit in 64 bits"]),
    ("overflow_bytes.safetensors", file_bytes({"w": entry("F32", [2**62], 0, 4)}, 4),
     ["tensor w: shape [4611686018427387904] x F32 4 bytes is more bytes than fit in 64 bits"]),
    ("begin_after_end.safetensors", file_bytes({"w": entry("U8", [0], 4, 0)}, 4),
     ["tensor w: data_offsets [4, 0) has begin 4 > end 0"]),
    ("bad_data_offsets.safetensors", file_bytes({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, 2),
     ["tensor w: field data_offsets is an array ([0,1,2]), expected [begin, end]"]),
    ("out_of_file.safetensors", file_bytes({"w": entry("F32", [16], 0, 64)}, 32),
     ["out_of_file.safetensors: tensor w: data_offsets [0, 64) end beyond the file",
      "end 64 > data section size 32"]),
    ("wrong_size.safetensors",
     file_bytes({"model.layers.0.mlp.up_proj.weight": entry("BF16", [9216, 256], 0, 100)}, 100),
     ["wrong_size.safetensors: tensor model.layers.0.mlp.up_proj.weight: data_offsets [0, 100) hold 100 bytes, "
      "expected 4718592 (shape [9216, 256] x BF16 2 bytes)"]),
    ("overlapping.safetensors",
     file_bytes({"a": entry("U8", [8], 0, 8), "b": entry("U8", [8], 4, 12)}, 12),
     ["tensor b: data_offsets [4, 12) overlap tensor a data_offsets [0, 8), expected begin 8"]),
    ("gap.safetensors",
     file_bytes({"a": entry("U8", [8], 0, 8), "b": entry("U8", [8], 16, 24)}, 24),
     ["gap.safetensors: data bytes [8, 16) between tensor a (ends at 8) and tensor b (begins at 16) "
      "belong to no tensor"]),
    ("trailing_bytes.safetensors", file_bytes({"a": entry("U8", [8], 0, 8)}, 12),
     ["data bytes [8, 12) after tensor a (ends at 8) belong to no tensor", "data section is 12 bytes, expected 8"]),
    # json.dumps cannot produce a duplicate key, so this header is written by hand.
    ("duplicate_name.safetensors",
     file_bytes('{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                '"w":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}', 8),
     ["duplicate_name.safetensors: tensor w appears more than once in the header"]),
    # The JSON library copies and prints values recursively: a header nested 100000 deep must be refused
    # while parsing, before anything quotes it.
    ("deep_nesting.safetensors", file_bytes('{"w":' + "[" * 100000 + "]" * 100000 + "}", 0),
     ["deep_nesting.safetensors: header nests arrays and objects deeper than 64 levels (at byte 76 of the file)"]),
    ("long_dtype.safetensors", file_bytes({"w": entry("Q" * 100000, [4], 0, 4)}, 4),
     ['tensor w: dtype "QQQ', "... (100000 bytes)\" is not supported"]),
]


def main():
    lines = ["# <file>\\t<fragment the parser's message must contain>; written by make_corpus.py, do not edit"]
    for name, data, fragments in CASES:
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(data)
        for frag in fragments:
            assert "\t" not in frag and "\n" not in frag
            lines.append(f"{name}\t{frag}")
    with open(os.path.join(HERE, "expected.txt"), "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(CASES)} files and expected.txt to {HERE}")


if __name__ == "__main__":
    main()
