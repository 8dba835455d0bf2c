"""`corelm convert`: an HF folder or GGUF file -> a corelm model folder (docs/model-format.md).

    from corelm.convert import convert, cached_conversion
    convert("models/SmolLM2-135M-Instruct", "out/smollm2-q8", weights="q8_0")
    folder = cached_conversion("models/SmolLM2-135M-Instruct", "q4_1")     # converts once, then reuses

Weights (corelm.options.WEIGHT_FORMATS): "fp32" and "bf16" keep every matrix in that float type;
"q8_0", "q4_0" and "q4_1" store every matrix as those ggml blocks (the 4-bit ones keep embeddings and
lm_head in Q8_0). q8_0 and q4_0 round to nearest as ggml's reference quantizers and the engine's packer
do (a q8_0 folder computes what the engine's in-memory dtype="q8_0" builds from the source, bit for
bit); q4_1 searches each block's scale and minimum for the least error, weighted by how large the
activations each weight multiplies are on a short calibration text (corelm.calibrate).
"q4_k", "q5_k" and "q6_k" write ggml's K-quant blocks (super-blocks of 256, the bytes GGUF stores) with
llama.cpp's choices (k_quant_type): lm_head (or a tied embedding) in Q6_K, rows that are not whole
super-blocks in Q5_0 / Q5_1 / Q8_0; "q4_k_m" and "q5_k_m" also put attn_v and ffn_down of some layers in
Q6_K, as llama.cpp's Q4_K_M / Q5_K_M. Their scales and codes are searched like q4_1's, with the same
activation weighting (cpp/kernels/quantize.h).
Norms, biases and MoE routers stay fp32. GGUF tensors already in blocks the target keeps (RAW_KEEP; under
a K-quant target: the type chosen for that matrix) are copied block for block, never through floats.

Sparse storage (weights "bf16", "q8_0" or "q4_0"): sparsity=0.5 prunes every matrix but the embedding,
lm_head and those keep_dense names to half zeros per row (prune="wanda": the smallest |W| * sqrt(mean x^2
of the input column) on the calibration text; "magnitude": the smallest |W|) and stores them as sbf16,
sq8_0 or sq4_0 (a bitmap and the non-zeros; quantized: the pruned matrix quantized as the dense format,
then its zero codes dropped); sparsity="auto" prunes nothing and stores sparse the matrices whose zeros
already save bytes.
config.json records each sparse matrix's stored fraction of zeros.

    convert("models/SmolLM2-135M-Instruct", "out/smollm2-s50", weights="bf16", sparsity=0.5,
            keep_dense="layers.0.*")
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

import numpy as np

from . import __version__ as corelm_version
from . import calibrate
from .loader import load_model
from .loader.checks import read_json
from .loader.corelm_format import (CONFIG_FILE, FORMAT_VERSION, WEIGHTS_FILE, WeightsWriter, bitmap_nbytes,
                                   is_corelm_folder, pack_sbf16, pack_sparse_blocks, spec_to_dict,
                                   stored_sparsity)
from .loader.hub import download_from_hub, looks_like_repo_id
from .loader.spec import LoadedModel, kept_float, stored_raw_type, weight_shapes
from .options import GGUF_BLOCK_FORMATS, K_QUANT_TARGETS, SPARSE_OF, WEIGHT_FORMATS, choose, format_of_gguf
from .threads import default_threads

__all__ = ["convert", "cached_conversion", "folder_dtype", "quantize_q8_0", "quantize_q4_0", "quantize_q4_1",
           "quantize_q4_1_search", "quantize_ggml_search", "k_quant_type", "to_bf16", "prune_rows", "cache_dir"]

log = logging.getLogger("corelm")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# GGUF block formats copied as they are under each target (4-bit targets keep either 4-bit format).
# A GGUF's blocks copied as they are: its own 8-bit or 4-bit ones where they fit the target, and the
# formats these targets do not quantize into (Q4_K, IQ4_XS, ...) always. The K-quant targets keep a
# tensor as stored when it is in the type chosen for it (_plan).
RAW_KEEP = {t: keep + GGUF_BLOCK_FORMATS for t, keep in
            {"q8_0": ("q8_0",), "q4_0": ("q4_0", "q4_1"), "q4_1": ("q4_0", "q4_1")}.items()}
# The 4-bit targets keep the embedding and lm_head at 8 bits: on Qwen2.5-0.5B 4-bit ones cost ~3 points
# of perplexity. q4_1's scale and minimum are searched (quantize_q4_1_search): on SmolLM2-135M, Q4_0
# blocks everywhere cost +37% perplexity, Q4_1 +4%; on Qwen2.5-0.5B, the search halves Q4_1's loss and
# weighting its error by the activations' size takes it from +5.2% to +4.4% (docs/quality.md).
EIGHT_BIT_EMBEDDINGS = ("q4_0", "q4_1")
# The K-quant targets' main type; a matrix whose rows are not whole 256-weight super-blocks falls back to
# the 32-weight block llama.cpp's tensor_type_fallback picks for that type.
K_BASE = {"q4_k": "q4_k", "q5_k": "q5_k", "q6_k": "q6_k", "q4_k_m": "q4_k", "q5_k_m": "q5_k"}
K_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
# Formats written by the C++ search (quantize_ggml_search), with the activation weighting.
GGML_SEARCHED = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1")
_ROWS_PER_CHUNK = 4096
CONVERTER_REVISION = 3      # part of the cache key: bump when the same source would convert differently

_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
_Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])
_Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])


# ---------------------------------------------------------------------------------------------------
# Quantizers: numpy versions of ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref.

def _inverse(d: np.ndarray) -> np.ndarray:
    safe = np.where(d != 0, d, np.float32(1))
    return np.where(d != 0, np.float32(1) / safe, np.float32(0)).astype(np.float32)


def _rows_in_chunks(w: np.ndarray, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % 32:
        raise ValueError(f"block quantization needs a matrix with a multiple of 32 columns, got {w.shape}")
    return np.concatenate([fn(w[r:r + _ROWS_PER_CHUNK]) for r in range(0, w.shape[0], _ROWS_PER_CHUNK)])


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> uint8 [rows, cols/32*34]: fp16 scale absmax/127, 32 int8 codes rounded half
    away from zero."""
    def one(x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        b = x.reshape(-1, 32)
        d = (np.abs(b).max(1) / np.float32(127)).astype(np.float32)
        v = b * _inverse(d)[:, None]
        q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
        blk = np.empty(len(b), _Q8_0)
        blk["d"], blk["qs"] = d.astype(np.float16), q
        return blk.view(np.uint8).reshape(rows, -1)
    return _rows_in_chunks(w, one)


def quantize_q4_0(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> uint8 [rows, cols/32*18]: fp16 scale d = (signed absmax)/-8, codes
    min(15, trunc(x/d + 8.5)); byte j holds element j (low nibble) and element j+16 (high nibble)."""
    def one(x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        b = x.reshape(-1, 32)
        mx = b[np.arange(len(b)), np.abs(b).argmax(1)]
        d = (mx / np.float32(-8)).astype(np.float32)
        # x * id + 8.5 with one rounding, as the engine's compiled quantizer (a fused multiply-add) does
        v = (b.astype(np.float64) * _inverse(d).astype(np.float64)[:, None] + 8.5).astype(np.float32)
        q = np.minimum(15, np.trunc(v)).astype(np.uint8)
        blk = np.empty(len(b), _Q4_0)
        blk["d"], blk["qs"] = d.astype(np.float16), q[:, :16] | (q[:, 16:] << 4)
        return blk.view(np.uint8).reshape(rows, -1)
    return _rows_in_chunks(w, one)


def quantize_q4_1(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> uint8 [rows, cols/32*20]: fp16 d = (max-min)/15, fp16 m = min, codes
    min(15, trunc((x-min)/d + 0.5)) (one rounding, as the engine's fused multiply-add); nibbles as Q4_0."""
    def one(x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        b = x.reshape(-1, 32)
        mn, mx = b.min(1), b.max(1)
        d = ((mx - mn) / np.float32(15)).astype(np.float32)
        v = ((b - mn[:, None]).astype(np.float64) * _inverse(d).astype(np.float64)[:, None] + 0.5).astype(np.float32)
        q = np.minimum(15, np.trunc(v)).astype(np.uint8)
        blk = np.empty(len(b), _Q4_1)
        blk["d"], blk["m"], blk["qs"] = d.astype(np.float16), mn.astype(np.float16), q[:, :16] | (q[:, 16:] << 4)
        return blk.view(np.uint8).reshape(rows, -1)
    return _rows_in_chunks(w, one)


def _search_rows(w: np.ndarray, importance: Optional[np.ndarray], block: int,
                 fn: Callable[[np.ndarray, Optional[np.ndarray]], np.ndarray]) -> np.ndarray:
    """fn (a C++ search, which releases the GIL) over w's rows, split over threads."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % block:
        raise ValueError(f"block quantization needs a matrix with a multiple of {block} columns, got {w.shape}")
    imp = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    step = max(1, -(-w.shape[0] // (4 * default_threads())))
    with ThreadPoolExecutor(default_threads()) as pool:
        return np.concatenate(list(pool.map(lambda r: fn(w[r:r + step], imp), range(0, w.shape[0], step))))


def quantize_q4_1_search(w: np.ndarray, importance: Optional[np.ndarray] = None) -> np.ndarray:
    """Q4_1 blocks (the format of quantize_q4_1) with each block's scale and minimum searched for the least
    squared error (cpp/kernels/quantize.h), weighted by `importance` (one value >= 0 per column, e.g. the
    mean square of the activations the column multiplies) when given. Never worse than round-to-nearest
    block by block; a block already on a Q4_1 grid comes back unchanged. Rows are split over threads."""
    from . import _core
    return _search_rows(w, importance, 32, _core.quantize_q4_1_search)


def quantize_ggml_search(w: np.ndarray, fmt: str, importance: Optional[np.ndarray] = None) -> np.ndarray:
    """[rows, cols] float -> uint8 [rows, row bytes] of GGUF blocks of `fmt` ("q4_k", "q5_k", "q6_k": cols a
    multiple of 256; "q5_0", "q5_1": of 32), byte for byte as GGUF stores them. Scales, minimums and codes
    are searched for the least squared error, weighted by `importance` as quantize_q4_1_search's
    (cpp/kernels/quantize.h); the K-quants' sub-block scales are then quantized by a weighted search too."""
    from . import _core
    gguf_type = WEIGHT_FORMATS[fmt].gguf
    return _search_rows(w, importance, WEIGHT_FORMATS[fmt].block,
                        lambda part, imp: _core.quantize_ggml_search(part, gguf_type, imp))


def to_bf16(w: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(w), np.uint16(0x7FC0), r).astype(np.uint16)


# ---------------------------------------------------------------------------------------------------
# Pruning, for sparse storage (sbf16, sq8_0, sq4_0).

# Kept dense under every sparsity, as Wanda and SparseGPT do: a token reads one row of the embedding
# (nothing to save), and lm_head's errors go straight into the logits.
ALWAYS_DENSE = ("tok_embeddings", "lm_head")


@dataclass(frozen=True)
class Sparsity:
    """What convert(sparsity=, prune=, keep_dense=) asks for. target None: "auto", nothing pruned, a matrix
    stored sparse where its zeros save bytes."""
    target: Optional[float]
    method: str                     # "wanda", "magnitude" or "auto"
    keep_dense: Tuple[str, ...]     # fnmatch patterns of internal weight names kept dense, beyond ALWAYS_DENSE

    def dense(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in ALWAYS_DENSE + self.keep_dense)


def sparsity_option(sparsity: Union[None, str, float], prune: Optional[str] = None,
                    keep_dense: Union[None, str, Sequence[str]] = None, weights: str = "bf16") -> Optional[Sparsity]:
    """convert's sparsity arguments checked (ValueError saying what is wrong); None: dense."""
    patterns = tuple(p.strip() for p in (keep_dense.split(",") if isinstance(keep_dense, str) else keep_dense or ())
                     if p.strip())
    if sparsity is None:
        if prune is not None or patterns:
            raise ValueError("prune and keep_dense choose how a sparse conversion prunes; give a sparsity too")
        return None
    if weights not in SPARSE_OF:
        raise ValueError(f"sparse storage exists for {', '.join(SPARSE_OF)} weights: use one of them (--weights) "
                         f"with a sparsity, not {weights}")
    if isinstance(sparsity, str) and sparsity.strip().lower() == "auto":
        if prune is not None:
            raise ValueError("sparsity auto prunes nothing (it stores the zeros the weights already have); "
                             "drop prune or give a fraction")
        return Sparsity(None, "auto", patterns)
    try:
        target = float(sparsity)
    except (TypeError, ValueError):
        target = math.nan
    if not 0 <= target < 1 or isinstance(sparsity, bool):
        raise ValueError(f"sparsity must be a fraction in [0, 1) or auto, got {sparsity!r}")
    return Sparsity(target, choose("prune", prune or "wanda"), patterns)


def prune_rows(w: np.ndarray, sparsity: float, importance: Optional[np.ndarray] = None) -> np.ndarray:
    """w [rows, cols] with the floor(sparsity * cols) lowest-scoring weights of every row set to 0: score
    |W| (magnitude), or |W| * sqrt(importance[col]) with importance the mean square of the activation each
    column multiplies (Wanda, Sun et al. 2023). Ties go to the lower column, so the mask is deterministic."""
    w = np.array(w, dtype=np.float32)
    # floor of the product, with the float noise of e.g. 0.29 * 100 = 28.999999999999996 taken off
    k = int(math.floor(sparsity * w.shape[1] + 1e-9))
    if k == 0:
        return w
    scale = None if importance is None else np.sqrt(np.asarray(importance, np.float32))
    for r in range(0, w.shape[0], _ROWS_PER_CHUNK):
        part = w[r:r + _ROWS_PER_CHUNK]
        score = np.abs(part) if scale is None else np.abs(part) * scale
        np.put_along_axis(part, np.argsort(score, axis=1, kind="stable")[:, :k], 0, axis=1)
    return w


def _zeros_save_bytes(loaded: LoadedModel, name: str, weights: str) -> bool:
    """Whether a matrix's zeros (sparsity auto; quantized: its zero codes) make its sparse format smaller than
    the dense one."""
    w = loaded.get_weight(name)
    loaded.release_weight(name)
    if weights == "bf16":
        bits = to_bf16(w)
        return bitmap_nbytes(bits.shape) + 2 * np.count_nonzero(bits & 0x7FFF) < 2 * bits.size
    blocks = _quantize(weights, w)
    return pack_sparse_blocks(blocks, WEIGHT_FORMATS[SPARSE_OF[weights]].file_type).size < blocks.size


def sparsity_summary(fractions: Iterable[float], fmt: str = "sbf16") -> str:
    """"N matrices sparse (fmt): z% zeros on average (a-b% per matrix)" for the stored fractions of zeros."""
    f = list(fractions)
    if not f:
        return "no matrix sparse"
    return (f"{len(f)} matri{'x' if len(f) == 1 else 'ces'} sparse ({fmt}): {100 * sum(f) / len(f):.1f}% zeros on "
            f"average ({100 * min(f):.1f}-{100 * max(f):.1f}% per matrix)")


# ---------------------------------------------------------------------------------------------------
# Conversion.

def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def k_quant_type(weights: str, name: str, shape: Tuple[int, ...], tied: bool, layers: int) -> str:
    """The format of matrix `name` under a K-quant target, as llama.cpp's llama_tensor_get_type chooses:
    lm_head (the embedding when it is tied to it: its errors go straight into the logits) in q6_k; under
    q4_k_m / q5_k_m attn_v and ffn_down of the layers _use_more_bits picks in q6_k too; everything else,
    the embedding included, in the target's type. Rows that are not whole super-blocks fall back to
    K_FALLBACK's 32-weight blocks."""
    t = K_BASE[weights]
    if name == "lm_head" or (name == "tok_embeddings" and tied):
        t = "q6_k"
    elif weights.endswith("_m") and name.rsplit(".", 1)[-1] in ("wv", "w_down") and \
            _use_more_bits(int(name.split(".")[1]), layers):
        t = "q6_k"
    return K_FALLBACK[t] if shape[1] % 256 else t


def _plan(loaded: LoadedModel, weights: str, sparse: Optional[Sparsity] = None,
          draft: bool = False) -> Dict[str, Tuple[str, Tuple[int, ...], bool]]:
    """internal name -> (storage type, shape, copied raw from the source). draft: a speculative draft's
    plan, the fewest bytes a token: every matrix, the embedding and lm_head included, in the target's type
    (K-quants: its base type), a GGUF's own blocks kept only where they are no larger."""
    plan = {}
    for name, shape in weight_shapes(loaded.spec).items():
        quantized = weights in RAW_KEEP or weights in K_BASE
        if len(shape) == 1 or weights == "fp32" or kept_float(name) or (quantized and shape[1] % 32):
            # norms, biases, MoE routers, and rows that are not whole blocks (the engine pads those when it
            # quantizes)
            plan[name] = ("fp32", shape, False)
            continue
        if sparse is not None and not sparse.dense(name) and \
                (sparse.target is not None or _zeros_save_bytes(loaded, name, weights)):
            plan[name] = (SPARSE_OF[weights], shape, False)
            continue
        raw_type = stored_raw_type(loaded, name) if quantized else None
        raw_format = format_of_gguf(raw_type) if raw_type is not None else None
        if weights in K_BASE:
            type_ = k_quant_type(weights, name, shape, loaded.spec.tie_word_embeddings, loaded.spec.num_layers)
            if draft:
                type_ = K_FALLBACK[K_BASE[weights]] if shape[1] % 256 else K_BASE[weights]
            plan[name] = (type_, shape, raw_format is not None and raw_format.name == type_)
            continue
        embedding = weights in EIGHT_BIT_EMBEDDINGS and name in ("tok_embeddings", "lm_head") and not draft
        keep = RAW_KEEP.get(weights, ())
        if draft:
            keep = tuple(f for f in keep if WEIGHT_FORMATS[f].bits <= WEIGHT_FORMATS[weights].bits)
        if raw_format is not None and raw_format.name in keep + (("q8_0",) if embedding else ()):
            plan[name] = (raw_format.name, shape, True)
        else:
            plan[name] = ("q8_0" if embedding else weights, shape, False)
    return plan


def _tensor_bytes(loaded: LoadedModel, name: str, type_: str, from_raw: bool,
                  importance: Dict[str, np.ndarray], sparse: Optional[Sparsity]) -> np.ndarray:
    if from_raw:
        return loaded.get_raw_weight(name)[1]
    w = loaded.get_weight(name)
    if type_ == "fp32":
        return np.ascontiguousarray(w, dtype=np.float32)
    if type_ == "bf16":
        return to_bf16(w)
    if WEIGHT_FORMATS[type_].sparse:
        if sparse.target is not None:     # an expert no calibration token reached has no importance: magnitude
            w = prune_rows(w, sparse.target, importance.get(name) if sparse.method == "wanda" else None)
        if type_ == "sbf16":
            return pack_sbf16(to_bf16(w))
        dense = next(d for d, s in SPARSE_OF.items() if s == type_)     # zeros quantize to the zero code
        return pack_sparse_blocks(_quantize(dense, w), WEIGHT_FORMATS[type_].file_type)
    if type_ == "q4_1":
        return quantize_q4_1_search(w, importance.get(name))
    if type_ in GGML_SEARCHED:
        return quantize_ggml_search(w, type_, importance.get(name))
    return _quantize(type_, w)


def _quantize(type_: str, w: np.ndarray) -> np.ndarray:
    return {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0}[type_](w)


def convert(src: str, out: str, weights: str = "q8_0", progress: bool = False, overwrite: bool = False,
            sparsity: Union[None, str, float] = None, prune: Optional[str] = None,
            keep_dense: Union[None, str, Sequence[str]] = None, draft: bool = False) -> str:
    """Converts `src` (HF folder, .gguf file or corelm folder) to the corelm folder `out`; returns `out`.
    The folder appears complete or not at all (written beside it, then renamed). sparsity (with weights
    "bf16", "q8_0" or "q4_0"): a fraction in [0, 1) of each row to prune (prune "wanda", the default, or "magnitude"), or
    "auto"; keep_dense: fnmatch patterns of internal names (a list or "a,b") kept dense besides the
    embedding and lm_head. draft: for a speculative draft, whose guesses the target checks, so its bytes
    matter more than its last digits: every matrix in the target's type (see _plan)."""
    weights = choose("weights", weights)
    sparse = sparsity_option(sparsity, prune, keep_dense, weights)
    out = os.path.abspath(os.path.expanduser(out))
    clean_leftovers(os.path.dirname(out))     # of a convert killed here earlier: may bring `out` back
    _check_replaceable(out, overwrite)        # before the (long) conversion, and again before the rename
    loaded = load_model(src)
    if sparse is not None:
        _check_patterns(sparse.keep_dense, loaded)
    if draft and sparse is not None:
        raise ValueError("a draft conversion stores dense matrices: leave sparsity unset.")
    plan = _plan(loaded, weights, sparse, draft)
    importance = {}
    if any((t in ("q4_1",) + GGML_SEARCHED and not from_raw) or (WEIGHT_FORMATS[t].sparse and sparse.method == "wanda")
           for t, _, from_raw in plan.values()):
        importance = calibrate.activation_importance(loaded, calibrate.calibration_ids(loaded), progress=progress)
        if loaded.spec.tie_word_embeddings and "lm_head" in importance:    # the embedding is the lm_head
            importance["tok_embeddings"] = importance.pop("lm_head")
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=_owned(STAGING_PREFIX), dir=parent)
    try:
        meta = {"source": loaded.source, "source_format": loaded.source_format, "weights": weights}
        writer = WeightsWriter(os.path.join(tmp, WEIGHTS_FILE),
                               [(n, WEIGHT_FORMATS[t].file_type, s) for n, (t, s, _) in plan.items()], meta)
        items = list(plan.items())
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(items), desc=f"converting to {weights}", unit="tensor")
        zeros = {}      # sparse matrix -> its stored fraction of zeros
        for name, (type_, shape, from_raw) in items:
            nbytes = writer.add(name, _tensor_bytes(loaded, name, type_, from_raw, importance, sparse))
            if WEIGHT_FORMATS[type_].sparse:
                zeros[name] = stored_sparsity(shape, nbytes, WEIGHT_FORMATS[type_].file_type)
            loaded.release_weight(name)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        writer.close()
        extra = {"draft": True} if draft else {}
        if sparse is not None:
            log.info("%s: %s", out, sparsity_summary(zeros.values(), SPARSE_OF[weights]))
            extra["sparsity"] = {"method": sparse.method, "target": sparse.target,
                                 "keep_dense": list(sparse.keep_dense),
                                 "matrices": {n: round(z, 6) for n, z in zeros.items()}}
        _write_side_files(loaded, tmp, weights, plan, extra)
        os.chmod(tmp, 0o755)
        _check_replaceable(out, overwrite)    # another process may have written `out` meanwhile
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# What `corelm convert` writes into a folder; --force replaces a folder holding nothing else.
CORELM_FOLDER_FILES = frozenset((WEIGHTS_FILE, CONFIG_FILE, "generation_config.json") + TOKENIZER_FILES)


def _check_replaceable(out: str, overwrite: bool) -> None:
    """Raises FileExistsError unless `out` is absent, or overwrite is set and `out` is an empty folder or a
    corelm model folder holding only corelm's files: --force must never delete anything else."""
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True / --force to replace it)")
    if os.path.islink(out) or not os.path.isdir(out):
        raise FileExistsError(f"{out} exists and is not a folder; --force replaces only a corelm model "
                              f"folder or an empty folder, so convert refuses to touch it")
    entries = sorted(os.listdir(out))
    if not entries:
        return
    foreign = [e for e in entries if e not in CORELM_FOLDER_FILES or not os.path.isfile(os.path.join(out, e))
               or os.path.islink(os.path.join(out, e))]
    if not is_corelm_folder(out) or not _has_corelm_config(out):
        raise FileExistsError(f"{out} is not a corelm model folder (no {WEIGHTS_FILE} with a corelm "
                              f"{CONFIG_FILE}); --force replaces only a corelm model folder or an empty folder, "
                              f"and this one holds {_few_names(entries)}. Choose another output folder.")
    if foreign:
        raise FileExistsError(f"{out} holds files that are not corelm's ({_few_names(foreign)}); --force would "
                              f"delete them, so convert refuses. Move them away or choose another output folder.")


