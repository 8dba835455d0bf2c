#!/usr/bin/env python3
"""Write tests/data/corrupt/: hostile GGUF and safetensors files, and model folders each broken in one
field, each named after what is wrong with it. The corelm folders with sparse matrices are written by
corelm's own convert (tiny_sparse_corelm_folder) and then edited.

    python tools/make_corrupt_corpus.py            # (re)writes tests/data/corrupt/
    python tools/make_corrupt_corpus.py --out DIR  # somewhere else

Modelled on llama.cpp's tests/test-gguf.cpp and the safetensors spec (shared/docs/users-and-reliability.md,
section 3a). The files are tiny (< 64 KB) even where they *declare* exabytes: a parser that trusts a
declared size before checking it against the file fails these tests. Files whose name starts with
"valid_" are well-formed and must load. Deterministic: the same bytes every run.

Also importable: `build_gguf` / `gguf_kv` / `gguf_tensor_info` / `build_safetensors` build files by hand
with struct (no gguf or safetensors package), and `cases()` lists (file name, bytes, expected message
fragment) so tests can check that each file fails for the intended reason.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "tests", "data", "corrupt")

# GGUF value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
        BOOL: "<B", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
# ggml types used here.
F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, BF16 = 0, 1, 2, 3, 6, 8, 30
Q4_K, Q6_K, IQ2_XXS = 12, 14, 16
_TYPE_SIZE = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q8_0: (32, 34),
              BF16: (1, 2)}


class Case(NamedTuple):
    name: str
    data: bytes
    expect: Optional[str]   # a fragment of the ModelLoadError message; None for a valid file


# ---------------------------------------------------------------------------------------------------
# GGUF, by hand.

def u32(x: int) -> bytes:
    return struct.pack("<I", x)


def u64(x: int) -> bytes:
    return struct.pack("<Q", x)


def gguf_string(s) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return u64(len(b)) + b


def gguf_value(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return gguf_string(value)
    if vtype == ARRAY:
        etype, items = value
        return u32(etype) + u64(len(items)) + b"".join(gguf_value(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


def gguf_kv(key, vtype: int, value: Any) -> bytes:
    """One metadata entry. For arrays, value is (element_type, [items])."""
    return gguf_string(key) + u32(vtype) + gguf_value(vtype, value)


def gguf_tensor_info(name, ne: Sequence[int], ggml_type: int, offset: int) -> bytes:
    """One tensor-info record; ne in ggml order (ne[0] = the contiguous row length), stored as int64."""
    return gguf_string(name) + u32(len(ne)) + b"".join(struct.pack("<q", d) for d in ne) + \
        u32(ggml_type) + u64(offset)


def gguf_file(kvs: Sequence[bytes], infos: Sequence[bytes], data: bytes = b"", *, version: int = 3,
              n_kv: Optional[int] = None, n_tensors: Optional[int] = None, alignment: int = 32,
              magic: bytes = b"GGUF") -> bytes:
    """Raw assembly: header, metadata, tensor infos, padding to `alignment`, data. Counts may lie."""
    head = magic + u32(version) + u64(len(infos) if n_tensors is None else n_tensors) + \
        u64(len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    return body + b"\0" * (-len(body) % alignment) + data


def tensor_nbytes(ne: Sequence[int], ggml_type: int) -> int:
    block, size = _TYPE_SIZE[ggml_type]
    return int(np.prod(ne, dtype=object)) // block * size


def build_gguf(metadata: Sequence[Tuple[str, int, Any]], tensors: Sequence[Tuple[str, Sequence[int], int, bytes]],
               *, version: int = 3, alignment: int = 32) -> bytes:
    """A valid GGUF: metadata as (key, type, value); tensors as (name, ne, ggml_type, raw bytes), laid
    out in order at aligned offsets. Writes general.alignment when it is not the default 32."""
    kvs = [gguf_kv(k, t, v) for k, t, v in metadata]
    if alignment != 32:
        kvs.append(gguf_kv("general.alignment", UINT32, alignment))
    infos, data = [], b""
    for name, ne, ggml_type, raw in tensors:
        assert ggml_type not in _TYPE_SIZE or len(raw) == tensor_nbytes(ne, ggml_type), name
        infos.append(gguf_tensor_info(name, ne, ggml_type, len(data)))
        data += raw + b"\0" * (-len(raw) % alignment)
    return gguf_file(kvs, infos, data, version=version, alignment=alignment)


# Raw tensor payloads, from fixed values so the corpus is deterministic.

def f32_bytes(x) -> bytes:
    return np.asarray(x, dtype="<f4").tobytes()


def f16_bytes(x) -> bytes:
    return np.asarray(x, dtype="<f2").tobytes()


def bf16_bytes(x) -> bytes:
    return (np.asarray(x, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()


def q8_0_bytes(d: Sequence[float], qs: np.ndarray) -> bytes:
    """Blocks of (f16 scale, 32 int8)."""
    qs = np.asarray(qs, dtype=np.int8).reshape(len(d), 32)
    return b"".join(f16_bytes([di]) + q.tobytes() for di, q in zip(d, qs))


def q4_0_bytes(d: Sequence[float], nibbles: np.ndarray) -> bytes:
    """Blocks of (f16 scale, 16 bytes): byte j = element j (low nibble) | element j+16 (high nibble)."""
    n = np.asarray(nibbles, dtype=np.uint8).reshape(len(d), 32)
    packed = (n[:, :16] | (n[:, 16:] << 4)).astype(np.uint8)
    return b"".join(f16_bytes([di]) + p.tobytes() for di, p in zip(d, packed))


def q4_1_bytes(d: Sequence[float], m: Sequence[float], nibbles: np.ndarray) -> bytes:
    n = np.asarray(nibbles, dtype=np.uint8).reshape(len(d), 32)
    packed = (n[:, :16] | (n[:, 16:] << 4)).astype(np.uint8)
    return b"".join(f16_bytes([di, mi]) + p.tobytes() for di, mi, p in zip(d, m, packed))


def _ramp(n: int, mod: int) -> np.ndarray:
    return np.arange(n) % mod


VALID_METADATA = [
    ("general.architecture", STRING, "llama"),
    ("general.name", STRING, "corelm corrupt-corpus baseline"),
    ("general.quantization_version", UINT32, 2),
    ("test.flag", BOOL, True),
    ("test.float", FLOAT32, 0.5),
    ("test.int64", INT64, -7),
    ("test.scores", ARRAY, (FLOAT32, [0.0, -1.5, 2.25])),
    ("test.tokens", ARRAY, (STRING, ["<unk>", "hello", "wörld"])),
]


def valid_tensors() -> List[Tuple[str, List[int], int, bytes]]:
    """One tensor of every type corelm decodes; values are simple ramps (see tests for the expected floats)."""
    return [
        ("f32", [4, 2], F32, f32_bytes(np.arange(8) - 3.5)),
        ("f16", [8], F16, f16_bytes(np.arange(8) * 0.25)),
        ("bf16", [4], BF16, bf16_bytes([1.0, -2.0, 0.5, 3.0])),
        ("q8_0", [32, 2], Q8_0, q8_0_bytes([0.5, 0.25], _ramp(64, 200) - 100)),
        ("q4_0", [32], Q4_0, q4_0_bytes([2.0], _ramp(32, 16))),
        ("q4_1", [64], Q4_1, q4_1_bytes([0.5, 1.0], [-1.0, 3.0], _ramp(64, 16))),
    ]


def valid_gguf(version: int = 3) -> bytes:
    return build_gguf(VALID_METADATA, valid_tensors(), version=version)


# ---------------------------------------------------------------------------------------------------
# The GGUF cases.

_BASE_KV = [gguf_kv("general.architecture", STRING, "llama")]
_ONE_F32 = f32_bytes(np.zeros(8))


def _one_tensor(ne, ggml_type=F32, offset=0, data=_ONE_F32, kvs=None, name="t") -> bytes:
    return gguf_file(_BASE_KV if kvs is None else kvs, [gguf_tensor_info(name, ne, ggml_type, offset)], data)


def _with_kv(kv: bytes, n_kv: Optional[int] = None) -> bytes:
    return gguf_file(_BASE_KV + [kv], [], n_kv=n_kv)


def gguf_cases() -> List[Case]:
    good = valid_gguf()
    # Where the valid file's sections end, for the truncation cases: header is 24 bytes.
    kv_end = 24 + sum(len(gguf_kv(k, t, v)) for k, t, v in VALID_METADATA)
    header_end = kv_end + sum(len(gguf_tensor_info(n, ne, ty, 0)) for n, ne, ty, _ in valid_tensors())
    two_f32 = gguf_file(_BASE_KV, [gguf_tensor_info("a", [8], F32, 0), gguf_tensor_info("b", [8], F32, 32)],
                        _ONE_F32 + _ONE_F32)
    c = [
        Case("valid_tiny.gguf", good, None),
        Case("valid_tiny_v2.gguf", valid_gguf(version=2), None),
        Case("valid_metadata_only.gguf", gguf_file(_BASE_KV, []), None),
        Case("valid_alignment_64.gguf", build_gguf(VALID_METADATA, valid_tensors(), alignment=64), None),
        Case("gguf_empty_file.gguf", b"", "empty"),
        Case("gguf_bad_magic.gguf", b"GGML" + good[4:], "bad magic"),
        Case("gguf_version_0.gguf", gguf_file(_BASE_KV, [], version=0), "version 0"),
        Case("gguf_version_1.gguf", gguf_file(_BASE_KV, [], version=1), "version 1"),
        Case("gguf_version_999.gguf", gguf_file(_BASE_KV, [], version=999), "version 999"),
        Case("gguf_big_endian.gguf", gguf_file(_BASE_KV, [], version=3 << 24), "big-endian"),
        Case("gguf_n_tensors_2pow63.gguf", gguf_file(_BASE_KV, [], n_tensors=1 << 63), "tensor count"),
        Case("gguf_n_tensors_minus1.gguf", gguf_file(_BASE_KV, [], n_tensors=(1 << 64) - 1), "tensor count"),
        Case("gguf_n_kv_2pow63.gguf", gguf_file(_BASE_KV, [], n_kv=1 << 63), "metadata key count"),
        Case("gguf_n_kv_minus1.gguf", gguf_file(_BASE_KV, [], n_kv=(1 << 64) - 1), "metadata key count"),
        Case("gguf_n_kv_more_than_present.gguf", gguf_file(_BASE_KV, [], n_kv=3, alignment=1), "truncated"),
        Case("gguf_key_len_2pow63.gguf", _with_kv(u64(1 << 63) + b"k" + u32(UINT8) + b"\1"), "claims a length"),
        Case("gguf_key_len_past_eof.gguf", _with_kv(u64(500) + b"general.x" + u32(UINT8) + b"\1"), "truncated"),
        Case("gguf_key_len_2000.gguf", _with_kv(gguf_kv("k" * 2000, UINT8, 1)), "limit 1024"),
        Case("gguf_key_empty.gguf", _with_kv(gguf_kv("", UINT8, 1)), "empty"),
        Case("gguf_key_not_utf8.gguf", _with_kv(gguf_kv(b"bad\xff\xfekey", UINT8, 1)), "UTF-8"),
        Case("gguf_string_len_2pow63.gguf", _with_kv(gguf_string("general.name") + u32(STRING) + u64(1 << 63)),
             "claims a length"),
        Case("gguf_string_len_past_eof.gguf",
             _with_kv(gguf_string("general.name") + u32(STRING) + u64(60000) + b"abc"), "truncated"),
        Case("gguf_string_not_utf8.gguf", _with_kv(gguf_kv("general.name", STRING, b"\xc3\x28")), "UTF-8"),
        Case("gguf_array_len_2pow62.gguf",
             _with_kv(gguf_string("a.scores") + u32(ARRAY) + u32(FLOAT32) + u64(1 << 62) + f32_bytes([1.0])),
             "more than the file can hold"),
        Case("gguf_string_array_len_2pow62.gguf",
             _with_kv(gguf_string("a.tokens") + u32(ARRAY) + u32(STRING) + u64(1 << 62) + gguf_string("x")),
             "more than the file can hold"),
        Case("gguf_array_len_past_eof.gguf",
             _with_kv(gguf_string("a.ids") + u32(ARRAY) + u32(UINT32) + u64(100) + u32(1) * 10),
             "more than the file can hold"),
        Case("gguf_unknown_kv_type.gguf", _with_kv(gguf_string("a.b") + u32(13) + u64(0)), "unknown value type 13"),
        Case("gguf_unknown_kv_type_huge.gguf", _with_kv(gguf_string("a.b") + u32(0xFFFFFFFF) + u64(0)),
             "unknown value type"),
        Case("gguf_unknown_array_elem_type.gguf",
             _with_kv(gguf_string("a.b") + u32(ARRAY) + u32(77) + u64(1) + u64(0)), "unknown element type 77"),
        Case("gguf_nested_array.gguf",
             _with_kv(gguf_string("a.b") + u32(ARRAY) + u32(ARRAY) + u64(1) + u32(UINT8) + u64(1) + b"\1"),
             "nested array"),
        Case("gguf_duplicate_key.gguf",
             gguf_file(_BASE_KV + [gguf_kv("general.name", STRING, "a"), gguf_kv("general.name", STRING, "b")], []),
             "duplicate metadata key"),
        Case("gguf_duplicate_tensor_name.gguf",
             gguf_file(_BASE_KV, [gguf_tensor_info("w", [8], F32, 0), gguf_tensor_info("w", [8], F32, 32)],
                       _ONE_F32 * 2), "duplicate tensor name"),
        Case("gguf_tensor_name_empty.gguf", _one_tensor([8], name=""), "empty name"),
        Case("gguf_tensor_name_len_2pow63.gguf",
             gguf_file(_BASE_KV, [u64(1 << 63) + b"t" + u32(1) + u64(8) + u32(F32) + u64(0)], _ONE_F32),
             "claims a length"),
        Case("gguf_n_dims_5.gguf", _one_tensor([2, 2, 2, 1, 1]), "5 dimensions"),
        Case("gguf_n_dims_0.gguf", _one_tensor([]), "0 dimensions"),
        Case("gguf_n_dims_huge.gguf",
             gguf_file(_BASE_KV, [gguf_string("t") + u32(0xFFFFFFFF) + u64(8)], _ONE_F32), "dimensions"),
        Case("gguf_dim_0.gguf", _one_tensor([8, 0]), "dimension of 0"),
        Case("gguf_dim_negative.gguf", _one_tensor([8, -1]), "dimension of -1"),
        Case("gguf_dims_product_overflow.gguf", _one_tensor([1 << 32, 1 << 32, 1 << 32]), "too many elements"),
        Case("gguf_ne_2pow42_plus_1.gguf", _one_tensor([(1 << 42) + 1, 1 << 22]), "too many elements"),
        Case("gguf_nbytes_overflow.gguf", _one_tensor([1 << 31, 1 << 31]), "would take"),
        Case("gguf_two_tensors_0x7FFFFFFFFFFFFFC0.gguf",
             gguf_file(_BASE_KV, [gguf_tensor_info("a", [0x7FFFFFFFFFFFFFC0], Q8_0, 0),
                                  gguf_tensor_info("b", [0x7FFFFFFFFFFFFFC0], Q8_0, 0)]), "too many elements"),
        Case("gguf_unknown_ggml_type_99.gguf", _one_tensor([8], ggml_type=99), "unknown ggml type 99"),
        Case("gguf_removed_ggml_type_4.gguf", _one_tensor([32], ggml_type=4), "unknown ggml type 4"),
        Case("gguf_ggml_type_huge.gguf", _one_tensor([8], ggml_type=0xFFFFFFFF), "unknown ggml type"),
        Case("gguf_quant_row_not_multiple_of_32.gguf", _one_tensor([33, 1], ggml_type=Q8_0, data=b"\0" * 64),
             "not a multiple of the Q8_0 block size"),
        Case("gguf_offset_beyond_file.gguf", _one_tensor([8], offset=1 << 40), "past the end"),
        Case("gguf_offset_2pow64_minus_32.gguf", _one_tensor([8], offset=(1 << 64) - 32), "past the end"),
        Case("gguf_offset_misaligned.gguf", _one_tensor([4], offset=4), "alignment"),
        Case("gguf_overlapping_tensors.gguf",
             gguf_file(_BASE_KV, [gguf_tensor_info("a", [16], F32, 0), gguf_tensor_info("b", [8], F32, 32)],
                       _ONE_F32 * 3), "overlap"),
        Case("gguf_alignment_0.gguf", _one_tensor([8], kvs=_BASE_KV + [gguf_kv("general.alignment", UINT32, 0)]),
             "general.alignment = 0"),
        Case("gguf_alignment_3.gguf", _one_tensor([8], kvs=_BASE_KV + [gguf_kv("general.alignment", UINT32, 3)]),
             "general.alignment = 3"),
        Case("gguf_alignment_2pow31.gguf",
             _one_tensor([8], kvs=_BASE_KV + [gguf_kv("general.alignment", UINT32, 1 << 31)]),
             "general.alignment = 2147483648"),
        Case("gguf_alignment_int32_type.gguf",
             _one_tensor([8], kvs=_BASE_KV + [gguf_kv("general.alignment", INT32, 32)]), "must be a UINT32"),
        Case("gguf_alignment_string_type.gguf",
             _one_tensor([8], kvs=_BASE_KV + [gguf_kv("general.alignment", STRING, "32")]), "must be a UINT32"),
        Case("gguf_truncated_in_header.gguf", good[:14], "truncated"),
        Case("gguf_truncated_in_metadata.gguf", good[:kv_end - 5], "truncated"),
        Case("gguf_truncated_in_tensor_info.gguf", good[:header_end - 3], "truncated"),
        Case("gguf_truncated_before_data.gguf", good[:header_end], "truncated"),
        Case("gguf_truncated_in_data.gguf", good[:len(good) - 40], "past the end"),
        Case("gguf_tensor_past_end_of_data.gguf", two_f32[:-1], "past the end"),
        Case("gguf_iq2_xxs_tensor_unsupported.gguf", _one_tensor([256], ggml_type=IQ2_XXS, data=b"\0" * 66),
             "IQ2_XXS, which corelm does not support yet"),
        Case("gguf_q4_k_row_not_multiple_of_256.gguf", _one_tensor([288, 1], ggml_type=Q4_K, data=b"\0" * 288),
             "not a multiple of the Q4_K block size"),
        Case("gguf_q6_k_truncated_super_block.gguf", _one_tensor([512], ggml_type=Q6_K, data=b"\0" * 300),
             "past the end"),
        Case("gguf_unknown_ggml_type_36.gguf", _one_tensor([256], ggml_type=36, data=b"\0" * 144),
             "unknown ggml type 36"),
        # Q4_1 blocks (20 bytes) labelled Q4_0 (18): every tensor still fits, and decodes as garbage.
        Case("gguf_q4_1_relabelled_q4_0.gguf", _relabelled(last=False), "does not match the bytes stored"),
        Case("gguf_q4_1_relabelled_q4_0_last_tensor.gguf", _relabelled(last=True), "does not match its stored"),
        Case("gguf_gap_between_tensors.gguf",
             gguf_file(_BASE_KV, [gguf_tensor_info("a", [8], F32, 0), gguf_tensor_info("b", [8], F32, 64)],
                       _ONE_F32 + b"\0" * 32 + _ONE_F32), "does not match the bytes stored"),
    ]
    return c


def _relabelled(last: bool) -> bytes:
    q41 = q4_1_bytes([0.5] * 32, [-1.0] * 32, _ramp(32 * 32, 16))         # 32 blocks: 640 bytes
    infos = [gguf_tensor_info("a", [32, 32], Q4_0, 0)]
    data = q41
    if not last:
        infos.append(gguf_tensor_info("b", [8], F32, len(q41)))
        data += _ONE_F32
    return gguf_file(_BASE_KV, infos, data)


# ---------------------------------------------------------------------------------------------------
# safetensors, by hand.

def build_safetensors(header: Any, data: bytes = b"", *, raw_header: Optional[bytes] = None,
                      header_len: Optional[int] = None) -> bytes:
    """u64 header length | header | data. `header` is JSON-encoded unless raw_header is given;
    header_len lies about the length when set."""
    h = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode("utf-8")
    return struct.pack("<Q", len(h) if header_len is None else header_len) + h + data


def safetensors_from_arrays(arrays: Dict[str, Tuple[str, Sequence[int], bytes]],
                            metadata: Optional[Dict[str, str]] = None) -> bytes:
    """A valid file from {name: (dtype, shape, raw bytes)}, laid out in order."""
    header: Dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    data = b""
    for name, (dtype, shape, raw) in arrays.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return build_safetensors(header, data)


def valid_safetensors() -> bytes:
    return safetensors_from_arrays({
        "f32": ("F32", [2, 3], f32_bytes(np.arange(6) - 2.5)),
        "f16": ("F16", [4], f16_bytes([0.5, -1.0, 2.0, 1024.0])),
        "bf16": ("BF16", [2, 2], bf16_bytes([1.0, -2.0, 0.5, 3.0])),
        "i8": ("I8", [3], np.array([-1, 0, 7], dtype=np.int8).tobytes()),
        "scalar": ("F32", [], f32_bytes([42.0])),
        "empty": ("F32", [0, 4], b""),
    }, metadata={"format": "pt"})


def _st_entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> Dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


_EIGHT = b"\0" * 8


def _padded_header() -> bytes:
    return json.dumps({"a": _st_entry()}).encode() + b"    "


def safetensors_cases() -> List[Case]:
    dup = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    deep = b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"
    return [
        Case("valid_tiny.safetensors", valid_safetensors(), None),
        Case("valid_padded_header.safetensors",
             build_safetensors(None, _EIGHT, raw_header=json.dumps({"a": _st_entry()}).encode() + b"      "), None),
        Case("st_empty_file.safetensors", b"", "empty"),
        Case("st_shorter_than_8_bytes.safetensors", b"\x10\0\0", "too short"),
        Case("st_header_len_past_eof.safetensors", build_safetensors({"a": _st_entry()}, _EIGHT, header_len=4096),
             "larger than the rest of the file"),
        Case("st_header_len_2pow63.safetensors", build_safetensors({"a": _st_entry()}, _EIGHT, header_len=1 << 63),
             "exceeds"),
        Case("st_header_len_zero.safetensors", build_safetensors(None, _EIGHT, raw_header=b""),
             "does not start with"),
        Case("st_header_not_json.safetensors", build_safetensors(None, _EIGHT, raw_header=b"{not json at all"),
             "not valid JSON"),
        Case("st_header_json_array.safetensors", build_safetensors([1, 2, 3], _EIGHT), "does not start with"),
        Case("st_header_not_utf8.safetensors",
             build_safetensors(None, _EIGHT, raw_header=b'{"a\xff\xfe":{"dtype":"F32"}}'), "UTF-8"),
        Case("st_header_nan.safetensors",
             build_safetensors(None, _EIGHT, raw_header=b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}}'),
             "not valid JSON"),
        Case("st_header_deeply_nested.safetensors", build_safetensors(None, _EIGHT, raw_header=deep),
             "nested too deeply"),
        Case("st_duplicate_names.safetensors", build_safetensors(None, _EIGHT, raw_header=dup), "duplicate key"),
        Case("st_empty_name.safetensors", build_safetensors({"": _st_entry()}, _EIGHT), "empty name"),
        Case("st_name_too_long.safetensors", build_safetensors({"n" * 5000: _st_entry()}, _EIGHT), "longer than"),
        Case("st_entry_not_object.safetensors", build_safetensors({"a": [1, 2]}, _EIGHT), "exactly the keys"),
        Case("st_entry_extra_key.safetensors", build_safetensors({"a": dict(_st_entry(), x=1)}, _EIGHT),
             "exactly the keys"),
        Case("st_offsets_out_of_range.safetensors", build_safetensors({"a": _st_entry(offsets=(8, 16))}, _EIGHT),
             "outside"),
        Case("st_offsets_huge.safetensors",
             build_safetensors({"a": _st_entry(offsets=((1 << 64) - 8, 1 << 64))}, _EIGHT), "outside"),
        Case("st_offsets_negative.safetensors", build_safetensors({"a": _st_entry(offsets=(-8, 0))}, _EIGHT),
             "outside"),
        Case("st_end_before_begin.safetensors",
             build_safetensors({"a": _st_entry(shape=(0,), offsets=(8, 0))}, _EIGHT * 2), "end < begin"),
        Case("st_offsets_not_pair.safetensors", build_safetensors({"a": _st_entry(offsets=(0, 4, 8))}, _EIGHT),
             "data_offsets"),
        Case("st_offsets_float.safetensors", build_safetensors({"a": _st_entry(offsets=(0.0, 8.0))}, _EIGHT),
             "data_offsets"),
        Case("st_size_mismatch_shape.safetensors", build_safetensors({"a": _st_entry(shape=(3,))}, _EIGHT * 2),
             "need 12"),
        Case("st_overlapping.safetensors",
             build_safetensors({"a": _st_entry(offsets=(0, 8)), "b": _st_entry(offsets=(4, 12))}, _EIGHT * 2),
             "overlap"),
        Case("st_unknown_dtype.safetensors", build_safetensors({"a": _st_entry(dtype="Q4_K")}, _EIGHT),
             "unknown dtype"),
        Case("st_dtype_not_string.safetensors", build_safetensors({"a": _st_entry(dtype=4)}, _EIGHT),
             "unknown dtype"),
        Case("st_negative_dim.safetensors", build_safetensors({"a": _st_entry(shape=(-2, -1))}, _EIGHT),
             "invalid shape"),
        Case("st_shape_float.safetensors", build_safetensors({"a": _st_entry(shape=(2.0,))}, _EIGHT),
             "invalid shape"),
        Case("st_shape_bool.safetensors", build_safetensors({"a": _st_entry(shape=(True, 2))}, _EIGHT),
             "invalid shape"),
        Case("st_shape_rank_100.safetensors", build_safetensors({"a": _st_entry(shape=(1,) * 100)}, _EIGHT),
             "invalid shape"),
        Case("st_shape_product_overflow.safetensors",
             build_safetensors({"a": _st_entry(shape=(1 << 32, 1 << 32, 1 << 32))}, _EIGHT), "impossibly large"),
        Case("st_shape_product_wraps_to_0.safetensors",
             build_safetensors({"a": _st_entry(shape=(1 << 63, 4))}, _EIGHT), "impossibly large"),
        Case("st_metadata_not_str.safetensors",
             build_safetensors({"__metadata__": {"format": 1}, "a": _st_entry()}, _EIGHT), "__metadata__"),
        Case("st_metadata_not_object.safetensors",
             build_safetensors({"__metadata__": ["pt"], "a": _st_entry()}, _EIGHT), "__metadata__"),
        # One short: the data buffer starts at the header's last padding space, so every tensor reads one
        # byte off (NaN logits); only the rule that tensors cover the buffer exactly notices.
        Case("st_header_len_one_short.safetensors",
             build_safetensors(None, f32_bytes([1.0, 2.0]), header_len=len(_padded_header()) - 1,
                               raw_header=_padded_header()), "header length is wrong"),
        Case("st_trailing_bytes.safetensors", build_safetensors({"a": _st_entry()}, _EIGHT + b"\0"),
             "trailing bytes"),
        Case("st_hole_between_tensors.safetensors",
             build_safetensors({"a": _st_entry(offsets=(0, 8)), "b": _st_entry(offsets=(12, 20))}, _EIGHT * 3),
             "belong to no tensor"),
        Case("st_f8_dtype_unsupported.safetensors",
             build_safetensors({"a": _st_entry(dtype="F8_E4M3", shape=(8,))}, _EIGHT), "does not support yet"),
    ]


def cases() -> List[Case]:
    return gguf_cases() + safetensors_cases()


# ---------------------------------------------------------------------------------------------------
# Model folders: a tiny but complete Llama (HF config.json + model.safetensors + tokenizer.json), and
# copies of it each broken in one field.

class FolderCase(NamedTuple):
    name: str
    files: Dict[str, bytes]
    expect: Optional[str]           # a fragment of the ModelLoadError message; None when the load succeeds
    warning: Optional[str] = None   # a fragment of the warning the load must log


TINY = dict(vocab=8, dim=32, ffn=32, heads=2, kv_heads=1, head_dim=16, layers=1)
TINY_TOKENS = ["<unk>", "<s>", "</s>", "hello", "world", ",", "!", "a"]


def tiny_hf_arrays() -> Dict[str, np.ndarray]:
    """HF tensor name -> float32 array of the tiny Llama (deterministic values)."""
    v, d, f, h, kv, hd = (TINY[k] for k in ("vocab", "dim", "ffn", "heads", "kv_heads", "head_dim"))
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (h * hd, d),
                       p + "self_attn.k_proj.weight": (kv * hd, d), p + "self_attn.v_proj.weight": (kv * hd, d),
                       p + "self_attn.o_proj.weight": (d, h * hd), p + "post_attention_layernorm.weight": (d,),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    out = {}
    for j, (name, shape) in enumerate(shapes.items()):
        n = int(np.prod(shape))
        vals = np.ones(n) if len(shape) == 1 else np.sin(np.arange(n) * 0.37 + j) * 0.1
        out[name] = vals.astype(np.float32).reshape(shape)
    return out


def tiny_hf_config() -> Dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": TINY["vocab"],
            "hidden_size": TINY["dim"], "intermediate_size": TINY["ffn"], "num_hidden_layers": TINY["layers"],
            "num_attention_heads": TINY["heads"], "num_key_value_heads": TINY["kv_heads"],
            "head_dim": TINY["head_dim"], "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def tiny_tokenizer_json() -> Dict[str, Any]:
    """A WordLevel tokenizer whose post_processor prepends <s>, as Llama's does."""
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i, t in enumerate(TINY_TOKENS[:3])],
            "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": {"type": "TemplateProcessing",
                               "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                          {"Sequence": {"id": "A", "type_id": 0}}],
                               "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}},
                                        {"Sequence": {"id": "B", "type_id": 1}}],
                               "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
            "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(TINY_TOKENS)},
                      "unk_token": "<unk>"}}


