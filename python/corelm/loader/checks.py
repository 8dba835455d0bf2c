"""What every loader shares: the checks that hold an HF folder, a GGUF file and a corelm folder to the same
rules (`validate_spec`, `check_weight_shapes`, `check_experts`), small JSON side files, the tokenizer, and
where an internal weight lives in a checkpoint (a tensor or its rows)."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .families import family
from .spec import ModelLoadError, ModelSpec, weight_shapes

MAX_JSON_BYTES = 64 * 1024 * 1024

# Caps on hyper-parameters: real models are far below them, and they stop a hostile config from making
# us build absurd shape tables (num_hidden_layers = 10^12) before any weight is looked at.
_CAPS = {"vocab_size": 1 << 23, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_layers": 4096,
         "num_heads": 4096, "num_kv_heads": 4096, "head_dim": 4096}
MAX_EXPERTS = 1 << 12   # DeepSeek-V3 and Qwen3-235B route among 256 and 128
MIN_CONTEXT = 2         # the smallest context that runs anything: one prompt token and one generated


def validate_spec(spec: ModelSpec, source: str,
                  expert_keys: Tuple[str, str] = ("num_experts", "num_experts_used")) -> ModelSpec:
    """Reject hyper-parameters that are missing, absurd or inconsistent, naming the offending field
    (expert_keys: what the file calls num_experts and num_experts_used)."""
    for field, cap in _CAPS.items():
        v = getattr(spec, field)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= cap:
            raise ModelLoadError(f"{source}: {field} = {v!r} is not a positive integer up to {cap}")
    if spec.num_heads % spec.num_kv_heads:
        raise ModelLoadError(f"{source}: {spec.num_heads} attention heads are not a multiple of "
                             f"{spec.num_kv_heads} key/value heads")
    if spec.head_dim % 2:
        raise ModelLoadError(f"{source}: head_dim {spec.head_dim} is odd; RoPE needs an even head size")
    for field in ("rms_norm_eps", "rope_theta"):
        v = getattr(spec, field)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):
            raise ModelLoadError(f"{source}: {field} = {v!r} must be a positive number")
    if not pos_int(spec.max_position_embeddings) or spec.max_position_embeddings > 1 << 31:
        raise ModelLoadError(f"{source}: max_position_embeddings = {spec.max_position_embeddings!r} "
                             f"is not a positive integer")
    if spec.max_position_embeddings < MIN_CONTEXT:     # every prompt would then be refused
        raise ModelLoadError(f"{source}: the model's context (max_position_embeddings, or a GGUF's context_length) "
                             f"is {spec.max_position_embeddings} tokens; it must hold at least {MIN_CONTEXT}: a "
                             f"prompt token and a generated one")
    if spec.sliding_window is not None and not pos_int(spec.sliding_window):
        raise ModelLoadError(f"{source}: sliding_window = {spec.sliding_window!r} is not a positive integer")
    # The engine computes in float32: a value that is not a finite float32 there is as bad as NaN.
    if spec.rms_norm_eps > _MAX_RMS_NORM_EPS:
        raise ModelLoadError(f"{source}: rms_norm_eps = {spec.rms_norm_eps!r} is absurd (expected a small "
                             f"positive number such as 1e-5 or 1e-6, at most {_MAX_RMS_NORM_EPS})")
    if not (0 < spec.rms_norm_eps and np.float32(spec.rms_norm_eps) > 0):
        raise ModelLoadError(f"{source}: rms_norm_eps = {spec.rms_norm_eps!r} underflows to 0 in float32")
    if not np.isfinite(np.float32(spec.rope_theta)) or spec.rope_theta <= 1:
        raise ModelLoadError(f"{source}: rope_theta = {spec.rope_theta!r} must be a number above 1 that "
                             f"fits in float32 (typically 10000 to 1000000)")
    spec.rope_scaling = validate_rope_scaling(spec.rope_scaling, spec, source)
    spec.rms_norm_eps, spec.rope_theta = float(spec.rms_norm_eps), float(spec.rope_theta)
    _validate_features(spec, source)
    _validate_experts(spec, source, *expert_keys)
    for tid in ([spec.bos_token_id] if spec.bos_token_id is not None else []) + list(spec.eos_token_ids):
        if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < spec.vocab_size:
            raise ModelLoadError(f"{source}: special token id {tid!r} is outside the vocabulary "
                                 f"(size {spec.vocab_size})")
    return spec


_MAX_RMS_NORM_EPS = 0.1
ROPE_SCALING_TYPES = ("linear", "llama3", "longrope", "yarn")  # what rope.py computes


def _validate_features(spec: ModelSpec, source: str) -> None:
    """The family-feature fields of a spec (whichever loader filled them), named when wrong."""
    if spec.activation not in ("silu", "gelu_tanh", "gelu") or (spec.activation == "gelu") != bool(spec.encoder):
        raise ModelLoadError(f"{source}: activation {spec.activation!r} must be 'silu' or 'gelu_tanh' (a decoder's "
                             f"gate) or 'gelu' (an encoder's)")
    if spec.pooling not in (None, "mean", "cls", "last"):
        raise ModelLoadError(f"{source}: pooling {short(spec.pooling)} must be 'mean', 'cls' or 'last'")
    if spec.encoder and (not pos_int(spec.type_vocab_size) or spec.type_vocab_size > 1024):
        raise ModelLoadError(f"{source}: type_vocab_size = {short(spec.type_vocab_size)} is not a positive integer "
                             f"up to 1024")
    for name in ("embed_scale", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                 "rope_local_theta"):
        v = getattr(spec, name)
        if v is None and name != "embed_scale":
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0 or \
                not np.isfinite(np.float32(v)) or not np.float32(v) > 0:
            raise ModelLoadError(f"{source}: {name} = {short(v)} must be a positive finite number")
        setattr(spec, name, float(v))
    if spec.rope_dim is not None and (not pos_int(spec.rope_dim) or spec.rope_dim % 2 or
                                      spec.rope_dim > spec.head_dim):
        raise ModelLoadError(f"{source}: rope_dim = {short(spec.rope_dim)} must be an even number of dims up "
                             f"to head_dim {spec.head_dim}")
    if spec.sliding_layers is not None:
        if not isinstance(spec.sliding_layers, list) or len(spec.sliding_layers) != spec.num_layers or \
                not all(isinstance(b, bool) for b in spec.sliding_layers):
            raise ModelLoadError(f"{source}: the sliding-window layer pattern must give true/false for each of "
                                 f"the {spec.num_layers} layers, not {short(spec.sliding_layers)}")


def _validate_experts(spec: ModelSpec, source: str, experts_key: str, used_key: str) -> None:
    n, k = spec.num_experts, spec.num_experts_used
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_EXPERTS:
        raise ModelLoadError(f"{source}: {experts_key} = {short(n)} is not a number of experts from 0 to "
                             f"{MAX_EXPERTS}")
    if family(spec.arch).moe and not n:
        raise ModelLoadError(f"{source}: {experts_key} = 0, but every {spec.arch} layer routes to experts")
    if not isinstance(k, int) or isinstance(k, bool) or not (1 <= k <= n if n else k == 0):
        want = f"between 1 and {experts_key} = {n}" if n else "0 for a model without experts"
        raise ModelLoadError(f"{source}: {used_key} = {short(k)} (the experts each token is routed to) must be "
                             f"{want}")
    if not isinstance(spec.moe_norm_topk, bool):
        raise ModelLoadError(f"{source}: moe_norm_topk (norm_topk_prob, expert_weights_norm) = "
                             f"{short(spec.moe_norm_topk)} must be true or false")
    if spec.qk_norm and spec.qk_norm_whole:
        raise ModelLoadError(f"{source}: qk_norm (per head) and qk_norm_whole (whole projection) exclude each other")


def validate_rope_scaling(scaling: Any, spec: ModelSpec, source: str) -> Optional[Dict[str, Any]]:
    """rope_scaling as rope_inv_freq may trust it: None, or a dict whose rope_type is one the engine computes,
    with every parameter that type needs present and sane. Errors name the field and what was expected."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: rope_scaling = {short(scaling)} is not an object")
    s = dict(scaling)
    if "rope_type" not in s and "type" in s:
        s["rope_type"] = s.pop("type")
    kind = s.get("rope_type", "default")
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ModelLoadError(f"{source}: RoPE scaling type {short(kind)} is not supported yet (supported: "
                             f"default, {', '.join(ROPE_SCALING_TYPES)})")

    def number(key: str, what: str) -> float:
        if key not in s:
            raise ModelLoadError(f"{source}: rope_scaling of type {kind} needs {key!r} ({what})")
        v = s[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0 or \
                not np.isfinite(np.float32(v)) or not np.float32(v) > 0:
            raise ModelLoadError(f"{source}: rope_scaling.{key} = {short(v)} must be a positive finite number "
                                 f"({what})")
        return float(v)

    if kind == "longrope":
        return _validate_longrope(s, spec, source)
    number("factor", "the context length multiplier, e.g. 8.0")
    if kind == "llama3":
        low = number("low_freq_factor", "e.g. 1.0")
        high = number("high_freq_factor", "e.g. 4.0")
        if not high > low:
            raise ModelLoadError(f"{source}: rope_scaling.high_freq_factor = {high:g} must be larger than "
                                 f"low_freq_factor = {low:g}")
        _original_context(s, "llama3", source)
    if kind == "yarn":
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if s.get(key) is not None:
                number(key, "a positive number")
        if s.get("original_max_position_embeddings") is not None:
            _original_context(s, "yarn", source)
    return s


def _original_context(s: Dict[str, Any], kind: str, source: str) -> int:
    """rope_scaling's original_max_position_embeddings (llama3, longrope): the pre-training context."""
    orig = s.get("original_max_position_embeddings")
    if not pos_int(orig) or orig > 1 << 31:
        raise ModelLoadError(f"{source}: rope_scaling of type {kind} needs original_max_position_embeddings, "
                             f"a positive integer (the pre-training context, e.g. 8192), not {short(orig)}")
    return orig


def _validate_longrope(s: Dict[str, Any], spec: ModelSpec, source: str) -> Dict[str, Any]:
    """LongRoPE (Phi-3): per-frequency divisors for contexts up to and beyond the pre-training one."""
    n = (spec.rope_dim or spec.head_dim) // 2
    for key in ("short_factor", "long_factor"):
        v = s.get(key)
        if not isinstance(v, list) or len(v) != n or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v):
            raise ModelLoadError(f"{source}: rope_scaling.{key} must list {n} positive numbers (one per rotated "
                                 f"pair), not {short(v)}")
    _original_context(s, "longrope", source)
    for key in ("factor", "attention_factor"):
        v = s.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0):
            raise ModelLoadError(f"{source}: rope_scaling.{key} = {short(v)} must be a positive number")
    return s


