"""A hardened GGUF (v2/v3, little-endian) reader.

GGUF files come from strangers on the internet, and llama.cpp's own parser has had a long run of
integer-overflow and out-of-bounds CVEs (see shared/docs/users-and-reliability.md, section 3a). So every
count, length, dimension and offset read from the file is checked against the file's real size *before*
it is used, and nothing is ever allocated from an unchecked number. Every failure is a ModelLoadError
that says what is wrong and where; no IndexError, struct.error or MemoryError leaks out.

Layout (all little-endian):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here, each aligned)
A string is u64 byte length + UTF-8 bytes; an array is u32 element type + u64 count + elements.
"""
from __future__ import annotations

import concurrent.futures
import functools
import gc
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..options import WEIGHT_FORMATS, core_formats
from .checks import (SIZE_KEYS, add_source, check_experts, check_weight_shapes, load_tokenizer, source_shape, split_tensor,
                     validate_spec)
from .families import GGUF_ARCHS, GGUF_MOE_ARCHS, family
from .spec import (LoadedModel, ModelLoadError, ModelSpec, bf16_to_f32, check_finite, check_finite_blocks, kept_float,
                   release_mapped_range, row_range)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20          # llama.cpp PR#24997: an unbounded alignment overflows padding arithmetic
MAX_KEY_LEN = 1 << 10            # keys are short dotted names
MAX_STRING_LEN = 1 << 26         # 64 MiB: chat templates and merges are long, but never this long
# Metadata arrays are per token (the largest vocabularies have ~262k) or per layer. A list of Python values
# takes 8 bytes a pointer plus the object, up to 36 bytes an element, so a cap by the file's size alone
# would let a 1 GB file ask for 8+ GB (a UINT8 array of 2^28 elements peaked at 2.6 GB).
MAX_ARRAY_LEN = 1 << 22
# The arrays with one entry per token: each as long as tokenizer.ggml.tokens, checked before reading it.
VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
MAX_TENSOR_NAME_LEN = 1 << 10    # ggml itself stops at 63 bytes
MAX_DIMS = 4                     # GGML_MAX_DIMS
MAX_TENSOR_BYTES = 1 << 62       # anything bigger cannot be a real tensor on this planet

# GGUF metadata value types -> (name, struct format) for the fixed-size scalars.
_SCALAR_TYPES: Dict[int, Tuple[str, str]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"),
    4: ("UINT32", "<I"), 5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<B"),
    10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d"),
}
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                10: "<u8", 11: "<i8", 12: "<f8"}
GGUF_TYPE_BOOL, GGUF_TYPE_STRING, GGUF_TYPE_ARRAY = 7, 8, 9

# ggml tensor types the core has no weight type for -> (name, elements per block, bytes per block): listed so
# a file's layout can be validated; decoding them raises a clear error. The core's own (F32, BF16 and the
# quantized blocks) come from its traits rows (ggml_types()).
_OTHER_GGML_TYPES: Dict[int, Tuple[str, int, int]] = {
    1: ("F16", 1, 2), 9: ("Q8_1", 32, 36), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}


@functools.lru_cache(maxsize=None)
def ggml_types() -> Dict[int, Tuple[str, int, int]]:
    """Every ggml tensor type a GGUF file may hold -> (name, elements per block, bytes per block): the core's
    traits rows for the types it takes, _OTHER_GGML_TYPES for the rest."""
    types = dict(_OTHER_GGML_TYPES)
    types.update({row["ggml_id"]: (row["ggml"], row["block"], row["block_bytes"])
                  for row in core_formats().values() if row["ggml"]})
    return dict(sorted(types.items()))


@functools.lru_cache(maxsize=None)
def ggml_type_ids() -> Dict[str, int]:
    """ggml type name -> its number in a GGUF file (ggml_types() turned around)."""
    return {name: t for t, (name, _, _) in ggml_types().items()}