TINY_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


def _json_bytes(doc: Any) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode("utf-8")


def tiny_hf_folder(config: Optional[Dict[str, Any]] = None, tokenizer: Optional[Dict[str, Any]] = None,
                   arrays: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, bytes]:
    """file name -> bytes of the tiny HF model folder (arguments replace its parts)."""
    arrays = tiny_hf_arrays() if arrays is None else arrays
    st = safetensors_from_arrays({k: ("F32", list(a.shape), a.astype("<f4").tobytes()) for k, a in arrays.items()},
                                 {"format": "pt"})
    return {"config.json": _json_bytes(tiny_hf_config() if config is None else config),
            "model.safetensors": st,
            "tokenizer.json": _json_bytes(tiny_tokenizer_json() if tokenizer is None else tokenizer),
            "tokenizer_config.json": _json_bytes({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                                                  "chat_template": TINY_CHAT_TEMPLATE})}


def tiny_moe_arrays(experts: int = 2) -> Dict[str, np.ndarray]:
    """The tiny Llama with a Mixtral MLP of `experts` experts (router and w1/w3/w2 per expert)."""
    arrays = tiny_hf_arrays()
    d, f = TINY["dim"], TINY["ffn"]
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        for part in ("gate_proj", "up_proj", "down_proj"):
            del arrays[f"{p}mlp.{part}.weight"]
        moe = p + "block_sparse_moe."
        arrays[moe + "gate.weight"] = (np.cos(np.arange(experts * d)) * 0.5).astype(np.float32).reshape(experts, d)
        for e in range(experts):
            for w, shape in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f))):
                arrays[f"{moe}experts.{e}.{w}.weight"] = \
                    (np.sin(np.arange(f * d) * 0.29 + e) * 0.1).astype(np.float32).reshape(shape)
    return arrays