def short(v: Any) -> str:
    """repr(v), cut to fit an error message."""
    r = repr(v)
    return r if len(r) < 80 else r[:77] + "..."


# The configuration's sizes a weight's dimensions come from, by the names each format gives them
# (GGUF's under "<arch>."), for errors that say which field disagrees with the tensors.
SIZE_KEYS = {"hf": dict(vocab="vocab_size", hidden="hidden_size", heads="num_attention_heads",
                        kv_heads="num_key_value_heads", head_dim="head_dim", ffn="intermediate_size"),
             "gguf": dict(vocab="vocab_size", hidden="embedding_length", heads="attention.head_count",
                          kv_heads="attention.head_count_kv", head_dim="attention.key_length",
                          ffn="feed_forward_length")}


def _size_fields(name: str) -> Tuple[str, ...]:
    """The sizes behind weight `name`'s dimensions (SIZE_KEYS' keys)."""
    part = name.rsplit(".", 1)[-1]
    if part in ("wq", "bq", "wo", "q_norm"):
        return ("heads", "head_dim", "hidden")
    if part in ("wk", "wv", "bk", "bv", "k_norm"):
        return ("kv_heads", "head_dim", "hidden")
    if part in ("w_gate", "w_up", "w_down"):
        return ("ffn", "hidden")
    if part in ("tok_embeddings", "lm_head"):
        return ("vocab", "hidden")
    return ("hidden",)