SUPPORTED_GGML_TYPES = ("F32", "F16", "BF16") + tuple(f.gguf for f in WEIGHT_FORMATS.values() if f.gguf)


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: Tuple[int, ...]   # numpy order: the reverse of ggml's ne, so a weight is [out, in] as in HF
    ggml_type: int
    offset: int              # absolute byte offset of the tensor's data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_types()[self.ggml_type][0]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Reader:
    """Bounds-checked little-endian reads from a byte buffer; every overrun becomes a ModelLoadError."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, msg: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: corrupt GGUF: {msg}")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"file is truncated: {what} needs {n} bytes at offset {self.pos}, "
                            f"but only {self.size - self.pos} remain")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str, cap: int = MAX_STRING_LEN) -> str:
        n = self.u64(f"length of {what}")
        if n > cap:
            raise self.fail(f"{what} claims a length of {n} bytes (limit {cap})")
        raw = self.take(n, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


class GGUFFile:
    """A parsed, validated GGUF file whose tensor data stays memory-mapped until `dequantize` asks for it."""

    def __init__(self, path: str, version: int, metadata: Dict[str, Any], metadata_types: Dict[str, int],
                 tensors: Dict[str, GGUFTensorInfo], alignment: int, data_offset: int, buf):
        self.path = path
        self.version = version
        self.metadata = metadata
        self.metadata_types = metadata_types   # key -> GGUF value type id (arrays: 9)
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset         # where the tensor data section starts
        self._buf = buf

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"

    def raw(self, name: str, r0: int = 0, r1: int = -1) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapping; with r1 >= 0, those of its rows
        [r0, r1) (spec.row_range: rows hold whole blocks)."""
        info = self._info(name)
        start, count, _ = row_range(info.shape, info.nbytes, r0, r1)
        return np.frombuffer(self._buf, dtype=np.uint8, count=count, offset=info.offset + start)

    def dequantize(self, name: str, r0: int = 0, r1: int = -1) -> np.ndarray:
        """The tensor (or its rows [r0, r1), decoded alone) as a new C-contiguous float32 array."""
        info = self._info(name)
        decode = _DECODERS.get(info.type_name)
        if decode is None:
            raise ModelLoadError(f"{self.path}: tensor {name} uses GGUF type {info.type_name}, which corelm "
                                 f"does not support yet (supported: {', '.join(SUPPORTED_GGML_TYPES)})")
        shape = row_range(info.shape, info.nbytes, r0, r1)[2]
        out = decode(self.raw(name, r0, r1), math.prod(shape))
        return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)

    def release_all(self) -> None:
        release_mapped_range(self._buf, 0, len(self._buf))

    def release(self, name: str, r0: int = 0, r1: int = -1) -> None:
        info = self.tensors.get(name)
        if info is not None:
            start, count, _ = row_range(info.shape, info.nbytes, r0, r1)
            release_mapped_range(self._buf, info.offset + start, count)

    def _info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: no tensor named {name!r}") from None


# ---------------------------------------------------------------------------------------------------
# Dequantization. Each decoder gets the raw bytes and the element count and returns a flat float32 array.
# Block layouts follow ggml-quants.c; structured dtypes let numpy read the packed blocks without copying.

_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
_Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
_Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # Byte j of a block holds element j in its low nibble and element j+16 in its high nibble.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _dequant_q8_0(raw: np.ndarray, n: int) -> np.ndarray:
    b = raw.view(_Q8_0)
    return (b["d"].astype(np.float32)[:, None] * b["qs"].astype(np.float32)).reshape(n)


def _dequant_q4_0(raw: np.ndarray, n: int) -> np.ndarray:
    b = raw.view(_Q4_0)
    return ((_nibbles(b["qs"]) - 8.0) * b["d"].astype(np.float32)[:, None]).reshape(n)


def _dequant_q4_1(raw: np.ndarray, n: int) -> np.ndarray:
    b = raw.view(_Q4_1)
    d, m = b["d"].astype(np.float32)[:, None], b["m"].astype(np.float32)[:, None]
    return (_nibbles(b["qs"]) * d + m).reshape(n)


def _dequant_bf16(raw: np.ndarray, n: int) -> np.ndarray:
    return bf16_to_f32(raw)


_DECODERS = {
    "F32": lambda raw, n: raw.view("<f4"),
    "F16": lambda raw, n: raw.view("<f2").astype(np.float32),
    "BF16": _dequant_bf16,
    "Q8_0": _dequant_q8_0,
    "Q4_0": _dequant_q4_0,
    "Q4_1": _dequant_q4_1,
}
# The types kept only as GGUF blocks: the core's one description of them (kernels/ggml_formats.h).
_DECODERS.update({f.gguf: (lambda t: lambda raw, n: _core_dequantize(t, raw, n))(f.gguf)
                  for f in WEIGHT_FORMATS.values() if not f.from_floats})


def _core_dequantize(ggml_type: str, raw: np.ndarray, n: int) -> np.ndarray:
    from .. import _core
    return _core.dequantize_gguf(ggml_type, raw, n)


# ---------------------------------------------------------------------------------------------------
# Parsing.

def read_gguf(path: str) -> GGUFFile:
    """Parse and validate a GGUF file. Tensor data is memory-mapped, not read."""
    path = os.fspath(path)
    buf = _map_file(path)
    r = _Reader(buf, path)
    try:
        version, n_tensors, n_kv = _read_header(r)
        metadata, types = _read_metadata(r, n_kv)
        alignment = _alignment(r, metadata, types)
        infos = _read_tensor_infos(r, n_tensors)
        data_offset = _pad(r.pos, alignment)
        tensors = _place_tensors(r, infos, data_offset, alignment)
    except MemoryError:
        raise ModelLoadError(f"{path}: ran out of memory reading the GGUF metadata (stopped at offset {r.pos}); "
                             f"the file is corrupt or this machine is short of memory") from None
    return GGUFFile(path, version, metadata, types, tensors, alignment, data_offset, buf)


def _map_file(path: str):
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ModelLoadError(f"{path}: file is empty, not a GGUF file")
            # The mapping outlives the file object; numpy views into it keep it alive.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"cannot open GGUF file {path}: {e.strerror or e}") from None