def tiny_moe_config(**edits) -> Dict[str, Any]:
    return {**tiny_hf_config(), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": 2, "num_experts_per_tok": 1, **edits}


def folder_cases() -> List[FolderCase]:
    def config(**edits):
        return tiny_hf_folder(config=dict(tiny_hf_config(), **edits))

    def moe(**edits):
        return tiny_hf_folder(config=tiny_moe_config(**edits), arrays=tiny_moe_arrays())

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    no_low = {k: v for k, v in llama3.items() if k != "low_freq_factor"}
    tok = tiny_tokenizer_json()
    tok["post_processor"]["special_tokens"] = {}      # the templates name <s>, which is now undefined
    nan_arrays = tiny_hf_arrays()
    nan_arrays["model.layers.0.mlp.up_proj.weight"][3, 5] = np.nan
    return [
        FolderCase("valid_tiny_hf", tiny_hf_folder(), None),
        FolderCase("valid_tiny_hf_llama3_rope", config(rope_scaling=llama3), None),
        FolderCase("hf_post_processor_names_missing_token", tiny_hf_folder(tokenizer=tok),
                   "names the special token '<s>'"),
        FolderCase("hf_rope_linear_without_factor", config(rope_scaling={"rope_type": "linear"}), "needs 'factor'"),
        FolderCase("hf_rope_llama3_without_low_freq_factor", config(rope_scaling=no_low), "needs 'low_freq_factor'"),
        FolderCase("hf_rope_factor_0", config(rope_scaling={"rope_type": "linear", "factor": 0}),
                   "rope_scaling.factor = 0"),
        FolderCase("hf_rope_factor_nan", config(rope_scaling={"rope_type": "linear", "factor": float("nan")}),
                   "rope_scaling.factor = nan"),
        FolderCase("hf_rms_norm_eps_1e308", config(rms_norm_eps=1e308), "rms_norm_eps = 1e+308"),
        # found by tools/fuzz.py: was a TypeError (unhashable type) from the architecture lookup
        FolderCase("hf_architectures_holds_a_list", config(architectures=[["LlamaForCausalLM"]]),
                   "unsupported architecture"),
        FolderCase("hf_nan_weight", tiny_hf_folder(arrays=nan_arrays), None, "1 non-finite value"),
        # the model-families issue: counts that disagree with the tensors are named
        FolderCase("valid_tiny_hf_moe", moe(), None),
        FolderCase("hf_moe_expert_count_above_tensors", moe(num_local_experts=3), "num_local_experts = 3"),
        FolderCase("hf_moe_experts_used_above_count", moe(num_experts_per_tok=3), "num_experts_per_tok = 3"),
        FolderCase("hf_moe_experts_used_0", moe(num_experts_per_tok=0), "num_experts_per_tok = 0"),
        FolderCase("hf_head_count_disagrees_with_q_proj", config(num_attention_heads=4), "num_attention_heads"),
    ]


def tiny_sparse_corelm_folder(weights: str = "bf16") -> Dict[str, bytes]:
    """file name -> bytes of the tiny HF model converted by corelm itself to a corelm folder whose layer
    matrices are pruned to 50% and stored sparse (weights bf16: sbf16; q8_0: sq8), its source path made
    relative so that the bytes do not depend on where the conversion ran."""
    import tempfile
    import zlib
    from corelm.convert import convert
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "valid_tiny_hf")
        os.makedirs(src)
        for fname, data in tiny_hf_folder().items():
            with open(os.path.join(src, fname), "wb") as f:
                f.write(data)
        convert(src, os.path.join(tmp, "out"), weights=weights, sparsity=0.5, prune="magnitude")
        files = {}
        for fname in sorted(os.listdir(os.path.join(tmp, "out"))):
            with open(os.path.join(tmp, "out", fname), "rb") as f:
                files[fname] = f.read()
    path = json.dumps(src).encode()
    files["config.json"] = files["config.json"].replace(path, b'"valid_tiny_hf"')
    w = bytearray(files["weights.corelm"])  # the header (CRC-checked) names the source too: same length
    h = struct.unpack_from("<Q", w, 16)[0]
    header = bytes(w[32:32 + h]).replace(path, b'"valid_tiny_hf"')
    header += b" " * (h - len(header))
    w[32:32 + h] = header
    struct.pack_into("<I", w, 24, zlib.crc32(bytes(w[:24]) + header) & 0xffffffff)
    files["weights.corelm"] = bytes(w)
    return files


