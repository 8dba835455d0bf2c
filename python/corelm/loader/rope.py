"""RoPE frequencies from a ModelSpec, computed as transformers does: the engine hands them to the core.
hf.py's ROPE_SCALING_TYPES are the scalings here."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .spec import ModelLoadError, ModelSpec


def rope_inv_freq(spec: ModelSpec, max_seq_len: Optional[int] = None, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies [rotated dims / 2] in float32, computed as transformers does, with its
    "linear", "llama3", "longrope" and "yarn" scalings applied. local: the sliding layers' own (Gemma 3: their
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
    if kind == "yarn":   # interpolated low frequencies, extrapolated high ones, a linear ramp between
        factor = float(scaling["factor"])
        orig = float(scaling.get("original_max_position_embeddings") or spec.max_position_embeddings)
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = correction_dim(fast), correction_dim(slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) /
                       np.float32(high - low if high != low else 0.001), 0, 1).astype(np.float32)
        extrapolated = (np.float32(1) - ramp).astype(np.float32)
        interpolated = (np.float32(1.0) / (np.float32(factor) * base)).astype(np.float32)
        return (interpolated * (1 - extrapolated) + inv_freq * extrapolated).astype(np.float32)
    raise ModelLoadError(f"RoPE scaling type {kind!r} is not supported yet (supported: default, linear, llama3, "
                         f"longrope, yarn)")


def rope_attention_factor(spec: ModelSpec) -> float:
    """What cos and sin are multiplied by: LongRoPE's and YaRN's attention factor (given, or transformers'
    default from the context extension), 1 otherwise."""
    s = spec.rope_scaling or {}
    if s.get("rope_type") == "yarn":
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        factor = float(s["factor"])
        if s.get("mscale") and s.get("mscale_all_dim"):
            return float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
        return mscale(factor)
    if s.get("rope_type") != "longrope":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or spec.max_position_embeddings / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