def check_weight_shapes(spec: ModelSpec, shapes: Dict[str, Tuple[int, ...]], source: str,
                        keys: Optional[Dict[str, str]] = None) -> None:
    """`shapes` maps internal names to what the file holds; it must match `weight_shapes(spec)` exactly.
    `keys`: the format's names of the sizes (SIZE_KEYS), named when a shape disagrees, with `ffn` the
    family's own key."""
    expected = weight_shapes(spec)
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise ModelLoadError(f"{source}: missing weights: {few(missing)}")
    extra = [n for n in shapes if n not in expected]
    if extra:
        raise ModelLoadError(f"{source}: unexpected weights for this configuration: {few(extra)}")
    keys = keys or SIZE_KEYS["hf"]
    sizes = dict(vocab=spec.vocab_size, hidden=spec.hidden_size, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                 head_dim=spec.head_dim, ffn=spec.intermediate_size)
    for name, want in expected.items():
        if tuple(shapes[name]) != tuple(want):
            fields = ", ".join(f"{keys[k]} = {sizes[k]}" for k in _size_fields(name))
            raise ModelLoadError(f"{source}: weight {name} has shape {tuple(shapes[name])}, but the configuration "
                                 f"implies {tuple(want)} ({fields})")


def check_experts(spec: ModelSpec, shapes: Dict[str, Tuple[int, ...]], experts_key: str, source: str) -> None:
    """The expert count the configuration gives (`experts_key`) must be the one the file's routers and
    experts hold; `shapes` maps internal names to what the file holds."""
    n, held = spec.num_experts, {}
    for name, shape in shapes.items():
        parts = name.split(".")
        if parts[-1] == "router" and len(shape) == 2 and shape[0] != n:
            raise ModelLoadError(f"{source}: {experts_key} = {n}, but the router {name} scores {shape[0]} experts "
                                 f"(shape {tuple(shape)})")
        if len(parts) == 5 and parts[2] == "experts":
            if int(parts[3]) >= n:
                raise ModelLoadError(f"{source}: {experts_key} = {n}, but the file holds expert {parts[3]} ({name})")
            held.setdefault(parts[1], set()).add(int(parts[3]))
    for layer, experts in held.items():
        if len(experts) != n:
            raise ModelLoadError(f"{source}: {experts_key} = {n}, but layer {layer} holds {len(experts)} experts")