def _header_edit(files: Dict[str, bytes], edit) -> Dict[str, bytes]:
    """files with edit(tensor entries) applied to weights.corelm's header (its length kept, its CRC redone)."""
    import zlib
    w = bytearray(files["weights.corelm"])
    h = struct.unpack_from("<Q", w, 16)[0]
    doc = json.loads(bytes(w[32:32 + h]))
    edit(doc["tensors"])
    header = json.dumps(doc, separators=(",", ":")).encode()
    assert len(header) <= h
    header += b" " * (h - len(header))
    w[32:32 + h] = header
    struct.pack_into("<I", w, 24, zlib.crc32(bytes(w[:24]) + header) & 0xffffffff)
    return dict(files, **{"weights.corelm": bytes(w)})


def _sparse_tensor_edit(files: Dict[str, bytes], name: str, edit) -> Dict[str, bytes]:
    """files with edit(bytearray of tensor `name`'s bytes) applied to its data in weights.corelm."""
    w = bytearray(files["weights.corelm"])
    h = struct.unpack_from("<Q", w, 16)[0]
    entry = next(t for t in json.loads(bytes(w[32:32 + h]))["tensors"] if t["name"] == name)
    start = (32 + h + 63) // 64 * 64 + entry["offset"]
    data = bytearray(w[start:start + entry["nbytes"]])
    edit(data)
    w[start:start + entry["nbytes"]] = data
    return dict(files, **{"weights.corelm": bytes(w)})


