"""The corelm model folder: `corelm convert` writes it, `load_model(folder)` reads it (docs/model-format.md).

    folder/config.json             {"format": "corelm", "format_version": 1, "weights": "q4_1", "spec": {...}}
    folder/weights.corelm          the tensors (layout below), memory-mapped at load
    folder/tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json

weights.corelm (little-endian):
    0   8 bytes  magic b"CORELMW\\0"
    8   u32      format version (1)
    12  u32      alignment of the data section and of every tensor (64)
    16  u64      header length H (bytes of UTF-8 JSON)
    24  u32      CRC-32 (zlib.crc32) of bytes 0..24 and the JSON header
    28  u32      reserved, 0
    32  H bytes  JSON header: {"tensors": [{"name", "type", "shape", "offset", "nbytes"}, ...], "metadata": {...}}
    zero padding to a multiple of the alignment; then the data section. Offsets are relative to its start.

Tensor types: f32, bf16 (raw little-endian elements, row-major), q8 / q4 / q4m (and the other ggml
types): rows of blocks laid out exactly as GGUF's Q8_0 / Q4_0 / Q4_1 ..., so the engine repacks them with
`Model.set_weight_raw` and no float round trip, sbf16 (sparse bf16: a bitmap of the non-zeros, then
the non-zero values; expanded to dense bf16 rows for `set_weight_raw(..., "SBF16", ...)`) and sq8 / sq4
(sparse q8_0 / q4_0: a bitmap of the non-zero codes, the blocks' scales, then the non-zero codes; expanded
to dense Q8_0 / Q4_0 blocks for `set_weight_raw(..., "SQ8" / "SQ4", ...)`). Every count,
offset and size is checked against the file before use, as the GGUF and safetensors parsers do; failures
are ModelLoadError.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..options import CHOICES, WEIGHT_FORMATS, WeightFormat
from .checks import folder_chat_template, load_tokenizer, optional_json, read_json, validate_spec
from .families import SUPPORTED_ARCHS
from .gguf import _DECODERS
from .spec import (LoadedModel, ModelLoadError, ModelSpec, bf16_to_f32, check_finite, check_finite_blocks,
                   release_mapped_range, weight_shapes)

MAGIC = b"CORELMW\0"
FORMAT_VERSION = 1
WEIGHTS_FILE = "weights.corelm"
CONFIG_FILE = "config.json"
ALIGNMENT = 64
PREFIX = struct.Struct("<8sIIQII")          # magic, version, alignment, header length, crc, reserved
MAX_HEADER_BYTES = 64 << 20
MAX_TENSOR_BYTES = 1 << 62
# tensor type in the file -> its weight format (block size and bytes; `raw`: the name set_weight_raw takes)
TYPES: Dict[str, WeightFormat] = {f.file_type: f for f in WEIGHT_FORMATS.values()}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type: str
    shape: Tuple[int, ...]
    offset: int          # absolute offset in the file
    nbytes: int


def tensor_nbytes(type_: str, shape: Tuple[int, ...]) -> int:
    """The bytes a tensor of this type and shape takes; for a sparse type, the most it can take (every
    weight non-zero)."""
    f = TYPES[type_]
    if f.sparse and shape[1] % f.block:
        raise ValueError(f"rows of {shape[1]} elements are not a multiple of the {type_} block size {f.block}")
    if f.sparse:
        return bitmap_nbytes(shape) + f.block_bytes * shape[0] * shape[1] // f.block
    n = 1
    for d in shape:
        n *= d
    if shape and shape[-1] % f.block:
        raise ValueError(f"rows of {shape[-1]} elements are not a multiple of the {type_} block size {f.block}")
    return n // f.block * f.block_bytes


# ---------------------------------------------------------------------------------------------------
# sbf16: a matrix [rows, cols] stored as a bitmap, u32 words [rows][ceil(cols/32)] (bit i of word c of row
# r set: column 32c+i is non-zero; bits past cols are 0), then the non-zero bf16 values in row-major order.

def bitmap_nbytes(shape: Tuple[int, ...]) -> int:
    return 4 * shape[0] * -(-shape[1] // 32)


# sq8 / sq4 (sparse q8_0 / q4_0, cols a multiple of 32): the same bitmap, of the non-zero codes (q8_0: q != 0;
# q4_0: q != 8, the code of a zero weight), then the dense blocks' fp16 scales [rows][cols/32] as they are,
# then the non-zero codes in row-major order: sq8 one int8 each, sq4 one 4-bit code each, two per byte (low
# nibble first; an odd count ends with a zero nibble).
CODE_BITS = {"sbf16": 16, "sq8": 8, "sq4": 4}   # bits per stored non-zero


def sparse_head_nbytes(type_: str, shape: Tuple[int, ...]) -> int:
    """A sparse tensor's bytes before its non-zeros: the bitmap, and a quantized one's scales."""
    return bitmap_nbytes(shape) + (0 if type_ == "sbf16" else 2 * shape[0] * (shape[1] // 32))


def values_nbytes(type_: str, count: int) -> int:
    return (count * CODE_BITS[type_] + 7) // 8


def stored_sparsity(shape: Tuple[int, ...], nbytes: int, type_: str = "sbf16") -> float:
    """The fraction of zeros in a sparse tensor of `nbytes` (its header says as much: the bytes after the
    bitmap and scales are the non-zeros)."""
    return 1.0 - (nbytes - sparse_head_nbytes(type_, shape)) * 8 / CODE_BITS[type_] / (shape[0] * shape[1])


def pack_sbf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16 [rows, cols]) -> the sbf16 bytes; +0 and -0 are both dropped."""
    rows, cols = bits.shape
    mask = np.zeros((rows, -(-cols // 32) * 32), bool)
    mask[:, :cols] = (bits & 0x7FFF) != 0
    bitmap = np.packbits(mask, axis=1, bitorder="little")      # byte j bit i: column 8j+i, so LE u32 words
    return np.concatenate([bitmap.reshape(-1), bits[mask[:, :cols]].view(np.uint8)])


def unpack_sbf16(raw: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """The sbf16 bytes of a [rows, cols] tensor -> its dense bf16 bits (uint16 [rows, cols]). ValueError
    when the bitmap disagrees with the values (the header check already made nbytes even and at least the
    bitmap)."""
    nbitmap = bitmap_nbytes(shape)
    mask = _bitmap(raw, shape)
    values = raw[nbitmap:].view("<u2")
    if np.count_nonzero(mask) != len(values):
        raise ValueError(f"bitmap marks {np.count_nonzero(mask)} non-zeros, the tensor holds {len(values)} values")
    out = np.zeros(shape, np.uint16)
    out[mask] = values
    return out


def _block_fields(type_: str) -> np.dtype:
    return np.dtype([("d", "<u2"), ("qs", "u1", (32 if type_ == "sq8" else 16,))])


def pack_sparse_blocks(blocks: np.ndarray, type_: str) -> np.ndarray:
    """Dense Q8_0 (type_ "sq8") or Q4_0 ("sq4") blocks (uint8 [rows, cols/32 * block bytes]) -> the sparse
    tensor's bytes, dropping the zero codes."""
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).view(_block_fields(type_)).reshape(rows, -1)
    if type_ == "sq8":
        codes = b["qs"].reshape(rows, -1)
        mask = codes != 0
    else:
        codes = np.concatenate([b["qs"] & 15, b["qs"] >> 4], axis=2).reshape(rows, -1)
        mask = codes != 8
    values = codes[mask]
    if type_ == "sq4":
        values = np.append(values, np.uint8(0)) if len(values) % 2 else values
        values = (values[0::2] | (values[1::2] << 4)).astype(np.uint8)
    bitmap = np.packbits(mask, axis=1, bitorder="little")
    return np.concatenate([bitmap.reshape(-1), np.ascontiguousarray(b["d"]).reshape(-1).view(np.uint8),
                           values.view(np.uint8)])


def _bitmap(raw: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """The bitmap at the start of a sparse tensor's bytes as bool [rows, cols]; ValueError for bits past cols."""
    rows, cols = shape
    mask = np.unpackbits(raw[:bitmap_nbytes(shape)].reshape(rows, -1), axis=1, bitorder="little").view(bool)
    if mask[:, cols:].any():
        row = int(np.nonzero(mask[:, cols:].any(1))[0][0])
        raise ValueError(f"bitmap row {row} has bits set past its {cols} columns")
    return mask[:, :cols]


def unpack_sparse_blocks(raw: np.ndarray, shape: Tuple[int, ...], type_: str) -> np.ndarray:
    """A sq8 / sq4 tensor's bytes -> its dense Q8_0 / Q4_0 blocks (uint8 [rows, cols/32 * block bytes]).
    ValueError when the bitmap disagrees with the count of codes stored (the header check already made the
    tensor at least its bitmap and scales)."""
    rows, cols = shape
    mask = _bitmap(raw, shape)
    head = sparse_head_nbytes(type_, shape)
    count = int(np.count_nonzero(mask))
    if values_nbytes(type_, count) != raw.size - head:
        held = raw.size - head if type_ == "sq8" else f"{raw.size - head} bytes of"
        raise ValueError(f"bitmap marks {count} non-zero codes, the tensor holds {held} codes")
    out = np.zeros((rows, cols // 32), _block_fields(type_))
    out["d"] = raw[bitmap_nbytes(shape):head].view("<u2").reshape(rows, -1)
    values = raw[head:]
    if type_ == "sq8":
        codes = np.zeros((rows, cols), np.uint8)
        codes[mask] = values
        out["qs"] = codes.reshape(rows, -1, 32)
    else:
        codes = np.full((rows, cols), 8, np.uint8)
        codes[mask] = np.stack([values & 15, values >> 4], axis=1).reshape(-1)[:count]
        c = codes.reshape(rows, -1, 32)
        out["qs"] = c[:, :, :16] | (c[:, :, 16:] << 4)
    return out.view(np.uint8).reshape(rows, -1)


def pad(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------------------------------------------
# Writing.

class WeightsWriter:
    """Writes weights.corelm: add() every tensor's bytes in the order given, then close() writes the header.
    The header goes first in the file but a sparse tensor's size is known only once added, so the writer
    reserves the header's room with every tensor at its largest (offsets and sizes then only shrink) and
    close() writes the real header there, padded with spaces."""

    def __init__(self, path: str, entries: List[Tuple[str, str, Tuple[int, ...]]], metadata: Dict[str, Any]):
        self._entries = [(n, t, tuple(int(d) for d in s)) for n, t, s in entries]
        self._metadata = metadata
        self._tensors: List[Tuple[int, int]] = []     # (offset, nbytes) of the tensors added so far
        offsets, pos = [], 0
        for _, type_, shape in self._entries:
            offsets.append(pos)
            pos = pad(pos + tensor_nbytes(type_, shape))
        self._hlen = len(self._header(offsets, [tensor_nbytes(t, s) for _, t, s in self._entries]))
        self._data_start = pad(PREFIX.size + self._hlen)
        self._pos = 0
        self._f = open(path, "wb")
        self._f.write(b"\0" * self._data_start)

    def _header(self, offsets: List[int], sizes: List[int]) -> bytes:
        tensors = [{"name": n, "type": t, "shape": list(s), "offset": o, "nbytes": b}
                   for (n, t, s), o, b in zip(self._entries, offsets, sizes)]
        return json.dumps({"tensors": tensors, "metadata": self._metadata}, separators=(",", ":")).encode("utf-8")

    def add(self, name: str, data: np.ndarray) -> int:
        """Writes the next tensor's bytes; returns their count."""
        if len(self._tensors) == len(self._entries) or self._entries[len(self._tensors)][0] != name:
            raise ValueError(f"{name}: tensors must be added in the order given")
        _, type_, shape = self._entries[len(self._tensors)]
        buf = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        most = tensor_nbytes(type_, shape)
        if buf.size != most and not (TYPES[type_].sparse and buf.size < most):
            raise ValueError(f"{name}: {buf.size} bytes, a {type_} tensor of shape {list(shape)} takes {most}")
        self._f.write(b"\0" * (self._data_start + self._pos - self._f.tell()))
        self._f.write(buf.tobytes())
        self._tensors.append((self._pos, buf.size))
        self._pos = pad(self._pos + buf.size)
        return buf.size

    def close(self) -> None:
        if len(self._tensors) != len(self._entries):
            missing = [n for n, _, _ in self._entries[len(self._tensors):]]
            raise ValueError(f"tensors never written: {', '.join(missing[:5])}")
        self._f.write(b"\0" * (self._data_start + self._pos - self._f.tell()))
        header = self._header([o for o, _ in self._tensors], [b for _, b in self._tensors])
        header += b" " * (self._hlen - len(header))
        prefix_wo_crc = struct.pack("<8sIIQ", MAGIC, FORMAT_VERSION, ALIGNMENT, len(header))
        crc = zlib.crc32(header, zlib.crc32(prefix_wo_crc)) & 0xFFFFFFFF
        self._f.seek(0)
        self._f.write(PREFIX.pack(MAGIC, FORMAT_VERSION, ALIGNMENT, len(header), crc, 0) + header)
        self._f.close()


# ---------------------------------------------------------------------------------------------------
# Reading and validation.

class CorelmWeights:
    """A validated weights.corelm whose tensor data stays memory-mapped."""

    def __init__(self, path: str):
        self.path = path
        self._buf = _map(path)
        self.metadata, self.tensors = _parse(self._buf, path)

    def raw(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def get_f32(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        raw = self.raw(name)
        if t.type == "f32":
            out = raw.view("<f4").reshape(t.shape).copy()
        elif t.type == "bf16":
            out = bf16_to_f32(raw).reshape(t.shape)
        elif t.type == "sbf16":
            out = bf16_to_f32(self.dense_bf16(name))
        elif TYPES[t.type].sparse:
            out = _DECODERS[{"sq8": "Q8_0", "sq4": "Q4_0"}[t.type]](self.dense_raw(name).reshape(-1), int(np.prod(t.shape)))
            out = out.reshape(t.shape)
        else:
            n = int(np.prod(t.shape))
            out = _DECODERS[TYPES[t.type].gguf](raw, n).reshape(t.shape)
        return np.ascontiguousarray(out, dtype=np.float32)

    def dense_bf16(self, name: str) -> np.ndarray:
        """An sbf16 tensor's dense bf16 bits (uint16 [rows, cols]), its bitmap checked against its values."""
        return self.dense_raw(name).view("<u2")

    def dense_raw(self, name: str) -> np.ndarray:
        """A sparse tensor's dense form as set_weight_raw takes it (uint8 [rows, row bytes]): sbf16's bf16
        rows, sq8 / sq4's Q8_0 / Q4_0 blocks; its bitmap checked against its values."""
        t = self.tensors[name]
        try:
            if t.type == "sbf16":
                return unpack_sbf16(self.raw(name), t.shape).view(np.uint8)
            return unpack_sparse_blocks(self.raw(name), t.shape, t.type)
        except ValueError as e:
            raise _fail(self.path, f"{t.type} tensor {name!r}: {e}") from None

    def release(self, name: str) -> None:
        t = self.tensors.get(name)
        if t is not None:
            release_mapped_range(self._buf, t.offset, t.nbytes)


def _fail(path: str, msg: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: corrupt corelm weights file: {msg}")


def _map(path: str):
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < PREFIX.size:
                raise _fail(path, f"file is {os.fstat(f.fileno()).st_size} bytes, shorter than the "
                                  f"{PREFIX.size}-byte prefix")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"cannot open {path}: {e.strerror or e}") from None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_dup(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return d


def _parse(buf, path: str) -> Tuple[Dict[str, Any], Dict[str, TensorEntry]]:
    size = len(buf)
    magic, version, alignment, hlen, crc, _ = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise _fail(path, f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise ModelLoadError(f"{path}: corelm weights format version {version}; this corelm reads version "
                             f"{FORMAT_VERSION} (re-convert the model with this corelm)")
    if alignment != ALIGNMENT:
        raise _fail(path, f"alignment {alignment} (must be {ALIGNMENT})")
    if hlen > MAX_HEADER_BYTES or hlen > size - PREFIX.size:
        raise _fail(path, f"header length {hlen} does not fit in the {size}-byte file")
    header = bytes(buf[PREFIX.size:PREFIX.size + hlen])
    if zlib.crc32(header, zlib.crc32(bytes(buf[:24]))) & 0xFFFFFFFF != crc:
        raise _fail(path, "header checksum mismatch (the file is damaged or was modified)")
    try:
        doc = json.loads(header.decode("utf-8"), object_pairs_hook=_no_dup)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _fail(path, f"header is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), list):
        raise _fail(path, "header has no 'tensors' list")
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise _fail(path, "header 'metadata' is not an object")
    data_start = pad(PREFIX.size + hlen)
    data_size = size - data_start
    tensors: Dict[str, TensorEntry] = {}
    for i, t in enumerate(doc["tensors"]):
        if not isinstance(t, dict) or set(t) != {"name", "type", "shape", "offset", "nbytes"}:
            raise _fail(path, f"tensor entry #{i} must have exactly name, type, shape, offset, nbytes")
        name, type_, shape, offset, nbytes = t["name"], t["type"], t["shape"], t["offset"], t["nbytes"]
        if not isinstance(name, str) or not name or len(name) > 1024:
            raise _fail(path, f"tensor entry #{i} has a bad name {name!r}")
        if name in tensors:
            raise _fail(path, f"duplicate tensor name {name!r}")
        if type_ not in TYPES:
            raise _fail(path, f"tensor {name!r} has unknown type {type_!r} (known: {', '.join(TYPES)})")
        if not isinstance(shape, list) or not 1 <= len(shape) <= 2 or \
                not all(_is_int(d) and 0 < d <= MAX_TENSOR_BYTES for d in shape):
            raise _fail(path, f"tensor {name!r} has a bad shape {shape!r}")
        fmt = TYPES[type_]
        if (fmt.block > 1 or fmt.sparse) and len(shape) != 2:
            raise _fail(path, f"tensor {name!r} of {'sparse' if fmt.sparse else 'block'} type {type_} must be "
                              f"a matrix")
        try:
            want = tensor_nbytes(type_, tuple(shape))
        except ValueError as e:
            raise _fail(path, f"tensor {name!r}: {e}") from None
        if fmt.sparse:      # a bitmap (sq8 / sq4: and the scales), then the non-zeros (sbf16: 2 bytes each)
            least = sparse_head_nbytes(type_, tuple(shape))
            even = type_ == "sbf16"
            if not _is_int(nbytes) or not least <= nbytes <= want or (even and nbytes % 2) or want > MAX_TENSOR_BYTES:
                raise _fail(path, f"tensor {name!r} claims {nbytes!r} bytes; a {type_} tensor of shape {shape} "
                                  f"takes {'an even count' if even else 'a count'} from {least} (its "
                                  f"{'bitmap' if even else 'bitmap and scales'}) to {want}")
        elif not _is_int(nbytes) or nbytes != want or want > MAX_TENSOR_BYTES:
            raise _fail(path, f"tensor {name!r} claims {nbytes!r} bytes; a {type_} tensor of shape {shape} "
                              f"takes {want}")
        if not _is_int(offset) or offset < 0 or offset % ALIGNMENT:
            raise _fail(path, f"tensor {name!r} has offset {offset!r}, not a non-negative multiple of {ALIGNMENT}")
        if data_size < 0 or offset > data_size or nbytes > data_size - offset:
            raise _fail(path, f"tensor {name!r} (offset {offset}, {nbytes} bytes) extends past the end of the "
                              f"data section; the file is truncated")
        tensors[name] = TensorEntry(name, type_, tuple(shape), data_start + offset, nbytes)
    prev = None
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if prev is not None and t.offset < prev.offset + prev.nbytes:
            raise _fail(path, f"tensors {prev.name!r} and {t.name!r} overlap")
        prev = t
    return metadata, tensors


# ---------------------------------------------------------------------------------------------------
# config.json <-> ModelSpec.

def spec_to_dict(spec: ModelSpec) -> Dict[str, Any]:
    return asdict(spec)


def spec_from_dict(d: Any, source: str) -> ModelSpec:
    names = {f.name for f in fields(ModelSpec)}
    if not isinstance(d, dict):
        raise ModelLoadError(f"{source}: config.json 'spec' is not an object")
    unknown = sorted(set(d) - names)
    if unknown:
        raise ModelLoadError(f"{source}: config.json 'spec' has unknown fields: {', '.join(unknown)}")
    try:
        spec = ModelSpec(**d)
    except TypeError as e:
        raise ModelLoadError(f"{source}: config.json 'spec': {e}") from None
    if spec.arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{source}: unsupported architecture {spec.arch!r}")
    if not isinstance(spec.eos_token_ids, list):
        raise ModelLoadError(f"{source}: config.json 'spec.eos_token_ids' is not a list")
    return validate_spec(spec, source)


def is_corelm_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, WEIGHTS_FILE))


def load_corelm_folder(folder: str) -> LoadedModel:
    folder = os.path.abspath(folder)
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{folder}: has {WEIGHTS_FILE} but no {CONFIG_FILE}")
    config = read_json(config_path, CONFIG_FILE)
    if not isinstance(config, dict) or config.get("format") != "corelm":
        raise ModelLoadError(f"{config_path}: not a corelm model config (no \"format\": \"corelm\")")
    if config.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{config_path}: corelm format version {config.get('format_version')!r}; this "
                             f"corelm reads version {FORMAT_VERSION} (re-convert the model)")
    spec = spec_from_dict(config.get("spec"), folder)
    w = CorelmWeights(os.path.join(folder, WEIGHTS_FILE))
    expected = weight_shapes(spec)
    missing = [n for n in expected if n not in w.tensors]
    extra = [n for n in w.tensors if n not in expected]
    if missing or extra:
        raise ModelLoadError(f"{w.path}: tensors do not match config.json: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
    for n, want in expected.items():
        if w.tensors[n].shape != tuple(want):
            raise ModelLoadError(f"{w.path}: tensor {n} has shape {w.tensors[n].shape}, config.json implies "
                                 f"{tuple(want)}")

    def get_weight(name: str) -> np.ndarray:
        if name not in w.tensors:
            raise ModelLoadError(f"no weight named {name!r}")
        return check_finite(w.get_f32(name), w.path, name)

    def raw_weight_type(name: str):
        t = w.tensors.get(name)
        return None if t is None else TYPES[t.type].raw

    def get_raw_weight(name: str):
        """Blocks as stored; a sparse matrix in its dense form (sbf16: the bf16 rows set_weight_raw takes for
        "SBF16"; sq8 / sq4: the Q8_0 / Q4_0 blocks it takes for "SQ8" / "SQ4")."""
        t = w.tensors.get(name)
        raw_type = raw_weight_type(name)
        if raw_type is None:
            return None
        raw = w.dense_raw(name) if TYPES[t.type].sparse else w.raw(name)
        check_finite_blocks(raw_type, raw, w.path, name)
        return raw_type, raw.reshape(t.shape[0], -1), t.shape

    kinds: Dict[str, int] = {}
    for t in w.tensors.values():
        kinds[t.type] = kinds.get(t.type, 0) + t.nbytes
    order = sorted(kinds, key=kinds.get, reverse=True)
    sparsity = config.get("sparsity")       # what convert asked for (the tensors say what was stored)
    pruned = ""
    if isinstance(sparsity, dict) and sparsity.get("method") in CHOICES["prune"].values and \
            isinstance(sparsity.get("target"), (int, float)):
        pruned = f", pruned to {sparsity['target']:g} by {sparsity['method']}"
    return LoadedModel(
        spec=spec, get_weight=get_weight, get_raw_weight=get_raw_weight, raw_weight_type=raw_weight_type,
        release_weight=w.release,
        tokenizer=load_tokenizer("from_hf_folder", folder, folder), chat_template=folder_chat_template(folder),
        generation_config=optional_json(os.path.join(folder, "generation_config.json"), "generation_config.json"),
        source=folder, source_format="corelm",
        description=f"corelm v{FORMAT_VERSION} {config.get('weights', '?')} ({'/'.join(order)}){pruned}",
        stored_tensors={n: (t.type, t.shape, t.nbytes) for n, t in w.tensors.items()})