def _read_header(r: _Reader) -> Tuple[int, int, int]:
    magic = bytes(r.take(4, "magic"))
    if magic != GGUF_MAGIC:
        raise r.fail(f"bad magic {magic!r} (expected b'GGUF'); this is not a GGUF file")
    version = r.u32("version")
    if version not in SUPPORTED_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in SUPPORTED_VERSIONS:
            raise r.fail("this is a big-endian GGUF file; corelm reads little-endian GGUF only")
        hint = " (GGUF v1 is obsolete; re-convert the model)" if version == 1 else ""
        raise r.fail(f"unsupported GGUF version {version}{hint}; corelm reads versions 2 and 3")
    n_tensors = r.u64("tensor count")
    n_kv = r.u64("metadata key count")
    # Each entry takes at least this many bytes in the file, so larger counts are impossible; checking
    # here also stops us from looping 2^63 times (CVE-2024-23605 was an n_kv overflow).
    if n_tensors > r.size // 24:
        raise r.fail(f"tensor count {n_tensors} is impossible for a file of {r.size} bytes")
    if n_kv > r.size // 13:
        raise r.fail(f"metadata key count {n_kv} is impossible for a file of {r.size} bytes")
    return version, n_tensors, n_kv


def _read_metadata(r: _Reader, n_kv: int) -> Tuple[Dict[str, Any], Dict[str, int]]:
    metadata: Dict[str, Any] = {}
    types: Dict[str, int] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}", MAX_KEY_LEN)
        if not key:
            raise r.fail(f"metadata key #{i} is empty")
        if key in metadata:
            raise r.fail(f"duplicate metadata key {key!r}")
        vtype = r.u32(f"value type of {key!r}")
        metadata[key] = _read_value(r, vtype, key, _vocab_size(metadata) if key in VOCAB_ARRAYS else None)
        types[key] = vtype
    return metadata, types


def _vocab_size(metadata: Dict[str, Any]) -> Optional[int]:
    """The vocabulary's size, from whichever per-token array came first (None before any)."""
    return next((len(metadata[k]) for k in VOCAB_ARRAYS if isinstance(metadata.get(k), list)), None)


def _read_value(r: _Reader, vtype: int, key: str, vocab: Optional[int] = None) -> Any:
    if vtype in _SCALAR_TYPES:
        v = r.scalar(_SCALAR_TYPES[vtype][1], f"value of {key!r}")
        return bool(v) if vtype == GGUF_TYPE_BOOL else v
    if vtype == GGUF_TYPE_STRING:
        return r.string(f"value of {key!r}")
    if vtype == GGUF_TYPE_ARRAY:
        return _read_array(r, key, vocab)
    raise r.fail(f"metadata key {key!r} has unknown value type {vtype}")


def _read_array(r: _Reader, key: str, vocab: Optional[int] = None) -> list:
    """An array's elements as a list; `vocab`: the length it must have (a per-token array), when known."""
    etype = r.u32(f"element type of {key!r}")
    n = r.u64(f"length of array {key!r}")
    if vocab is not None and n != vocab:
        raise r.fail(f"array {key!r} has {n} elements, but the vocabulary has {vocab} tokens")
    if etype == GGUF_TYPE_ARRAY:
        raise r.fail(f"metadata key {key!r} is a nested array, which GGUF readers do not support")
    if etype == GGUF_TYPE_STRING:
        min_elem = 8                                    # each string has at least its u64 length
    elif etype in _SCALAR_TYPES:
        min_elem = struct.calcsize(_SCALAR_TYPES[etype][1])
    else:
        raise r.fail(f"array {key!r} has unknown element type {etype}")
    if n * min_elem > r.size - r.pos:
        raise r.fail(f"array {key!r} claims {n} elements, more than the file can hold")
    if n > MAX_ARRAY_LEN:
        raise r.fail(f"array {key!r} claims {n} elements, over the limit of {MAX_ARRAY_LEN} (metadata arrays hold "
                     f"one entry per token or per layer)")
    if etype == GGUF_TYPE_STRING:
        return _read_strings(r, key, n)
    # a view of the mapping, not a copy of its bytes
    arr = np.frombuffer(r.buf, dtype=_NUMPY_TYPES[etype], count=n, offset=r.pos)
    r.pos += n * min_elem
    # Plain lists: consumers (the tokenizer) can treat them like any other metadata value.
    return arr.astype(bool).tolist() if etype == GGUF_TYPE_BOOL else arr.tolist()


def _read_strings(r: _Reader, key: str, n: int) -> list:
    """n strings (a vocabulary: 150k of them) in one C++ loop; one that does not pass is read by r.string,
    which raises the error that says why."""
    from .. import _core
    out, r.pos = _core.read_length_prefixed_strings(r.buf, r.pos, n, MAX_STRING_LEN)
    while len(out) < n:   # the slow path: names what is wrong (truncated, too long, not UTF-8)
        out.append(r.string(f"element {len(out)} of {key!r}"))
    return out


