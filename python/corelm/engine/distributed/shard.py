"""How a model is cut across ranks. Tensor parallelism (Shard, plan): rank r of N holds a slice of the kv heads (with their query
heads; where there are fewer kv heads than ranks, a copy of one and a slice of its queries), of the MLP's hidden rows (every expert's alike) and of the vocabulary's lm_head rows; everything
else (embeddings, norms, the router) whole. q/k/v, gate/up and lm_head are cut by rows, o_proj and down by
columns, so each attention and MLP output is a partial sum that one allreduce completes (Megatron's
column-then-row split, as xFasterTransformer and Neural Speed do it). The C++ core runs a shard as a
smaller model of the same family (`set_allreduce`, `lm_head_rows`); this module only decides the cuts and
slices the weights, as floats or in their stored blocks. Pipeline parallelism (Stage, pipeline_plan): rank r
holds consecutive layers, and every rank the embeddings, final norm and lm_head (a stage's hidden states come
from the one before it; only the last computes logits), so its output is one process's, bit for bit.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...options import format_of_raw

_LAYER = re.compile(r"^layers\.\d+\.(?:experts\.\d+\.)?(.+)$")
# the cut of the MLP's hidden size: activations are quantized per block of 32 along it, and K-quant
# blocks hold 256 of it; a cut on these keeps every block whole
_FFN_ALIGN = (256, 32)


def _split(n: int, parts: int, unit: int = 1) -> List[Tuple[int, int]]:
    """[start, end) of each part: n cut into `parts` runs of whole units, as even as can be (the first
    ones get the extra unit; a remainder smaller than a unit goes to the last)."""
    units, rest = divmod(n, unit)
    out, start = [], 0
    for r in range(parts):
        size = (units // parts + (r < units % parts)) * unit + (rest if r == parts - 1 else 0)
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: the slices it holds."""
    rank: int
    size: int
    heads: Tuple[int, int]       # query heads [start, end)
    kv_heads: Tuple[int, int]    # kv heads [start, end)
    ffn: Tuple[int, int]         # MLP hidden rows [start, end) (each expert's too)
    vocab: Tuple[int, int]       # lm_head rows [start, end)
    head_dim: int
    tied: bool                   # the model ties lm_head to the embeddings: lm_head is cut from those
    qk_norm_whole: bool          # q/k norms span all heads (OLMoE): cut with the heads

    def config_changes(self, config) -> Dict[str, Any]:
        """The fields of core_config's ModelConfig that differ for this shard."""
        return dict(n_heads=self.heads[1] - self.heads[0], n_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                    ffn_dim=self.ffn[1] - self.ffn[0], lm_head_rows=self.vocab[1] - self.vocab[0],
                    tie_embeddings=False)

    def weight_names(self, names) -> List[str]:
        """The core's weight names for this shard: the model's, plus lm_head where the model ties it."""
        names = list(names)
        return names + ["lm_head"] if self.tied and "lm_head" not in names else names

    def source(self, name: str) -> str:
        """The model's weight that `name` is cut from."""
        return "tok_embeddings" if name == "lm_head" and self.tied else name

    def cut(self, name: str) -> Optional[Tuple[int, int, int]]:
        """(axis, start, end) of this shard's slice of weight `name` (axis 0: rows, 1: columns), or None
        for a weight every rank holds whole."""
        hd = self.head_dim
        q = (self.heads[0] * hd, self.heads[1] * hd)
        kv = (self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        if name == "lm_head":
            return (0,) + self.vocab
        m = _LAYER.match(name)
        part = m.group(1) if m else ""
        if part in ("wq", "bq"):
            return (0,) + q
        if part in ("wk", "wv", "bk", "bv"):
            return (0,) + kv
        if part == "wo":
            return (1,) + q
        if part in ("w_gate", "w_up"):
            return (0,) + self.ffn
        if part == "w_down":
            return (1,) + self.ffn
        if part in ("q_norm", "k_norm") and self.qk_norm_whole:
            return (0,) + (q if part == "q_norm" else kv)
        return None

    def slice_floats(self, name: str, a: np.ndarray) -> np.ndarray:
        c = self.cut(name)
        if c is None:
            return a
        axis, start, end = c
        return np.ascontiguousarray(a[start:end] if axis == 0 else a[:, start:end])

    def slice_raw(self, name: str, raw) -> Optional[Tuple[str, np.ndarray, Tuple[int, ...]]]:
        """(type, bytes [rows, row bytes], shape) of this shard's slice of a matrix kept in its stored
        blocks, or None where a column cut would split a block (the caller slices its floats instead)."""
        c = self.cut(name)
        if c is None:
            return raw
        kind, data, shape = raw
        rows, cols = int(shape[0]), int(shape[-1])
        data = np.asarray(data).reshape(rows, -1)
        axis, start, end = c
        if axis == 0:
            return kind, np.ascontiguousarray(data[start:end]), (end - start, cols)
        fmt = format_of_raw(kind)
        if fmt is None or start % fmt.block or (end - start) % fmt.block:
            return None
        b0, b1 = start // fmt.block * fmt.block_bytes, end // fmt.block * fmt.block_bytes
        return kind, np.ascontiguousarray(data[:, b0:b1]), (rows, end - start)


def spec_whole_qk_norm(spec) -> bool:
    return bool(getattr(spec, "qk_norm_whole", False))


def plan(spec, size: int) -> List[Shard]:
    """The shards of `spec` over `size` ranks; ValueError where the model cannot be cut so."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}.")
    nh, nkv, f, vocab = int(spec.num_heads), int(spec.num_kv_heads), int(spec.intermediate_size), int(spec.vocab_size)
    group = nh // nkv
    if nkv >= size:      # whole kv heads each, with their query heads
        kv_cuts = _split(nkv, size)
        head_cuts = [(a * group, b * group) for a, b in kv_cuts]
    elif size % nkv == 0 and group >= size // nkv:   # each kv head copied on size / nkv ranks, its queries cut
        per = size // nkv
        kv_cuts = [(r // per, r // per + 1) for r in range(size)]
        head_cuts = [(kv * group + a, kv * group + b) for r in range(size)
                     for kv, (a, b) in [(r // per, _split(group, per)[r % per])]]
    else:
        raise ValueError(f"tensor_parallel_size={size} does not fit the model's {nkv} kv heads and {nh} query heads: "
                         f"use a size that divides the {nkv} kv heads, or a multiple of {nkv} up to {nh}.")
    if spec_whole_qk_norm(spec) and nkv < size:
        raise ValueError(f"tensor_parallel_size={size} exceeds the model's {nkv} kv heads, which its q/k norms over "
                         f"all heads cannot share across ranks.")
    unit = next((a for a in _FFN_ALIGN if f // a >= size), 1)
    ffn_cuts, vocab_cuts = _split(f, size, unit), _split(vocab, size)
    return [Shard(rank=r, size=size, heads=head_cuts[r], kv_heads=kv_cuts[r],
                  ffn=ffn_cuts[r], vocab=vocab_cuts[r], head_dim=int(spec.head_dim),
                  tied=bool(spec.tie_word_embeddings), qk_norm_whole=spec_whole_qk_norm(spec))
            for r in range(size)]



_LAYER_INDEX = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Stage:
    """Pipeline stage `rank` of `size`: layers [start, end) of the model, numbered from 0 in its core."""
    rank: int
    size: int
    layers: Tuple[int, int]
    tied = False   # every stage holds the embeddings, so a tied lm_head stays tied

    def config_changes(self, config) -> Dict[str, Any]:
        a, b = self.layers
        sliding = list(config.sliding_layers)
        return dict(n_layers=b - a, sliding_layers=list(sliding[a:b]) if sliding else [])

    def weight_names(self, names) -> List[str]:
        out = []
        for name in names:
            m = _LAYER_INDEX.match(name)
            if m is None:
                out.append(name)
            elif self.layers[0] <= int(m.group(1)) < self.layers[1]:
                out.append(f"layers.{int(m.group(1)) - self.layers[0]}.{m.group(2)}")
        return out

    def source(self, name: str) -> str:
        m = _LAYER_INDEX.match(name)
        return name if m is None else f"layers.{int(m.group(1)) + self.layers[0]}.{m.group(2)}"

    def slice_floats(self, name: str, a: np.ndarray) -> np.ndarray:
        return a

    def slice_raw(self, name: str, raw):
        return raw


def pipeline_plan(spec, size: int) -> List[Stage]:
    """The stages of `spec` over `size` ranks, consecutive layers each, as even as can be."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {size!r}.")
    layers = int(spec.num_layers)
    if size > layers:
        raise ValueError(f"pipeline_parallel_size={size} exceeds the model's {layers} layers.")
    return [Stage(rank=r, size=size, layers=cut) for r, cut in enumerate(_split(layers, size))]