def _has_corelm_config(folder: str) -> bool:
    try:
        with open(os.path.join(folder, CONFIG_FILE), "rb") as f:
            return json.loads(f.read(1 << 20)).get("format") == "corelm"
    except (OSError, ValueError, AttributeError):
        return False


def _few_names(names, n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _move_into_place(tmp: str, out: str) -> None:
    """Renames the finished folder `tmp` to `out`. An existing `out` (already checked replaceable) is first
    moved aside, into a folder of its own named after this process (ASIDE_PREFIX), and deleted only once
    the new folder is in place, so `out` is never a half folder; a kill between the two renames leaves the
    old folder where clean_leftovers puts it back."""
    aside = None
    if os.path.lexists(out):
        aside = tempfile.mkdtemp(prefix=_owned(ASIDE_PREFIX), dir=os.path.dirname(out))
        try:
            os.rename(out, os.path.join(aside, os.path.basename(out)))
        except OSError:
            os.rmdir(aside)
            raise
    try:
        os.rename(tmp, out)
    except OSError:
        if aside is not None:
            os.rename(os.path.join(aside, os.path.basename(out)), out)
            os.rmdir(aside)
        elif os.path.isdir(out):
            raise FileExistsError(f"{out} appeared while converting") from None
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


# A convert killed without cleaning up (SIGKILL, power loss) leaves, beside its output, its unfinished folder
# (STAGING_PREFIX) and, killed between --force's two renames, the old output moved aside (ASIDE_PREFIX, the
# old folder inside under its own name). Their names carry the owner (pid and a hash of the host name), so
# the next convert into the same folder can tell a dead owner's leftovers from a running convert's.
STAGING_PREFIX = ".corelm-convert-"
ASIDE_PREFIX = ".corelm-old-"
_LEFTOVER = re.compile(r"\.corelm-(convert|old)-(\d+)\.([0-9a-f]{8})-[a-z0-9_]+")


def _host() -> str:
    return hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _owned(prefix: str) -> str:
    """prefix + this process's owner tag: what mkdtemp names this process's leftovers with."""
    return f"{prefix}{os.getpid()}.{_host()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True                          # someone else's live process (or not a pid: leave it)
    return True


def clean_leftovers(parent: str) -> None:
    """Removes (STAGING_PREFIX) or puts back (ASIDE_PREFIX) what converts killed in `parent` left there, when
    their process is gone and ran on this host; warns about hidden convert folders it cannot place (another
    host's, or an older corelm's, named without an owner)."""
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith((STAGING_PREFIX, ASIDE_PREFIX)))
    except OSError:
        return
    for name in names:
        path = os.path.join(parent, name)
        m = _LEFTOVER.fullmatch(name)
        if m is None or m.group(3) != _host():
            what = ("an unfinished conversion; once no convert runs, delete it" if name.startswith(STAGING_PREFIX)
                    else "a model folder `convert --force` moved aside; once no convert runs, rename it back to "
                         "its name or delete it")
            log.warning("%s: left by a convert that was killed or runs on another machine: %s", path, what)
            continue
        if _alive(int(m.group(2))):
            continue                         # a convert running now
        try:
            if m.group(1) == "convert":
                shutil.rmtree(path)
                log.warning("removed %s, the unfinished folder of a convert that was killed", path)
            else:
                _restore_aside(parent, path)
        except OSError as e:                 # another convert cleaning the same folder, or no permission
            log.warning("could not clean up %s: %s", path, e)