def _alignment(r: _Reader, metadata: Dict[str, Any], types: Dict[str, int]) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    a = metadata["general.alignment"]
    if types["general.alignment"] != 4:             # llama.cpp requires UINT32 (PR#26318)
        raise r.fail(f"general.alignment must be a UINT32, not {_type_name(types['general.alignment'])}")
    if a == 0 or a & (a - 1) or a > MAX_ALIGNMENT:
        raise r.fail(f"general.alignment = {a}: must be a power of two between 1 and {MAX_ALIGNMENT}")
    return a


def _type_name(vtype: int) -> str:
    return {GGUF_TYPE_STRING: "STRING", GGUF_TYPE_ARRAY: "ARRAY"}.get(vtype, _SCALAR_TYPES.get(vtype, ("?",))[0])


def _read_tensor_infos(r: _Reader, n_tensors: int) -> List[Tuple[str, List[int], int, int]]:
    infos, seen = [], set()
    for i in range(n_tensors):
        name = r.string(f"name of tensor #{i}", MAX_TENSOR_NAME_LEN)
        if not name:
            raise r.fail(f"tensor #{i} has an empty name")
        if name in seen:
            raise r.fail(f"duplicate tensor name {name!r}")
        seen.add(name)
        n_dims = r.u32(f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (must be 1..{MAX_DIMS})")
        ne = [r.scalar("<q", f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
        ggml_type = r.u32(f"type of tensor {name!r}")
        offset = r.u64(f"offset of tensor {name!r}")
        infos.append((name, ne, ggml_type, offset))
    return infos


def _tensor_nbytes(r: _Reader, name: str, ne: List[int], ggml_type: int) -> int:
    types = ggml_types()
    if ggml_type not in types:
        raise r.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
    type_name, block, block_bytes = types[ggml_type]
    numel = 1
    for d in ne:
        if d <= 0:
            raise r.fail(f"tensor {name!r} has a dimension of {d} (shape ne={ne})")
        numel *= d      # Python ints do not wrap; the cap below stands in for C's overflow checks
        if numel > MAX_TENSOR_BYTES:
            raise r.fail(f"tensor {name!r} has too many elements (shape ne={ne})")
    if ne[0] % block:
        raise r.fail(f"tensor {name!r} has rows of {ne[0]} elements, not a multiple of the "
                     f"{type_name} block size {block}")
    nbytes = numel // block * block_bytes
    if nbytes > MAX_TENSOR_BYTES:
        raise r.fail(f"tensor {name!r} would take {nbytes} bytes (shape ne={ne}, type {type_name})")
    return nbytes


def _place_tensors(r: _Reader, infos, data_offset: int, alignment: int) -> Dict[str, GGUFTensorInfo]:
    """Check every tensor's size and placement: aligned, inside the file, not overlapping another."""
    data_size = r.size - data_offset
    if infos and data_size < 0:
        raise r.fail(f"file is truncated: the tensor data section would start at {data_offset}, "
                     f"past the end of the {r.size}-byte file")
    tensors: Dict[str, GGUFTensorInfo] = {}
    for name, ne, ggml_type, offset in infos:
        nbytes = _tensor_nbytes(r, name, ne, ggml_type)
        if offset % alignment:
            raise r.fail(f"tensor {name!r} has offset {offset}, not a multiple of the alignment {alignment}")
        if offset > data_size or nbytes > data_size - offset:
            raise r.fail(f"tensor {name!r} (offset {offset}, {nbytes} bytes) extends past the end of the "
                         f"file's data section ({data_size} bytes); the file is truncated or corrupt")
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(ne)), ggml_type, data_offset + offset, nbytes)
    _check_no_overlap(r, tensors.values())
    _check_packed(r, list(tensors.values()), data_offset, data_size, alignment)
    return tensors


def _check_packed(r: _Reader, infos: List[GGUFTensorInfo], data_offset: int, data_size: int,
                  alignment: int) -> None:
    """GGUF stores no byte size per tensor: a wrong type or shape (Q4_1 blocks labelled Q4_0) would still
    fit and decode as garbage. Writers (gguf-py, llama.cpp) pack the tensors in order, each padded to the
    alignment, and llama.cpp refuses any other layout; so each tensor must start where the one before it
    ends, and the data section must end with the last one (and its padding)."""
    pos = 0
    for t in infos:
        if t.offset - data_offset != pos:
            prev = f"the tensors before it end at {pos}" if pos else "the data section starts at 0"
            raise r.fail(f"tensor {t.name!r} starts at data offset {t.offset - data_offset}, but {prev}: a "
                         f"tensor's type or shape does not match the bytes stored for it (tensors must be "
                         f"packed in order, each padded to {alignment} bytes)")
        pos += _pad(t.nbytes, alignment)
    if infos and not pos - alignment < data_size <= pos:
        last = infos[-1]
        raise r.fail(f"the tensors' types and shapes account for {pos} bytes of tensor data, but the file "
                     f"holds {data_size} after the header; the last tensor {last.name!r} ({last.type_name}, "
                     f"shape {list(last.shape)}) does not match its stored bytes, or the file has trailing data")


def _check_no_overlap(r: _Reader, infos) -> None:
    prev: Optional[GGUFTensorInfo] = None
    for t in sorted(infos, key=lambda t: (t.offset, t.nbytes)):
        if prev is not None and t.offset < prev.offset + prev.nbytes:
            raise r.fail(f"tensors {prev.name!r} and {t.name!r} overlap in the file")
        prev = t


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------------------------------------------
# From a GGUF file to a LoadedModel.

# LongRoPE's per-frequency divisors (Phi-3 128k): read into the spec, not weights
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_REQUIRED = object()


# The tokenizer's big metadata arrays: dropped once the tokenizer is built (~20 MB of Python objects for a
# 150k vocabulary that the file's tensor getters would otherwise keep alive).
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                     "tokenizer.ggml.token_type")