def few(names: List[str], n: int = 5) -> str:
    """The first n names, and how many more."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def load_tokenizer(factory: str, arg: Any, source: str):
    """Build the tokenizer via `corelm.tokenizer.Tokenizer.<factory>(arg)`; imported late so the loader
    does not pull in the tokenizers library until a model is actually loaded."""
    from ..tokenizer import Tokenizer
    try:
        # The factories try an encode and a decode: the tokenizers library panics (pyo3's PanicException,
        # a BaseException that passes every `except Exception`) on some broken files only when it first
        # encodes, so a broken file must fail here, not in a serving worker.
        return getattr(Tokenizer, factory)(arg)
    except ModelLoadError:
        raise
    except Exception as e:  # a broken tokenizer file is a model problem, not a crash
        raise ModelLoadError(f"{source}: could not load the tokenizer: {type(e).__name__}: {e}") from e
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise ModelLoadError(f"{source}: the tokenizer is broken: the tokenizers library panicked "
                             f"({str(e).strip() or 'no message'})") from None


def read_json(path: str, what: str) -> Any:
    """A small JSON file, read with a size cap and duplicate keys rejected."""
    try:
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise ModelLoadError(f"{path}: {what} is larger than {MAX_JSON_BYTES} bytes")
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"), object_pairs_hook=_unique_keys)
    except ModelLoadError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"{path}: could not read {what}: {e}") from None


def _unique_keys(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return d

def pos_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0

def optional_json(path: str, what: str) -> Dict[str, Any]:
    """read_json's object, or {} when the file is absent."""
    if not os.path.isfile(path):
        return {}
    doc = read_json(path, what)
    if not isinstance(doc, dict):
        raise ModelLoadError(f"{path}: {what} is not a JSON object")
    return doc