def _restore_aside(parent: str, aside: str) -> None:
    entries = os.listdir(aside)
    if not entries:                          # killed before the first rename
        os.rmdir(aside)
        return
    if len(entries) > 1:
        log.warning("%s holds %s, not one moved-aside folder: left as it is", aside, _few_names(sorted(entries)))
        return
    name = entries[0]
    out = os.path.join(parent, name)
    if os.path.lexists(out):                 # the new folder was in place: the old one was being deleted
        shutil.rmtree(aside)
        log.warning("removed %s, the folder a killed `convert --force` had replaced with %s", aside, out)
    else:
        os.rename(os.path.join(aside, name), out)
        os.rmdir(aside)
        log.warning("restored %s, which a `convert --force` killed before writing its replacement had moved aside",
                    out)


def _check_patterns(patterns: Sequence[str], loaded: LoadedModel) -> None:
    """A keep_dense pattern that matches no weight is a typo: say so rather than prune what it meant."""
    names = list(weight_shapes(loaded.spec))
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise ValueError(f"keep_dense pattern {p!r} matches no weight of this model (names look like "
                             f"{', '.join(n for n in names if n.startswith('layers.0.'))})")


def _write_side_files(loaded: LoadedModel, folder: str, weights: str, plan, extra: Dict) -> None:
    counts: Dict[str, int] = {}
    for t, _, _ in plan.values():
        counts[WEIGHT_FORMATS[t].file_type] = counts.get(WEIGHT_FORMATS[t].file_type, 0) + 1
    config = {"format": "corelm", "format_version": FORMAT_VERSION, "weights": weights,
              "tensor_types": counts, **extra, "spec": spec_to_dict(loaded.spec),
              "source": {"path": loaded.source, "format": loaded.source_format, "description": loaded.description},
              "converted_by": f"corelm {corelm_version}"}
    _write_json(os.path.join(folder, CONFIG_FILE), config)
    _write_json(os.path.join(folder, "generation_config.json"), dict(loaded.generation_config))
    src = loaded.source
    if loaded.source_format in ("hf", "corelm"):
        for f in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, f)):
                shutil.copyfile(os.path.join(src, f), os.path.join(folder, f))
        return
    # GGUF: save the tokenizer corelm built from the metadata, and the settings HF keeps beside it.
    tok = loaded.tokenizer
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = {"add_bos_token": bool(tok.add_bos_token), "bos_token": tok.bos_token, "eos_token": tok.eos_token}
    named = dict(tok.named_chat_templates)
    if named:
        default = tok.chat_template or named.get("default")
        cfg["chat_template"] = ([{"name": "default", "template": default}] if default else []) + \
            [{"name": k, "template": v} for k, v in named.items() if k != "default"]
    elif tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    _write_json(os.path.join(folder, "tokenizer_config.json"), {k: v for k, v in cfg.items() if v is not None})