def _build_tokenizer(g: GGUFFile):
    try:
        return load_tokenizer("from_gguf_metadata", g.metadata, g.path)
    finally:
        for k in _TOKENIZER_ARRAYS:
            g.metadata.pop(k, None)
        _return_freed_memory()


def _return_freed_memory() -> None:
    """Hands the building's freed Python and C heap back to the OS before the weights arrive: 25-30 MB
    off the peak RSS with a 150k vocabulary."""
    from .. import _core
    gc.collect()
    _core.release_freed_heap()


def load_gguf_model(path: str, tokenizer_in_background: bool = False):
    """A GGUF file as a LoadedModel: weights dequantized to fp32 on demand, Llama q/k un-permuted.
    tokenizer_in_background: the tokenizer is built on a thread while the caller loads the weights (its
    Python runs while the weights' C++ holds no GIL); LoadedModel.tokenizer waits for it, and raises
    what building it raised."""
    g = read_gguf(path)
    spec = spec_from_gguf(g)
    names = _map_gguf_names(spec, g)
    shapes = {n: source_shape(g.tensors[src[0]].shape, src) for n, src in names.items()}
    check_experts(spec, shapes, _expert_keys(g)[0], g.path)
    arch = g.metadata.get("general.architecture")
    keys = dict(SIZE_KEYS["gguf"], ffn=family(spec.arch).ffn_keys[1])
    check_weight_shapes(spec, shapes, g.path, {k: f"{arch}.{v}" for k, v in keys.items()})
    for t in {src[0] for src in names.values()}:   # fail now, not halfway through handing weights to the engine
        if g.tensors[t].type_name not in SUPPORTED_GGML_TYPES:
            raise ModelLoadError(f"{g.path}: tensor {t} uses GGUF type {g.tensors[t].type_name}, which corelm "
                                 f"does not support yet (supported: {', '.join(SUPPORTED_GGML_TYPES)})")
    gen = {"bos_token_id": spec.bos_token_id} if spec.bos_token_id is not None else {}
    if spec.eos_token_ids:
        gen["eos_token_id"] = spec.eos_token_ids[0] if len(spec.eos_token_ids) == 1 else list(spec.eos_token_ids)
    for key, name in GGUF_SAMPLING_KEYS.items():      # the model's sampling defaults, as generation_config.json's
        if isinstance(g.metadata.get(key), (int, float)) and not isinstance(g.metadata.get(key), bool):
            gen[name] = g.metadata[key]
    template = g.metadata.get("tokenizer.chat_template")
    get_raw_weight, raw_weight_type = _gguf_raw_getters(g, spec, names)
    return LoadedModel(
        spec=spec, get_weight=_gguf_getter(g, spec, names),
        release_weight=lambda n: g.release(*names.get(n, ("", 0, -1))), release_all=g.release_all,
        get_raw_weight=get_raw_weight, raw_weight_type=raw_weight_type,
        tokenizer=_tokenizer_thread(g) if tokenizer_in_background else _build_tokenizer(g),
        chat_template=template if isinstance(template, str) else None, generation_config=gen,
        source=os.path.abspath(g.path), source_format="gguf", description=_gguf_description(g, names))


# GGUF's general.sampling.* keys (llama.cpp's) -> generation_config.json's names
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def _tokenizer_thread(g: GGUFFile) -> "concurrent.futures.Future":
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="corelm-tokenizer")
    future = pool.submit(_build_tokenizer, g)
    pool.shutdown(wait=False)   # the thread ends with its one task
    return future


def _meta(g: GGUFFile, key: str, kind: str, default: Any = _REQUIRED) -> Any:
    """A typed metadata value: kind "int" (non-negative integer), "float" (finite number) or "bool"."""
    if key not in g.metadata:
        if default is _REQUIRED:
            raise ModelLoadError(f"{g.path}: GGUF metadata has no {key!r}")
        return default
    v = g.metadata[key]
    if kind == "bool":
        ok = isinstance(v, bool)
    elif kind == "int":
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)
    if not ok:
        raise ModelLoadError(f"{g.path}: GGUF metadata {key!r} = {_short(v)} is not a valid {kind}")
    return float(v) if kind == "float" else v


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) < 80 else s[:77] + "..."


