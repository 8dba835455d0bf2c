"""A hardened safetensors reader (single files and sharded folders).

Layout: u64 little-endian header length N | N bytes of UTF-8 JSON (starts with '{', may be padded with
spaces) | data buffer. The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the data buffer) plus an optional "__metadata__" str->str map.

Every field is validated before use, following the safetensors spec and the Trail of Bits audit: header
cap, duplicate keys, checked shape products, end - begin == numel * itemsize, offsets inside the buffer,
no overlaps. Tensor data stays memory-mapped; `get` decodes one tensor to float32 on demand.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from .spec import ModelLoadError, bf16_to_f32, release_mapped_range, row_range

MAX_HEADER_BYTES = 100 * 1000 * 1000   # the spec's cap "to prevent parsing extremely large JSON"
MAX_RANK = 16
MAX_NAME_LEN = 1 << 12
MAX_TENSOR_BYTES = 1 << 62
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# dtype -> (numpy dtype, bytes per element). All little-endian, as the format prescribes.
DTYPES: Dict[str, Tuple[Optional[str], int]] = {
    "F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": (None, 2),
    "I64": ("<i8", 8), "I32": ("<i4", 4), "I16": ("<i2", 2), "I8": ("<i1", 1),
    "U64": ("<u8", 8), "U32": ("<u4", 4), "U16": ("<u2", 2), "U8": ("<u1", 1), "BOOL": ("<u1", 1),
    "F8_E4M3": (None, 1), "F8_E5M2": (None, 1),
}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_UNDECODABLE = ("F8_E4M3", "F8_E5M2")
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class SafetensorsTensorInfo:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    begin: int          # offsets relative to the data buffer, as in the header
    end: int


class SafetensorsFile:
    """One validated .safetensors file. `tensors` holds the header; `get(name)` returns float32."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self._buf = _map_file(self.path)
        self.data_offset, header = _read_header(self._buf, self.path)
        data_size = len(self._buf) - self.data_offset
        self.metadata: Dict[str, str] = _parse_metadata(header.pop("__metadata__", None), self.path)
        self.tensors: Dict[str, SafetensorsTensorInfo] = {
            name: _parse_entry(name, entry, data_size, self.path) for name, entry in header.items()}
        _check_no_overlap(self.tensors.values(), self.path)
        _check_covers_buffer(self.tensors.values(), data_size, self.path)

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self.tensors)} tensors)"

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> List[str]:
        return list(self.tensors)

    def get(self, name: str, r0: int = 0, r1: int = -1) -> np.ndarray:
        """The tensor as C-contiguous float32 (a read-only view of the mapping when stored as F32); with
        r1 >= 0, only its rows [r0, r1) (spec.row_range), decoded alone."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: no tensor named {name!r}")
        if info.dtype in _UNDECODABLE:
            raise ModelLoadError(f"{self.path}: tensor {name} has dtype {info.dtype}, which corelm does not "
                                 f"support yet (supported: {', '.join(_FLOAT_DTYPES)} and integer types)")
        start, count, shape = row_range(info.shape, info.end - info.begin, r0, r1)
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=count, offset=self.data_offset + info.begin + start)
        if info.dtype == "BF16":
            out = bf16_to_f32(raw)
        else:
            out = raw.view(DTYPES[info.dtype][0])
            if out.dtype != np.float32:
                out = out.astype(np.float32)
        return out.reshape(shape)

    def raw_bf16(self, name: str, r0: int = 0, r1: int = -1) -> Optional[np.ndarray]:
        """A BF16 tensor's stored bytes (rows [r0, r1) with r1 >= 0) as a read-only uint8 view of the
        mapping, [rows, 2 * cols]; None for any other dtype."""
        info = self.tensors.get(name)
        if info is None or info.dtype != "BF16":
            return None
        start, count, shape = row_range(info.shape, info.end - info.begin, r0, r1)
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=count, offset=self.data_offset + info.begin + start)
        return raw.reshape(-1, 2 * shape[-1])

    def release(self, name: str, r0: int = 0, r1: int = -1) -> None:
        info = self.tensors.get(name)
        if info is not None:
            start, count, _ = row_range(info.shape, info.end - info.begin, r0, r1)
            release_mapped_range(self._buf, self.data_offset + info.begin + start, count)


def _map_file(path: str):
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ModelLoadError(f"{path}: file is empty, not a safetensors file")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"cannot open safetensors file {path}: {e.strerror or e}") from None


def _fail(path: str, msg: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: corrupt safetensors file: {msg}")


def _read_header(buf, path: str) -> Tuple[int, dict]:
    size = len(buf)
    if size < 8:
        raise _fail(path, f"file is {size} bytes, too short for the 8-byte header length")
    n = struct.unpack("<Q", buf[:8])[0]
    if n > MAX_HEADER_BYTES:
        raise _fail(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if n > size - 8:
        raise _fail(path, f"header length {n} is larger than the rest of the file ({size - 8} bytes)")
    raw = bytes(buf[8:8 + n])
    if not raw.startswith(b"{"):
        raise _fail(path, "header does not start with '{' (not a JSON object)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except _DuplicateKey as e:
        raise _fail(path, f"duplicate key {e.args[0]!r} in header") from None
    except RecursionError:
        raise _fail(path, "header JSON is nested too deeply") from None
    except ValueError as e:
        raise _fail(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object")
    return 8 + n, header


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs):
    # The spec forbids duplicate names, and json.loads would silently keep the last one.
    d = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


def _no_constants(name: str):
    raise ValueError(f"{name} is not allowed")


def _parse_metadata(meta, path: str) -> Dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _fail(path, "__metadata__ must be a JSON object mapping strings to strings")
    return meta


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(name: str, entry, data_size: int, path: str) -> SafetensorsTensorInfo:
    if not name or len(name) > MAX_NAME_LEN:
        raise _fail(path, f"a tensor has an empty name or one longer than {MAX_NAME_LEN} characters")
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise _fail(path, f"entry for tensor {name!r} must be an object with exactly the keys "
                          f"dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _fail(path, f"tensor {name!r} has unknown dtype {_short(dtype)} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(path, f"tensor {name!r} has an invalid shape {_short(shape)} "
                          f"(must be a list of at most {MAX_RANK} non-negative integers)")
    nbytes = DTYPES[dtype][1]
    for d in shape:
        nbytes *= d     # Python ints do not wrap; the cap stands in for a checked multiply
        if nbytes > MAX_TENSOR_BYTES:
            raise _fail(path, f"tensor {name!r} with shape {shape} is impossibly large")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise _fail(path, f"tensor {name!r} has invalid data_offsets {_short(offsets)} (must be [begin, end])")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise _fail(path, f"tensor {name!r} has data_offsets [{begin}, {end}] outside the "
                          f"{data_size}-byte data buffer (or end < begin)")
    if end - begin != nbytes:
        raise _fail(path, f"tensor {name!r} spans {end - begin} bytes but its shape {shape} and dtype "
                          f"{dtype} need {nbytes}")
    return SafetensorsTensorInfo(name, dtype, tuple(shape), begin, end)


def _check_no_overlap(infos, path: str) -> None:
    prev = None
    for t in sorted((t for t in infos if t.end > t.begin), key=lambda t: t.begin):
        if prev is not None and t.begin < prev.end:
            raise _fail(path, f"tensors {prev.name!r} and {t.name!r} overlap in the data buffer")
        prev = t


def _check_covers_buffer(infos, data_size: int, path: str) -> None:
    # The spec: "the byte buffer needs to be entirely indexed, and cannot contain holes". A header length
    # that is off (say one short, the JSON then ending in a space) shifts every tensor while each still
    # fits; only this check notices, as the reference implementation's does.
    pos = 0
    for t in sorted((t for t in infos if t.end > t.begin), key=lambda t: t.begin):
        if t.begin != pos:
            raise _fail(path, f"bytes {pos}..{t.begin} of the data buffer belong to no tensor (before "
                              f"{t.name!r}); the tensors must cover the buffer without holes")
        pos = t.end
    if pos != data_size:
        raise _fail(path, f"the tensors cover {pos} bytes but the data buffer after the header holds "
                          f"{data_size}; the header length is wrong or the file has trailing bytes")


# ---------------------------------------------------------------------------------------------------
# Folders: a single model.safetensors, or shards listed by model.safetensors.index.json.

class SafetensorsCollection:
    """The tensors of one model across its safetensors files, looked up by name."""

    def __init__(self, files: List[SafetensorsFile]):
        self.files = files
        self._where: Dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                if name in self._where:
                    raise ModelLoadError(f"tensor {name!r} appears in both {self._where[name].path} and {f.path}")
                self._where[name] = f

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def info(self, name: str) -> SafetensorsTensorInfo:
        return self._where[name].tensors[name]

    def get(self, name: str, r0: int = 0, r1: int = -1) -> np.ndarray:
        f = self._where.get(name)
        if f is None:
            raise ModelLoadError(f"no tensor named {name!r} in {', '.join(x.path for x in self.files)}")
        return f.get(name, r0, r1)

    def raw_bf16(self, name: str, r0: int = 0, r1: int = -1) -> Optional[np.ndarray]:
        f = self._where.get(name)
        return None if f is None else f.raw_bf16(name, r0, r1)

    def release(self, name: str, r0: int = 0, r1: int = -1) -> None:
        f = self._where.get(name)
        if f is not None:
            f.release(name, r0, r1)


def open_safetensors_folder(folder: str) -> SafetensorsCollection:
    """Open model.safetensors, or every shard named by model.safetensors.index.json, in `folder`."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        return _open_sharded(folder, index)
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(single):
        return SafetensorsCollection([SafetensorsFile(single)])
    raise ModelLoadError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _open_sharded(folder: str, index: str) -> SafetensorsCollection:
    weight_map = _read_weight_map(index)
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        _check_shard_name(shard, folder, index)
    files = {s: SafetensorsFile(os.path.join(folder, s)) for s in shards}
    for name, shard in weight_map.items():
        if name not in files[shard]:
            raise ModelLoadError(f"{index}: maps tensor {name!r} to {shard}, which does not contain it")
    return SafetensorsCollection(list(files.values()))