def _mask_word_edit(change):
    """An edit of a sparse tensor's bytes: row 0's first bitmap word replaced by change(word)."""
    def edit(data):
        data[0:4] = struct.pack("<I", change(struct.unpack_from("<I", data, 0)[0]))
    return edit


def _bitmap_cases(good: Dict[str, bytes], prefix: str, suffix: str, messages: Tuple[str, str]) -> List[FolderCase]:
    """The valid sparse folder `good`, and it with layers.0.wq's bitmap marking one non-zero more and one fewer
    than it holds (messages: the errors each gives)."""
    one_more = _mask_word_edit(lambda w: w | (~w & (w + 1)))   # the lowest clear bit set
    one_fewer = _mask_word_edit(lambda w: w & (w - 1))         # the lowest set bit cleared
    return [
        FolderCase(f"valid_{prefix}", good, None),
        FolderCase(f"{prefix}_bitmap_one_more_than_{suffix}", _sparse_tensor_edit(good, "layers.0.wq", one_more),
                   messages[0]),
        FolderCase(f"{prefix}_bitmap_one_fewer_than_{suffix}", _sparse_tensor_edit(good, "layers.0.wq", one_fewer),
                   messages[1]),
    ]


def sparse_folder_cases() -> List[FolderCase]:
    """A corelm folder with sparse (sbf16) matrices: valid, and with a bitmap marking one non-zero more or
    one fewer than the values the tensor holds."""
    return _bitmap_cases(tiny_sparse_corelm_folder(), "corelm_sparse", "values",
                         ("marks 513 non-zeros, the tensor holds 512 values",
                          "marks 511 non-zeros, the tensor holds 512 values"))