def spec_from_gguf(g: GGUFFile):
    gguf_arch = g.metadata.get("general.architecture")
    if gguf_arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{g.path}: unsupported GGUF architecture {_short(gguf_arch)}; corelm supports "
                             f"{', '.join(GGUF_ARCHS)} (Mistral and Mixtral models are stored as llama)")
    arch = gguf_arch
    fam = family(GGUF_ARCHS[arch])
    if arch in GGUF_MOE_ARCHS and _meta(g, f"{arch}.expert_count", "int", 0):
        fam = family(GGUF_MOE_ARCHS[arch])      # Mixtral: "llama" with experts
    if "rope_freqs.weight" in g.tensors:
        raise ModelLoadError(f"{g.path}: has a rope_freqs tensor (Llama 3.1-style RoPE frequency scaling), which "
                             f"corelm does not support from GGUF yet; load the model's HF folder instead")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    vocab = _meta(g, f"{arch}.vocab_size", "int", len(tokens) if isinstance(tokens, list) else _REQUIRED)
    dim, heads = _meta(g, f"{arch}.embedding_length", "int"), _meta(g, f"{arch}.attention.head_count", "int")
    if f"{arch}.attention.key_length" not in g.metadata and heads and dim % heads:
        raise ModelLoadError(f"{g.path}: embedding_length {dim} is not divisible by {heads} heads")
    head_dim = _meta(g, f"{arch}.attention.key_length", "int", dim // heads if heads else 0)
    if _meta(g, f"{arch}.attention.value_length", "int", head_dim) != head_dim:
        raise ModelLoadError(f"{g.path}: key and value head sizes differ, which corelm does not support")
    rope_dim = _meta(g, f"{arch}.rope.dimension_count", "int", head_dim)
    layers = _meta(g, f"{arch}.block_count", "int")
    experts_key, used_key = _expert_keys(g)
    experts, used = (_meta(g, experts_key, "int", 0), _meta(g, used_key, "int", 0)) if fam.moe else (0, 0)
    spec = ModelSpec(
        arch=fam.arch, vocab_size=vocab, hidden_size=dim,
        intermediate_size=_gguf_ffn(g, arch, fam, used),
        num_layers=layers, num_heads=heads,
        num_kv_heads=_meta(g, f"{arch}.attention.head_count_kv", "int", heads), head_dim=head_dim,
        rms_norm_eps=_meta(g, f"{arch}.attention.layer_norm_rms_epsilon", "float", 1e-5),
        rope_theta=_meta(g, f"{arch}.rope.freq_base", "float", 10000.0),
        rope_scaling=_gguf_rope_scaling(g, arch),
        max_position_embeddings=_meta(g, f"{arch}.context_length", "int", 2048),
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias=fam.attention_bias == "always" or "blk.0.attn_q.bias" in g.tensors,
        bos_token_id=_meta(g, "tokenizer.ggml.bos_token_id", "int", None),
        eos_token_ids=_gguf_eos(g, vocab),
        activation=fam.activation, qk_norm=fam.qk_norm, post_norms=fam.post_norms,
        embed_scale=float(np.float32(math.sqrt(dim))) if fam.embed_scale and dim else 1.0,
        rope_dim=rope_dim if rope_dim != head_dim else None, qk_norm_whole=fam.qk_norm_whole,
        num_experts=experts, num_experts_used=used,
        moe_norm_topk=_meta(g, f"{arch}.expert_weights_norm", "bool", fam.gguf_norm_topk) if fam.moe else False,
        encoder=fam.encoder,
    )
    if fam.sliding != "none":
        window = _meta(g, f"{arch}.attention.sliding_window", "int", fam.hf_defaults.get("sliding_window"))
        spec.sliding_window = window or None
        if fam.sliding == "pattern" and window:
            spec.sliding_layers = _gguf_sliding_layers(g, arch, fam, layers)
    if fam.local_rope_theta is not None:
        spec.rope_local_theta = _meta(g, f"{arch}.rope.freq_base_swa", "float", fam.local_rope_theta)
    if fam.softcaps:
        spec.attn_logit_softcap = _meta(g, f"{arch}.attn_logit_softcapping", "float", None)
        spec.final_logit_softcap = _meta(g, f"{arch}.final_logit_softcapping", "float", None)
    if fam.query_pre_attn_scalar:
        # GGUF does not store it: llama.cpp scales by 1/sqrt(head_dim), except for the 27B models (46
        # layers of Gemma 2, 62 of Gemma 3), whose query_pre_attn_scalar is hidden / heads
        big = layers == {"gemma2": 46, "gemma3": 62}.get(fam.arch)
        spec.query_pre_attn_scalar = float(dim // heads if big and heads else head_dim)
    if any(t in g.tensors for t in _ROPE_FACTORS):
        spec.rope_scaling = _gguf_longrope(g, arch)
    if fam.encoder:
        _gguf_encoder(g, arch, spec)
    return validate_spec(spec, g.path, (experts_key, used_key))


# llama.cpp's <arch>.pooling_type -> ModelSpec.pooling (0: none, the file does not say; 4, "rank", is a
# reranker's classification head, which corelm does not run)
_GGUF_POOLING = {0: None, 1: "mean", 2: "cls", 3: "last"}


def _gguf_encoder(g: GGUFFile, arch: str, spec) -> None:
    """An encoder's (BERT) fields: LayerNorm's epsilon, the token types, the pooling llama.cpp applies."""
    if _meta(g, f"{arch}.attention.causal", "bool", False):
        raise ModelLoadError(f"{g.path}: {arch}.attention.causal is true; corelm runs {arch} as an encoder "
                             f"(every token attends to the whole input)")
    spec.rms_norm_eps = _meta(g, f"{arch}.attention.layer_norm_epsilon", "float", 1e-12)
    types = g.tensors.get("token_types.weight")
    spec.type_vocab_size = _meta(g, "tokenizer.ggml.token_type_count", "int",
                                 types.shape[0] if types is not None and types.shape else 0)
    kind = _meta(g, f"{arch}.pooling_type", "int", 0)
    if kind not in _GGUF_POOLING:
        raise ModelLoadError(f"{g.path}: {arch}.pooling_type = {kind} is not supported (corelm pools by 1 mean, "
                             f"2 cls or 3 last token; 0: none)")
    spec.pooling = _GGUF_POOLING[kind]


def _expert_keys(g: GGUFFile) -> Tuple[str, str]:
    arch = g.metadata.get("general.architecture")
    return f"{arch}.expert_count", f"{arch}.expert_used_count"


def _gguf_ffn(g: GGUFFile, arch: str, fam, experts_used: int) -> int:
    """The MLP's size (an expert's): the family's key, else as llama.cpp falls back for Qwen3-MoE, the
    feed-forward length shared among the experts a token uses."""
    ffn = _meta(g, f"{arch}.{fam.ffn_keys[1]}", "int", None)
    if ffn is None:
        ffn = _meta(g, f"{arch}.feed_forward_length", "int") // max(1, experts_used)
    return ffn


def _gguf_sliding_layers(g: GGUFFile, arch: str, fam, layers: int) -> List[bool]:
    """Which layers slide: the file's sliding_window_pattern (a period n: every n-th layer is global; or
    one flag per layer), else the family's period, as llama.cpp reads it."""
    pattern = g.metadata.get(f"{arch}.attention.sliding_window_pattern", fam.swa_pattern)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(b, (bool, int)) for b in pattern):
            raise ModelLoadError(f"{g.path}: {arch}.attention.sliding_window_pattern lists {len(pattern)} flags "
                                 f"for {layers} layers")
        return [bool(b) for b in pattern]
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ModelLoadError(f"{g.path}: {arch}.attention.sliding_window_pattern = {_short(pattern)} is not a "
                             f"positive integer")
    return [bool((i + 1) % pattern) for i in range(layers)]


def _gguf_longrope(g: GGUFFile, arch: str) -> Dict[str, Any]:
    """Phi-3's LongRoPE from the file: its factor tensors and original context."""
    s: Dict[str, Any] = {"rope_type": "longrope"}
    for t, key in zip(_ROPE_FACTORS, ("long_factor", "short_factor")):
        if t not in g.tensors:
            raise ModelLoadError(f"{g.path}: has {_ROPE_FACTORS[0] if t != _ROPE_FACTORS[0] else _ROPE_FACTORS[1]} "
                                 f"but no {t}")
        s[key] = [float(x) for x in np.asarray(g.dequantize(t), np.float64).reshape(-1)]
    s["original_max_position_embeddings"] = _meta(g, f"{arch}.rope.scaling.original_context_length", "int")
    factor = _meta(g, f"{arch}.rope.scaling.attn_factor", "float", None)
    if factor is not None:
        s["attention_factor"] = factor
    return s


def _gguf_rope_scaling(g: GGUFFile, arch: str) -> Optional[Dict[str, Any]]:
    kind = g.metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = _meta(g, f"{arch}.rope.scaling.factor", "float", None)
    if kind == "none" and _meta(g, f"{arch}.rope.scale_linear", "float", None) not in (None, 1.0):
        kind, factor = "linear", _meta(g, f"{arch}.rope.scale_linear", "float")   # pre-2024 key
    if kind == "none":
        return None
    if kind not in ("linear", "yarn") or factor is None:
        raise ModelLoadError(f"{g.path}: RoPE scaling {_short(kind)} (factor {factor}) is not supported from GGUF")
    s: Dict[str, Any] = {"rope_type": kind, "factor": factor}
    orig = _meta(g, f"{arch}.rope.scaling.original_context_length", "int", None)
    if orig is not None:
        s["original_max_position_embeddings"] = orig
    return s


def _gguf_eos(g: GGUFFile, vocab: int) -> List[int]:
    # llama.cpp stops on end-of-generation tokens: eos, and for chat models also eot (e.g. <|eot_id|>).
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        tid = _meta(g, key, "int", None)
        if tid is not None and tid not in ids and (key.endswith("eos_token_id") or tid < vocab):
            ids.append(tid)
    return ids


def _map_gguf_names(spec, g: GGUFFile) -> Dict[str, Tuple[str, int, int]]:
    """internal name -> (GGUF tensor, first row, end row; -1: all rows: fused and stacked expert tensors give
    each part its rows); any tensor the engine would not use is an error."""
    fam = family(spec.arch)
    names, unknown = {}, []
    for t in g.tensors:
        internal = fam.gguf_global.get(t)
        if internal is None and t.startswith("blk."):
            idx, _, rest = t[4:].partition(".")
            if idx.isdigit() and (rest in fam.gguf_fused or rest in fam.gguf_stacked):
                stacked = rest in fam.gguf_stacked
                parts = fam.gguf_stacked[rest] if stacked else fam.gguf_fused[rest]
                for name, src in split_tensor(spec, int(idx), t, tuple(g.tensors[t].shape), parts, stacked,
                                              _expert_keys(g)[0], g.path).items():
                    add_source(names, name, src, g.path)
                continue
            if idx.isdigit() and rest in fam.gguf_layer:
                internal = f"layers.{int(idx)}.{fam.gguf_layer[rest]}"
        if internal is None:
            if t not in _ROPE_FACTORS:
                unknown.append(t)
        else:
            add_source(names, internal, (t, 0, -1), g.path)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ModelLoadError(f"{g.path}: unknown tensors for a {spec.arch} model: {', '.join(unknown[:5])}{more}")
    return names


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF rotate-half -> interleaved RoPE pairs) for one matrix or bias.

    The converter did w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2); this is its inverse."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_getter(g: GGUFFile, spec, names: Dict[str, Tuple[str, int, int]]):
    # Only the llama arch is permuted; the others use NEOX (rotate-half) RoPE in llama.cpp already.
    heads = {"wq": spec.num_heads, "bq": spec.num_heads, "wk": spec.num_kv_heads, "bk": spec.num_kv_heads}
    permuted = family(spec.arch).gguf_permuted_qk

    def get_weight(name: str) -> np.ndarray:
        if name not in names:
            raise ModelLoadError(f"no weight named {name!r}")
        t = names[name][0]
        w = g.dequantize(*names[name])
        kind = name.rsplit(".", 1)[-1]
        if permuted and kind in heads:
            w = unpermute_rope_rows(w, heads[kind])
        return check_finite(np.ascontiguousarray(w, dtype=np.float32), g.path, t)
    return get_weight