def _read_weight_map(index: str) -> Dict[str, str]:
    try:
        if os.path.getsize(index) > MAX_HEADER_BYTES:
            raise ModelLoadError(f"{index}: file is too large for a shard index")
        with open(index, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"), object_pairs_hook=_no_duplicates,
                             parse_constant=_no_constants)
    except _DuplicateKey as e:
        raise ModelLoadError(f"{index}: not a valid shard index (duplicate key {e.args[0]!r})") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"{index}: not a valid shard index ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ModelLoadError(f"{index}: 'weight_map' must be a non-empty object mapping tensor names to "
                             f"shard file names")
    return weight_map


def _check_shard_name(shard: str, folder: str, index: str) -> None:
    # A shard must be a plain file name inside the folder: no directories, no '..', no absolute paths,
    # so a hostile index cannot make us open files elsewhere. (Symlinks are fine: the HF cache uses them.)
    plain = shard and shard not in (".", "..") and "/" not in shard and "\\" not in shard \
        and "\0" not in shard and os.path.basename(shard) == shard and not os.path.isabs(shard)
    if not plain or not shard.endswith(".safetensors"):
        raise ModelLoadError(f"{index}: shard name {shard!r} is not a plain .safetensors file name "
                             f"in the model folder")
    if not os.path.isfile(os.path.join(folder, shard)):
        raise ModelLoadError(f"{index}: shard {shard} is missing from {folder}")