def sparse_quant_folder_cases() -> List[FolderCase]:
    """A corelm folder with sparse q8_0 (sq8) matrices: valid, with a bitmap marking one non-zero code more or
    one fewer than the codes the tensor holds, and with a tensor's offset past the end of the data."""
    good = tiny_sparse_corelm_folder("q8_0")

    def past_the_end(tensors):
        next(t for t in tensors if t["name"] == "layers.0.wq")["offset"] = 1 << 20
    return _bitmap_cases(good, "corelm_sparse_q8", "codes",
                         ("sq8 tensor 'layers.0.wq': bitmap marks 513 non-zero codes, the tensor holds 512 codes",
                          "sq8 tensor 'layers.0.wq': bitmap marks 511 non-zero codes, the tensor holds 512 codes")) + [
        FolderCase("corelm_sparse_q8_offset_past_the_end", _header_edit(good, past_the_end),
                   "extends past the end of the data section")]


def write_corpus(out: str) -> List[str]:
    os.makedirs(out, exist_ok=True)
    names = []
    for case in cases():
        assert len(case.data) < 64 * 1024, case.name
        with open(os.path.join(out, case.name), "wb") as f:
            f.write(case.data)
        names.append(case.name)
    for fc in folder_cases() + sparse_folder_cases() + sparse_quant_folder_cases():
        d = os.path.join(out, fc.name)
        os.makedirs(d, exist_ok=True)
        for stale in set(os.listdir(d)) - set(fc.files):
            os.remove(os.path.join(d, stale))
        for fname, data in fc.files.items():
            assert len(data) < 64 * 1024, (fc.name, fname)
            with open(os.path.join(d, fname), "wb") as f:
                f.write(data)
        names.append(fc.name)
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    names = write_corpus(args.out)
    print(f"wrote {len(names)} files to {args.out}")


if __name__ == "__main__":
    main()
