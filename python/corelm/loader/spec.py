"""What every loader produces: the model's hyper-parameters and its weights by internal name."""
from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ..errors import ModelLoadError  # noqa: F401  (re-exported: the loaders' error, also the tokenizer's)
from ..options import core_formats
from .families import SUPPORTED_ARCHS  # noqa: F401  (re-exported)


@dataclass
class ModelSpec:
    arch: str                       # a family of loader/families.py: "llama", "qwen3", "gemma3", ...
    vocab_size: int
    hidden_size: int                # dim
    intermediate_size: int          # ffn
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]] = None  # HF dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False    # q/k/v biases (Qwen2)
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: List[int] = field(default_factory=list)
    # The family's features (loader/families.py); the defaults are the Llama family's.
    activation: str = "silu"        # MLP gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False           # layers.i.q_norm / k_norm [head_dim] on each head before RoPE
    post_norms: bool = False        # layers.i.post_attn_norm / post_ffn_norm on the outputs
    embed_scale: float = 1.0        # embeddings multiplied by it
    query_pre_attn_scalar: Optional[float] = None  # query scale is its ** -0.5 (None: head_dim ** -0.5)
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    sliding_layers: Optional[List[bool]] = None    # which layers use sliding_window (None: all of them)
    rope_local_theta: Optional[float] = None       # the sliding layers' RoPE base (None: rope_theta)
    rope_dim: Optional[int] = None  # dims of each head RoPE rotates (None: head_dim)
    qk_norm_whole: bool = False     # layers.i.q_norm [num_heads*head_dim] / k_norm [num_kv_heads*head_dim]
                                    # over the whole q and k projections before RoPE (OLMoE)
    # Mixture of experts (0: one dense MLP per layer). Each layer's router [num_experts, hidden] scores the
    # experts; a softmax over all of them, the num_experts_used most probable, their probabilities
    # renormalised to sum to 1 when moe_norm_topk, weight the chosen experts' MLPs (intermediate_size each).
    num_experts: int = 0
    num_experts_used: int = 0
    moe_norm_topk: bool = False
    # An encoder (BERT; Family.encoder): pos_embeddings [max_position_embeddings, hidden], type_embeddings
    # [type_vocab_size, hidden] (type 0 added to every token), LayerNorm (eps: rms_norm_eps) after each
    # residual add, a gateless MLP, biases everywhere; no lm_head and no final norm.
    encoder: bool = False
    type_vocab_size: int = 0
    # How embeddings pool the hidden states ("mean", "cls" or "last") and whether they are scaled to unit
    # length, as the model was trained for (sentence-transformers' modules, a GGUF's pooling_type); None:
    # the model does not say (a decoder: last-token pooling, normalized, unless a request says otherwise).
    pooling: Optional[str] = None
    normalize: bool = True


def layer_weight_names(spec: ModelSpec, i: int) -> List[str]:
    return list(_layer_shapes(spec, i))


def weight_shapes(spec: ModelSpec) -> Dict[str, tuple]:
    """The expected shape of every internal weight; loaders check against it."""
    d = spec.hidden_size
    if spec.encoder:
        shapes = {"tok_embeddings": (spec.vocab_size, d), "pos_embeddings": (spec.max_position_embeddings, d),
                  "embed_norm": (d,), "embed_norm_bias": (d,)}
        if spec.type_vocab_size:
            shapes["type_embeddings"] = (spec.type_vocab_size, d)
    else:
        shapes = {"tok_embeddings": (spec.vocab_size, d), "norm": (d,)}
    if not spec.tie_word_embeddings and not spec.encoder:
        shapes["lm_head"] = (spec.vocab_size, d)
    for i in range(spec.num_layers):
        shapes.update(_layer_shapes(spec, i))
    return shapes