# Where an internal weight lives in the checkpoint: a tensor, or its rows [r0, r1) (spec.row_range): a part
# of a fused tensor (Phi-3) or an expert's part of a stacked 3D one.
Source = Tuple[str, int, int]

def add_source(names: Dict[str, Source], internal: str, src: Source, source: str) -> None:
    if internal in names:
        raise ModelLoadError(f"{source}: both {names[internal][0]} and {src[0]} hold {internal}")
    names[internal] = src


def split_tensor(spec: ModelSpec, layer: int, name: str, shape: Tuple[int, ...], parts: Tuple[str, ...],
                 stacked: bool, experts_key: str, source: str) -> Dict[str, Source]:
    """The internal weights of layer `layer` that one checkpoint tensor holds, each as its rows: a fused
    tensor's parts one after another, or, stacked, [experts, each expert's parts, cols]."""
    experts, inner = 1, shape
    if stacked:
        if len(shape) != 3:
            raise ModelLoadError(f"{source}: expert tensor {name} has shape {shape}, not [experts, rows, cols]")
        if shape[0] != spec.num_experts:
            raise ModelLoadError(f"{source}: {experts_key} = {spec.num_experts}, but expert tensor {name} holds "
                                 f"{shape[0]} experts (shape {shape})")
        experts, inner = shape[0], shape[1:]
    rows = [weight_shapes_rows(spec, part) for part in parts]
    if len(inner) != 2 or inner[0] != sum(rows):
        what = "fused tensor" if not stacked else "expert tensor"
        raise ModelLoadError(f"{source}: {what} {name} has shape {shape}, but {' + '.join(parts)} take {sum(rows)} "
                             f"rows{' per expert' if stacked else ''} by the configuration (head counts, head_dim, "
                             f"hidden_size, intermediate_size)")
    out, r0 = {}, 0
    for e in range(experts):
        prefix = f"layers.{layer}.experts.{e}." if stacked else f"layers.{layer}."
        for part, n in zip(parts, rows):
            out[prefix + part] = (name, r0, r0 + n)
            r0 += n
    return out


def weight_shapes_rows(spec: ModelSpec, part: str) -> int:
    """The rows of a layer matrix that fused or stacked checkpoint tensors hold (wq, wk, wv, w_gate, w_up,
    w_down)."""
    return {"wq": spec.num_heads * spec.head_dim, "wk": spec.num_kv_heads * spec.head_dim,
            "wv": spec.num_kv_heads * spec.head_dim, "w_gate": spec.intermediate_size,
            "w_up": spec.intermediate_size, "w_down": spec.hidden_size}[part]


def source_shape(shape: Tuple[int, ...], src: Source) -> Tuple[int, ...]:
    """The shape of the internal weight `src` gives, from its tensor's `shape` (split_tensor checked its rows)."""
    return tuple(shape) if src[2] < 0 else (src[2] - src[1], shape[-1])

def folder_chat_template(folder: str) -> Optional[str]:
    """The chat template an HF folder (or a corelm folder, which keeps its files) carries, if any."""
    # Newer transformers save the template as its own file; older ones inside tokenizer_config.json.
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            with open(jinja, "rb") as f:
                return f.read(MAX_JSON_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{jinja}: could not read the chat template: {e}") from None
    tmpl = optional_json(os.path.join(folder, "tokenizer_config.json"), "tokenizer_config.json").get("chat_template")
    if tmpl is None:   # multimodal repos (Gemma 3 4B+) may keep it in the processor's chat_template.json
        tmpl = optional_json(os.path.join(folder, "chat_template.json"), "chat_template.json").get("chat_template")
    if isinstance(tmpl, list):   # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    return tmpl if isinstance(tmpl, str) else None
