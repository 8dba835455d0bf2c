"""Activation statistics for importance-weighted quantization (`corelm convert --weights q4`).

A plain numpy fp32 forward pass of the model over calibration tokens records, for every layer matrix,
the mean square of each input column: an error in weight column k costs about E[x_k^2] in the output's
squared error, so the q4 quantizer spends its precision where activations are large (llama.cpp calls
these statistics an importance matrix). Only the hidden states are computed, never the logits.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Sequence

import numpy as np

from .loader.rope import rope_attention_factor, rope_inv_freq
from .loader.spec import LoadedModel

# Mixed English prose, dialogue, code, SQL/JSON, a recipe and a few other languages (written for corelm,
# ~1,300 tokens): what the statistics are taken on. Not the text docs/quality.md evaluates on.
CALIBRATION_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "calibration.txt")


def calibration_ids(loaded: LoadedModel) -> List[int]:
    with open(CALIBRATION_TEXT, encoding="utf-8") as f:
        return list(loaded.tokenizer.encode(f.read(), add_special_tokens=True))


def _rmsnorm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)) * g


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [heads, T, head_dim], rotate-half RoPE (as transformers' Llama/Qwen2) over the first
    2 * cos.shape[-1] dims (all of them unless the rotation is partial)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def hidden_states(loaded: LoadedModel, chunks: Sequence[Sequence[int]], record: Callable[[str, np.ndarray], None],
                  progress: bool = False) -> List[np.ndarray]:
    """fp32 forward pass of each chunk of token ids (each from position 0) through every layer, one layer's
    weights at a time; record(matrix name, its input [T, cols]) is called for every layer matrix (once for
    q/k/v and once for gate/up, which share an input: under the names "wq" and "w_gate"; an expert's with
    the tokens routed to it, never for an expert no token chose). Returns the final hidden states (before
    the last norm) of each chunk."""
    spec = loaded.spec
    get = loaded.get_weight
    nh, nkv, hd, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, float(spec.rms_norm_eps)
    longest = max((len(c) for c in chunks), default=1)
    inv_freq = {False: rope_inv_freq(spec, longest), True: rope_inv_freq(spec, longest, local=bool(spec.rope_local_theta))}
    rope_factor = np.float32(rope_attention_factor(spec))
    scale = np.float32(spec.query_pre_attn_scalar ** -0.5 if spec.query_pre_attn_scalar else 1 / np.sqrt(hd))
    emb = get("tok_embeddings")
    hidden = [emb[np.asarray(c, np.int64)].astype(np.float32) * np.float32(spec.embed_scale) for c in chunks]
    del emb
    loaded.release_weight("tok_embeddings")
    layers = range(spec.num_layers)
    if progress:
        from tqdm import tqdm
        layers = tqdm(layers, desc="calibrating", unit="layer")
    for i in layers:
        p = f"layers.{i}."
        w = {k: get(p + k) for k in ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm")}
        if spec.attention_bias:
            w.update({k: get(p + k) for k in ("bq", "bk", "bv")})
        if spec.qk_norm or spec.qk_norm_whole:
            w.update({k: get(p + k) for k in ("q_norm", "k_norm")})
        if spec.post_norms:
            w.update({k: get(p + k) for k in ("post_attn_norm", "post_ffn_norm")})
        sliding = spec.sliding_layers is None or spec.sliding_layers[i]
        window = spec.sliding_window if sliding else None
        for c, x in enumerate(hidden):
            T = len(x)
            angle = np.arange(T, dtype=np.float32)[:, None] * inv_freq[sliding][None, :]
            cos, sin = np.cos(angle).astype(np.float32) * rope_factor, np.sin(angle).astype(np.float32) * rope_factor
            h = _rmsnorm(x, w["attn_norm"], eps)
            record(p + "wq", h)
            q, k, v = h @ w["wq"].T, h @ w["wk"].T, h @ w["wv"].T
            if spec.attention_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
            if spec.qk_norm_whole:
                q, k = _rmsnorm(q, w["q_norm"], eps), _rmsnorm(k, w["k_norm"], eps)
            q, k = q.reshape(T, nh, hd), k.reshape(T, nkv, hd)
            if spec.qk_norm:
                q, k = _rmsnorm(q, w["q_norm"], eps), _rmsnorm(k, w["k_norm"], eps)
            q = _rope(q.transpose(1, 0, 2), cos, sin)
            k = _rope(k.transpose(1, 0, 2), cos, sin)
            v = v.reshape(T, nkv, hd).transpose(1, 0, 2)
            k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
            s = q @ k.transpose(0, 2, 1) * scale
            if spec.attn_logit_softcap:
                cap = np.float32(spec.attn_logit_softcap)
                s = np.tanh(s / cap) * cap
            if window and window < T:
                s = s + np.tril(np.full((T, T), -np.inf, np.float32), -window)
            s = s + np.triu(np.full((T, T), -np.inf, np.float32), 1)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(T, nh * hd)
            record(p + "wo", a)
            o = a @ w["wo"].T
            hidden[c] = x + (_rmsnorm(o, w["post_attn_norm"], eps) if spec.post_norms else o)
        # the MLP works token by token: all chunks' tokens at once, so each expert's weights are read once
        x = np.concatenate(hidden)
        h = _rmsnorm(x, w["ffn_norm"], eps)
        o = _moe(loaded, spec, p, h, record) if spec.num_experts else _mlp(loaded, spec, p, h, record)
        x = x + (_rmsnorm(o, w["post_ffn_norm"], eps) if spec.post_norms else o)
        hidden = np.split(x, np.cumsum([len(c) for c in hidden])[:-1])
        for k in w:
            loaded.release_weight(p + k)
    return hidden


def _mlp(loaded: LoadedModel, spec, p: str, h: np.ndarray, record: Callable[[str, np.ndarray], None]) -> np.ndarray:
    """The gated MLP whose weights are p + w_gate, w_up and w_down (a layer's, or one expert's) on rows h."""
    record(p + "w_gate", h)
    g, u = h @ loaded.get_weight(p + "w_gate").T, h @ loaded.get_weight(p + "w_up").T
    if spec.activation == "gelu_tanh":
        f = np.float32(0.5) * g * (1 + np.tanh(np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g ** 3))) * u
    else:
        f = g / (1 + np.exp(-g)) * u
    record(p + "w_down", f)
    out = f @ loaded.get_weight(p + "w_down").T
    for k in ("w_gate", "w_up", "w_down"):
        loaded.release_weight(p + k)
    return out


def _moe(loaded: LoadedModel, spec, p: str, h: np.ndarray, record: Callable[[str, np.ndarray], None]) -> np.ndarray:
    """A mixture-of-experts MLP: the router's softmax over every expert (fp32), each token's
    num_experts_used most probable (renormalised to sum to 1 with moe_norm_topk), their MLPs' outputs
    weighted by those probabilities."""
    logits = h @ loaded.get_weight(p + "router").T
    loaded.release_weight(p + "router")
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :spec.num_experts_used]
    weights = np.take_along_axis(probs, top, -1)
    if spec.moe_norm_topk:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for e in range(spec.num_experts):
        rows, slot = np.nonzero(top == e)
        if len(rows):
            out[rows] += _mlp(loaded, spec, f"{p}experts.{e}.", h[rows], record) * weights[rows, slot][:, None]
    return out


def activation_importance(loaded: LoadedModel, ids: Sequence[int], chunk: int = 512,
                          progress: bool = False) -> Dict[str, np.ndarray]:
    """{"layers.i.wq": mean x^2 per input column (float32 [cols]), ...} for every layer matrix and "lm_head"
    (also when the embedding is tied to it), over `ids`
    run as independent chunks of `chunk` tokens (an expert's: over the tokens routed to it; an expert no
    token chose has none, and is quantized without weights)."""
    sums: Dict[str, np.ndarray] = {}
    rows: Dict[str, int] = {}

    def record(name: str, x: np.ndarray) -> None:
        sums[name] = sums.get(name, 0.0) + (x.astype(np.float64) ** 2).sum(0)
        rows[name] = rows.get(name, 0) + len(x)

    final = hidden_states(loaded, [ids[i:i + chunk] for i in range(0, len(ids), chunk)], record, progress)
    # lm_head multiplies the final hidden states after the last norm (the K-quants quantize it too)
    record("lm_head", _rmsnorm(np.concatenate(final), loaded.get_weight("norm"), float(loaded.spec.rms_norm_eps)))
    loaded.release_weight("norm")
    out = {name: (s / rows[name]).astype(np.float32) for name, s in sums.items()}
    for name in list(out):      # q/k/v and gate/up multiply the same input
        if name.endswith(".wq"):
            out[name[:-2] + "wk"] = out[name[:-2] + "wv"] = out[name]
        elif name.endswith(".w_gate"):
            out[name[:-6] + "w_up"] = out[name]
    return out