def _layer_shapes(spec: ModelSpec, i: int) -> Dict[str, tuple]:
    d, f, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    p = f"layers.{i}."
    shapes = {p + "attn_norm": (d,), p + "wq": (q, d), p + "wk": (kv, d), p + "wv": (kv, d), p + "wo": (d, q),
              p + "ffn_norm": (d,)}
    mlp = {"w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
    if spec.encoder:   # a gateless MLP, LayerNorms and biases
        del mlp["w_gate"]
        shapes.update({p + "attn_norm_bias": (d,), p + "ffn_norm_bias": (d,), p + "bo": (d,), p + "b_up": (f,),
                       p + "b_down": (d,)})
    if spec.num_experts:
        shapes[p + "router"] = (spec.num_experts, d)
        for e in range(spec.num_experts):
            shapes.update({f"{p}experts.{e}.{k}": v for k, v in mlp.items()})
    else:
        shapes.update({p + k: v for k, v in mlp.items()})
    if spec.attention_bias:
        shapes.update({p + "bq": (q,), p + "bk": (kv,), p + "bv": (kv,)})
    if spec.qk_norm:
        shapes.update({p + "q_norm": (hd,), p + "k_norm": (hd,)})
    if spec.qk_norm_whole:
        shapes.update({p + "q_norm": (q,), p + "k_norm": (kv,)})
    if spec.post_norms:
        shapes.update({p + "post_attn_norm": (d,), p + "post_ffn_norm": (d,)})
    return shapes


# Matrices the engine keeps in fp32 whatever the dtype: the MoE router (its logits choose the experts), an
# encoder's position and token-type rows (added, not multiplied).
FLOAT_MATRICES = ("router", "pos_embeddings", "type_embeddings")


def kept_float(name: str) -> bool:
    """Whether internal weight `name` stays fp32 in the engine and in converted folders."""
    return name.rsplit(".", 1)[-1] in FLOAT_MATRICES


@dataclass
class LoadedModel:
    """A model ready to hand to the engine. `get_weight(name)` returns a C-contiguous float32 array of
    `weight_shapes(spec)[name]`, materialised on demand so peak memory stays near one tensor."""
    spec: ModelSpec
    get_weight: Callable[[str], np.ndarray]
    tokenizer: Any                  # corelm.tokenizer.Tokenizer (a Future of one while it is built: see below)
    chat_template: Optional[str] = None
    generation_config: Dict[str, Any] = field(default_factory=dict)
    source: str = ""                # path of the folder or file
    source_format: str = ""         # "hf" | "gguf"
    description: str = ""           # e.g. "GGUF Q4_1 (+Q8_0, F32)"

    # Called after a weight has been copied into the engine: drops the file pages it occupied from this
    # process, so peak memory is the packed model, not the packed model plus the mapped file.
    release_weight: Callable[[str], None] = lambda name: None
    # Called once the engine holds every weight and the tokenizer: drops every file page still mapped (a
    # GGUF's tokenizer metadata, the partial pages at tensor edges: 11 MiB of a Qwen2.5-0.5B file).
    release_all: Callable[[], None] = lambda: None

    # Optional (GGUF, corelm and HF folders): (the type name Model.set_weight_raw takes, uint8 bytes [rows,
    # row bytes], shape) of a matrix stored as quantized blocks (Q8_0, Q4_0, Q4_1, ...: rows already in
    # get_weight's order), as bf16 rows ("BF16") or sparse ("SBF16": its dense bf16 rows); None otherwise.
    get_raw_weight: Optional[Callable[[str], Optional[Tuple[str, np.ndarray, Tuple[int, ...]]]]] = None
    # Optional, with get_raw_weight: the type name get_raw_weight(name) would give (None where it gives
    # None), from the file's header alone: deciding how to store a model reads none of its weights.
    raw_weight_type: Optional[Callable[[str], Optional[str]]] = None
    # corelm folders: name -> (file type, shape, bytes) of every tensor as stored (`corelm info`)
    stored_tensors: Optional[Dict[str, Tuple[str, Tuple[int, ...], int]]] = None

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if name == "tokenizer" and isinstance(value, concurrent.futures.Future):   # built on a thread
            value = value.result()
            object.__setattr__(self, name, value)
        return value

    def weight_names(self) -> Iterable[str]:
        return weight_shapes(self.spec).keys()


def stored_raw_type(loaded: LoadedModel, name: str) -> Optional[str]:
    """The type name loaded.get_raw_weight(name) gives (None: no raw form), from the file's header where the
    loader can say (raw_weight_type), so deciding how to store a matrix reads none of it."""
    raw_type, get_raw = getattr(loaded, "raw_weight_type", None), getattr(loaded, "get_raw_weight", None)
    if raw_type is not None:
        return raw_type(name)
    return (get_raw(name) or (None,))[0] if get_raw is not None else None   # a loader without it: its getter's


def row_range(shape: Tuple[int, ...], nbytes: int, r0: int = 0, r1: int = -1) -> Tuple[int, int, Tuple[int, ...]]:
    """(byte offset, byte count, shape) of rows [r0, r1) of a tensor of `nbytes` seen as a matrix [product of
    the leading dimensions, last dimension]: a fused tensor's part, or an expert's part of a stacked 3D
    tensor. r1 < 0: the whole tensor, as it is."""
    if r1 < 0:
        return 0, nbytes, tuple(shape)
    rows = math.prod(shape[:-1])
    row_bytes = nbytes // rows if rows else 0
    return r0 * row_bytes, (r1 - r0) * row_bytes, (r1 - r0, shape[-1])


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bf16 bytes (little-endian) as float32: bf16 is the top half of an fp32, so widen and shift in
    place (one new array, not two: each fresh array's pages are zeroed by the kernel on first touch,
    which for a 0.5B model's weights was a good share of the load)."""
    out = raw.view("<u2").astype(np.uint32)
    np.left_shift(out, 16, out=out)
    return out.view(np.float32)


def release_mapped_range(buf, offset: int, length: int) -> None:
    """Tells the kernel this process no longer needs [offset, offset+length) of a read-only file
    mapping. Safe on any range: the pages come back from the page cache if read again."""
    import mmap
    if not isinstance(buf, mmap.mmap) or length <= 0 or not hasattr(buf, "madvise"):
        return
    start = offset - offset % mmap.PAGESIZE
    end = min(len(buf), offset + length)
    try:
        buf.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):
        pass


# ---------------------------------------------------------------------------------------------------
# Non-finite weights: a NaN or Inf anywhere makes every logit NaN. Checked as each weight is handed over,
# cheaply (a float32 sum, a few % of the conversion; an exact check only when the sum is not finite).

_log = None


def _warn(source: str, name: str, what: str) -> None:
    global _log
    if _log is None:
        import logging
        _log = logging.getLogger("corelm.loader")
    _log.warning("%s: weight %s has %s; the model will compute NaN (the file is damaged or was converted "
                 "wrongly)", source, name, what)


def _warn_nonfinite(source: str, name: str, bad: int, what: str = "value") -> None:
    if bad:
        _warn(source, name, f"{bad} non-finite {what}{'s' if bad > 1 else ''} (NaN or Inf)")


def check_finite(w: np.ndarray, source: str, name: str) -> np.ndarray:
    """Warns (logger corelm.loader) when float array `w` holds NaN or Inf; returns `w`."""
    if w.size and w.dtype.kind == "f" and not np.isfinite(np.add.reduce(w.reshape(-1), dtype=w.dtype)):
        _warn_nonfinite(source, name, int(w.size - np.count_nonzero(np.isfinite(w))))
    return w


def check_finite_blocks(type_name: str, raw: np.ndarray, source: str, name: str) -> None:
    """Warns when a quantized tensor's fp16 block scales (or minimums), or bf16 rows (dense or a sparse
    tensor's), hold NaN or Inf."""
    from .. import _core
    if type_name in ("BF16", "SBF16"):    # bf16 rows: every 16-bit value
        _warn_nonfinite(source, name, _core.count_nonfinite(raw.reshape(-1).view(np.uint8), 2, [0], bf16=True))
        return
    # the block's bytes and its fp16 fields (scale d, and a minimum where it has one): the core's traits row for
    # this raw type (sparse q8_0 / q4_0 as their dense blocks)
    row = next((r for r in core_formats().values() if r["raw"] == type_name and r["f16_fields"]), None)
    if row is None or raw.size == 0 or raw.size % row["block_bytes"]:
        return
    _warn_nonfinite(source, name, _core.count_nonfinite(raw.reshape(-1).view(np.uint8), row["block_bytes"],
                                                        row["f16_fields"]),
                    f"{type_name} block scale")
