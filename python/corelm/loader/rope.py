"""RoPE frequencies from a ModelSpec, computed as transformers does: the engine hands them to the core
and calibration (calibrate.py) runs the same rotation. hf.py's ROPE_SCALING_TYPES are the scalings here."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .spec import ModelLoadError, ModelSpec


def rope_inv_freq(spec: ModelSpec, max_seq_len: Optional[int] = None, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies [rotated dims / 2] in float32, computed as transformers does, with its
    "linear", "llama3" and "longrope" scalings applied. local: the sliding layers' own (Gemma 3: their
    own base, no scaling). LongRoPE takes its long factors when the context the engine holds
    (max_seq_len) exceeds the pre-training one, as llama.cpp does."""
    dim = spec.rope_dim or spec.head_dim
    theta = spec.rope_local_theta if local else spec.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    base = np.power(np.float32(theta), exponents).astype(np.float32)
    inv_freq = (np.float32(1.0) / base).astype(np.float32)
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if local or kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "longrope":
        long = max_seq_len is not None and max_seq_len > scaling["original_max_position_embeddings"]
        ext = np.asarray(scaling["long_factor" if long else "short_factor"], np.float32)
        return (np.float32(1.0) / (ext * base)).astype(np.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
        smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ModelLoadError(f"RoPE scaling type {kind!r} is not supported yet (supported: default, linear, llama3, "
                         f"longrope)")


def rope_attention_factor(spec: ModelSpec) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor (given, or transformers' default
    from the context extension), 1 otherwise."""
    s = spec.rope_scaling or {}
    if s.get("rope_type") != "longrope":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or spec.max_position_embeddings / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