def _write_json(path: str, doc) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---------------------------------------------------------------------------------------------------
# The conversion cache behind `LLM(path, weights=...)`.

def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("CORELM_CACHE") or os.path.join("~", ".cache", "corelm"))


def _source_key(src: str, weights: str, draft: bool = False) -> str:
    src = os.path.abspath(os.path.expanduser(src))
    if os.path.isdir(src):
        stats = [(f, os.stat(os.path.join(src, f)).st_size, os.stat(os.path.join(src, f)).st_mtime_ns)
                 for f in sorted(os.listdir(src)) if os.path.isfile(os.path.join(src, f))]
    else:
        st = os.stat(src)
        stats = [(os.path.basename(src), st.st_size, st.st_mtime_ns)]
    doc = {"src": src, "files": stats, "weights": weights, "format": FORMAT_VERSION, "converter": CONVERTER_REVISION}
    if draft:
        doc["draft"] = True
    doc = json.dumps(doc)
    return hashlib.sha256(doc.encode()).hexdigest()[:20]


def cached_conversion(src: str, weights: str, progress: bool = True, draft: bool = False) -> str:
    """The corelm folder for `src` converted to `weights` (draft: as a speculative draft, see convert),
    converting it into cache_dir() the first time. The key is the source path, its files' sizes and mtimes,
    the weights kind, draft and the format version."""
    weights = choose("weights", weights)
    if is_corelm_folder(os.path.expanduser(src)):
        return src
    if not os.path.exists(os.path.expanduser(src)):      # a hub reference: its downloaded GGUF file or folder
        if looks_like_repo_id(src):
            src = download_from_hub(src)
    base = os.path.basename(os.path.normpath(src))
    base = os.path.splitext(base)[0] if base.lower().endswith(".gguf") else base
    out = os.path.join(cache_dir(), f"{base}-{weights}{'-draft' if draft else ''}-{_source_key(src, weights, draft)}")
    if not is_corelm_folder(out):
        try:
            convert(src, out, weights=weights, progress=progress, draft=draft)
        except FileExistsError:       # converted by a concurrent process: use theirs
            if not is_corelm_folder(out):
                raise
    return out


def folder_dtype(folder: str) -> str:
    """The engine dtype a corelm folder is meant for ("auto" for bf16: bf16 where the CPU has it; q8_0 for
    the K-quant kinds: it keeps every block type they store and quantizes an f32 matrix at 8 bits)."""
    weights = read_json(os.path.join(folder, CONFIG_FILE), CONFIG_FILE).get("weights")
    try:
        weights = choose("weights", weights)
    except ValueError:
        return "auto"
    if weights in K_QUANT_TARGETS:
        return "q8_0"
    return "auto" if weights == "bf16" else weights