# Block types the engine takes as they are stored (the quantized weight formats in corelm.options).
RAW_GGML_TYPES = tuple(f.gguf for f in WEIGHT_FORMATS.values() if f.gguf)
# ... and bf16 rows, which it takes as stored where its matrices are bf16 (set_weight_raw "BF16").
RAW_ROW_TYPES = RAW_GGML_TYPES + ("BF16",)


def _gguf_raw_getters(g: GGUFFile, spec, names: Dict[str, Tuple[str, int, int]]):
    """get_raw_weight: (type name, uint8 blocks [rows, row_bytes], shape) of a quantized or bf16 matrix, None otherwise
    (and for the matrices the engine keeps in fp32); raw_weight_type: that type name alone. Llama q/k rows
    are un-permuted as whole rows of blocks (the permutation only moves rows); a fused tensor's part, or a
    stacked tensor's expert, is its rows."""
    heads = {"wq": spec.num_heads, "wk": spec.num_kv_heads}
    permuted = family(spec.arch).gguf_permuted_qk

    def source(name: str):
        t, r0, r1 = names.get(name, ("", 0, -1))
        info = g.tensors.get(t)
        if info is None or kept_float(name) or info.type_name not in RAW_ROW_TYPES or \
                (r1 < 0 and len(info.shape) != 2):
            return None
        return t, info, r0, r1

    def raw_weight_type(name: str):
        src = source(name)
        return src[1].type_name if src else None

    def get_raw_weight(name: str):
        src = source(name)
        if src is None:
            return None
        t, info, r0, r1 = src
        rows, cols = row_range(info.shape, info.nbytes, r0, r1)[2]
        raw = g.raw(t, r0, r1)
        check_finite_blocks(info.type_name, raw, g.path, t)
        raw = raw.reshape(rows, -1)
        kind = name.rsplit(".", 1)[-1]
        if permuted and kind in heads:
            raw = unpermute_rope_rows(raw, heads[kind])
        return info.type_name, np.ascontiguousarray(raw), (rows, cols)
    return get_raw_weight, raw_weight_type


def _gguf_description(g: GGUFFile, names: Dict[str, str]) -> str:
    # Name the file by the type of most of its matrices (as "a Q4_1 model" has F32 norms and maybe a Q8_0
    # embedding), then list the other types present. How the engine stores them depends on its dtype
    # (quantized blocks are kept under "auto"), so the file's description does not say.
    rank: Dict[str, Tuple[int, int]] = {}
    for t in {src[0] for src in names.values()}:
        info = g.tensors[t]
        n_mat, n_bytes = rank.get(info.type_name, (0, 0))
        rank[info.type_name] = (n_mat + (len(info.shape) >= 2), n_bytes + info.nbytes)
    kinds = sorted(rank, key=rank.get, reverse=True)
    others = f" (+{', '.join(kinds[1:])})" if len(kinds) > 1 else ""
    return f"GGUF {kinds[0]}{others}"
