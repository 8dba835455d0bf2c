"""Hugging Face model folders (config.json + safetensors); hub downloads are in hub.py.

Also home to the checks every loader shares (`validate_spec`, `check_weight_shapes`, `load_tokenizer`),
so a GGUF file and an HF folder are held to the same rules.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .safetensors import INDEX_FILE, SINGLE_FILE, SafetensorsCollection, open_safetensors_folder
from .spec import SUPPORTED_ARCHS, LoadedModel, ModelLoadError, ModelSpec, check_finite, weight_shapes

# HF class name -> corelm arch name.
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
# transformers' per-class default for max_position_embeddings.
_DEFAULT_MAX_POS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".pkl", ".pickle", ".ckpt")
MAX_JSON_BYTES = 64 * 1024 * 1024

# Caps on hyper-parameters: real models are far below them, and they stop a hostile config from making
# us build absurd shape tables (num_hidden_layers = 10^12) before any weight is looked at.
_CAPS = {"vocab_size": 1 << 23, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_layers": 4096,
         "num_heads": 4096, "num_kv_heads": 4096, "head_dim": 4096}

# HF tensor name -> internal name. Per-layer names carry the layer index in group 1.
_HF_GLOBAL = {"model.embed_tokens.weight": "tok_embeddings", "model.norm.weight": "norm",
              "lm_head.weight": "lm_head"}
_HF_LAYER = {"self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
             "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk",
             "self_attn.v_proj.bias": "bv", "input_layernorm.weight": "attn_norm",
             "post_attention_layernorm.weight": "ffn_norm", "mlp.gate_proj.weight": "w_gate",
             "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down"}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some checkpoints carry that the engine recomputes.
_HF_IGNORED_RE = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


# ---------------------------------------------------------------------------------------------------
# Shared checks.

def validate_spec(spec: ModelSpec, source: str) -> ModelSpec:
    """Reject hyper-parameters that are missing, absurd or inconsistent, naming the offending field."""
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
    if not _pos_int(spec.max_position_embeddings) or spec.max_position_embeddings > 1 << 31:
        raise ModelLoadError(f"{source}: max_position_embeddings = {spec.max_position_embeddings!r} "
                             f"is not a positive integer")
    if spec.sliding_window is not None and not _pos_int(spec.sliding_window):
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
    for tid in ([spec.bos_token_id] if spec.bos_token_id is not None else []) + list(spec.eos_token_ids):
        if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < spec.vocab_size:
            raise ModelLoadError(f"{source}: special token id {tid!r} is outside the vocabulary "
                                 f"(size {spec.vocab_size})")
    return spec


_MAX_RMS_NORM_EPS = 0.1
ROPE_SCALING_TYPES = ("linear", "llama3")       # what engine.model_builder.rope_inv_freq computes


def validate_rope_scaling(scaling: Any, spec: ModelSpec, source: str) -> Optional[Dict[str, Any]]:
    """rope_scaling as rope_inv_freq may trust it: None, or a dict whose rope_type is one the engine computes,
    with every parameter that type needs present and sane. Errors name the field and what was expected."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: rope_scaling = {_short(scaling)} is not an object")
    s = dict(scaling)
    if "rope_type" not in s and "type" in s:
        s["rope_type"] = s.pop("type")
    kind = s.get("rope_type", "default")
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ModelLoadError(f"{source}: RoPE scaling type {_short(kind)} is not supported yet (supported: "
                             f"default, {', '.join(ROPE_SCALING_TYPES)})")

    def number(key: str, what: str) -> float:
        if key not in s:
            raise ModelLoadError(f"{source}: rope_scaling of type {kind} needs {key!r} ({what})")
        v = s[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0 or \
                not np.isfinite(np.float32(v)) or not np.float32(v) > 0:
            raise ModelLoadError(f"{source}: rope_scaling.{key} = {_short(v)} must be a positive finite number "
                                 f"({what})")
        return float(v)

    number("factor", "the context length multiplier, e.g. 8.0")
    if kind == "llama3":
        low = number("low_freq_factor", "e.g. 1.0")
        high = number("high_freq_factor", "e.g. 4.0")
        if not high > low:
            raise ModelLoadError(f"{source}: rope_scaling.high_freq_factor = {high:g} must be larger than "
                                 f"low_freq_factor = {low:g}")
        orig = s.get("original_max_position_embeddings")
        if not _pos_int(orig) or orig > 1 << 31:
            raise ModelLoadError(f"{source}: rope_scaling of type llama3 needs original_max_position_embeddings, "
                                 f"a positive integer (the pre-training context, e.g. 8192), not {_short(orig)}")
    return s


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) < 80 else r[:77] + "..."


def check_weight_shapes(spec: ModelSpec, shapes: Dict[str, Tuple[int, ...]], source: str) -> None:
    """`shapes` maps internal names to what the file holds; it must match `weight_shapes(spec)` exactly."""
    expected = weight_shapes(spec)
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise ModelLoadError(f"{source}: missing weights: {_few(missing)}")
    extra = [n for n in shapes if n not in expected]
    if extra:
        raise ModelLoadError(f"{source}: unexpected weights for this configuration: {_few(extra)}")
    for name, want in expected.items():
        if tuple(shapes[name]) != tuple(want):
            raise ModelLoadError(f"{source}: weight {name} has shape {tuple(shapes[name])}, "
                                 f"but the configuration implies {tuple(want)}")


def _few(names: List[str], n: int = 5) -> str:
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


# ---------------------------------------------------------------------------------------------------
# config.json -> ModelSpec.

def spec_from_hf_config(config: Dict[str, Any], generation_config: Dict[str, Any], source: str) -> ModelSpec:
    if not isinstance(config, dict):
        raise ModelLoadError(f"{source}: config.json is not a JSON object")
    arch = _hf_arch(config, source)
    _check_unsupported_features(config, arch, source)

    def req(key):
        if key not in config:
            raise ModelLoadError(f"{source}: config.json has no {key!r}")
        return config[key]

    hidden, heads = req("hidden_size"), req("num_attention_heads")
    head_dim = config.get("head_dim") or (hidden // heads if _pos_int(hidden) and _pos_int(heads) else None)
    spec = ModelSpec(
        arch=arch, vocab_size=req("vocab_size"), hidden_size=hidden,
        intermediate_size=req("intermediate_size"), num_layers=req("num_hidden_layers"),
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(config),
        rope_scaling=_rope_scaling(config, source),
        max_position_embeddings=config.get("max_position_embeddings") or _DEFAULT_MAX_POS[arch],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama has them only when attention_bias is set; Mistral never.
        attention_bias=arch == "qwen2" or (arch == "llama" and bool(config.get("attention_bias", False))),
        sliding_window=_sliding_window(config, arch, source),
        bos_token_id=_first_set("bos_token_id", generation_config, config),
        eos_token_ids=_eos_list(_first_set("eos_token_id", generation_config, config), source),
    )
    if "head_dim" not in config and _pos_int(hidden) and _pos_int(heads) and hidden % heads:
        raise ModelLoadError(f"{source}: hidden_size {hidden} is not divisible by {heads} heads")
    return validate_spec(spec, source)


def _pos_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _hf_arch(config: Dict[str, Any], source: str) -> str:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs:
        for a in archs:
            if isinstance(a, str) and a in HF_ARCHITECTURES:
                return HF_ARCHITECTURES[a]
        found = ", ".join(map(str, archs))
    elif config.get("model_type") in SUPPORTED_ARCHS:
        return config["model_type"]
    else:
        found = f"model_type {config.get('model_type')!r}"
    raise ModelLoadError(f"{source}: unsupported architecture {found}; corelm supports "
                         f"{', '.join(HF_ARCHITECTURES)}")


def _check_unsupported_features(config: Dict[str, Any], arch: str, source: str) -> None:
    # Refuse what the engine would silently compute wrong.
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act != "silu":
        raise ModelLoadError(f"{source}: activation {act!r} is not supported (corelm implements SwiGLU with silu)")
    if config.get("mlp_bias"):
        raise ModelLoadError(f"{source}: MLP biases (mlp_bias: true) are not supported")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?") if isinstance(
            config["quantization_config"], dict) else "?"
        raise ModelLoadError(f"{source}: pre-quantized HF checkpoints ({method}) are not supported; "
                             f"use the fp16/bf16/fp32 release or a GGUF file")


def _rope_params(config: Dict[str, Any]) -> Dict[str, Any]:
    p = config.get("rope_parameters")       # transformers >= 5 keeps theta and scaling here
    return p if isinstance(p, dict) else {}


def _rope_theta(config: Dict[str, Any]):
    for v in (config.get("rope_theta"), _rope_params(config).get("rope_theta")):
        if v is not None:
            return v
    return 10000.0


def _rope_scaling(config: Dict[str, Any], source: str) -> Optional[Dict[str, Any]]:
    s = config.get("rope_scaling")
    if s is None:
        s = _rope_params(config)
    if not isinstance(s, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object or null, not {s!r}")
    s = {k: v for k, v in s.items() if k != "rope_theta"}
    if "rope_type" not in s and "type" in s:    # transformers < 4.45 called it "type"
        s["rope_type"] = s.pop("type")
    if s.get("rope_type", "default") == "default":
        return None
    return s


def _sliding_window(config: Dict[str, Any], arch: str, source: str) -> Optional[int]:
    window = config.get("sliding_window")
    if arch == "mistral":
        return window
    if arch == "qwen2" and config.get("use_sliding_window") and window:
        # Qwen2 slides only in layers >= max_window_layers; all-or-nothing is what the engine can do.
        layers, window_layers = config.get("num_hidden_layers", 0), config.get("max_window_layers", 0)
        if not _pos_int(window_layers) and window_layers != 0:
            raise ModelLoadError(f"{source}: max_window_layers = {_short(window_layers)} is not an integer")
        if _pos_int(layers) and window_layers < layers:
            raise ModelLoadError(f"{source}: Qwen2 sliding-window attention on some layers only "
                                 f"(use_sliding_window with max_window_layers) is not supported yet")
    return None


def _first_set(key: str, *dicts: Dict[str, Any]):
    for d in dicts:
        if d.get(key) is not None:
            return d[key]
    return None


def _eos_list(eos, source: str) -> List[int]:
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelLoadError(f"{source}: eos_token_id must be an integer or a list of integers, not {eos!r}")
    return list(dict.fromkeys(ids))


# ---------------------------------------------------------------------------------------------------
# HF folders.

def load_hf_folder(folder: str) -> LoadedModel:
    folder = os.path.abspath(folder)
    tensors = _open_weights(folder)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{folder}: no config.json; an HF model folder needs config.json next to "
                             f"its *.safetensors")
    config = read_json(config_path, "config.json")
    generation_config = _optional_json(os.path.join(folder, "generation_config.json"), "generation_config.json")
    spec = spec_from_hf_config(config, generation_config, folder)
    names = _map_hf_names(spec, tensors, folder)
    check_weight_shapes(spec, {n: tensors.info(hf).shape for n, hf in names.items()}, folder)
    return LoadedModel(
        spec=spec, get_weight=_hf_getter(tensors, names, folder),
        release_weight=lambda n: tensors.release(names.get(n, "")),
        tokenizer=load_tokenizer("from_hf_folder", folder, folder),
        chat_template=_hf_chat_template(folder), generation_config=generation_config, source=folder,
        source_format="hf", description=_hf_description(tensors, names))


def _open_weights(folder: str) -> SafetensorsCollection:
    has_safetensors = os.path.isfile(os.path.join(folder, INDEX_FILE)) or \
        os.path.isfile(os.path.join(folder, SINGLE_FILE))
    if not has_safetensors:
        pickles = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*"))
                         if p.lower().endswith(PICKLE_SUFFIXES))
        if pickles:
            raise ModelLoadError(
                f"{folder}: the weights are PyTorch pickle files ({_few(pickles, 3)}), which can run arbitrary "
                f"code when loaded; corelm refuses them. Use a safetensors version of the model (many hub repos "
                f"have one, or convert it in a sandbox) or a GGUF file.")
        ggufs = glob.glob(os.path.join(folder, "*.gguf"))
        hint = f"; to load a GGUF file, pass its path ({os.path.basename(ggufs[0])})" if ggufs else ""
        raise ModelLoadError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} found{hint}")
    return open_safetensors_folder(folder)


def _optional_json(path: str, what: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    doc = read_json(path, what)
    if not isinstance(doc, dict):
        raise ModelLoadError(f"{path}: {what} is not a JSON object")
    return doc


def _map_hf_names(spec: ModelSpec, tensors: SafetensorsCollection, folder: str) -> Dict[str, str]:
    """internal name -> HF tensor name, for every tensor the file holds that the engine uses."""
    names, unknown = {}, []
    for hf in tensors:
        internal = _internal_name(hf)
        if internal == "lm_head" and spec.tie_word_embeddings:
            continue            # tied: the engine reuses tok_embeddings; a stored copy is redundant
        if internal is None:
            if not _HF_IGNORED_RE.fullmatch(hf):
                unknown.append(hf)
            continue
        names[internal] = hf
    if unknown:
        raise ModelLoadError(f"{folder}: unknown tensors for a {spec.arch} model: {_few(unknown)}")
    if "lm_head" not in names and not spec.tie_word_embeddings:
        raise ModelLoadError(f"{folder}: lm_head.weight is missing and tie_word_embeddings is false")
    return names


def _internal_name(hf: str) -> Optional[str]:
    if hf in _HF_GLOBAL:
        return _HF_GLOBAL[hf]
    m = _HF_LAYER_RE.fullmatch(hf)
    if m and m.group(2) in _HF_LAYER:
        return f"layers.{int(m.group(1))}.{_HF_LAYER[m.group(2)]}"
    return None


def _hf_getter(tensors: SafetensorsCollection, names: Dict[str, str], folder: str) -> Callable[[str], np.ndarray]:
    def get_weight(name: str) -> np.ndarray:
        if name not in names:
            raise ModelLoadError(f"no weight named {name!r}")
        return check_finite(np.ascontiguousarray(tensors.get(names[name]), dtype=np.float32), folder, names[name])
    return get_weight


def _hf_chat_template(folder: str) -> Optional[str]:
    # Newer transformers save the template as its own file; older ones inside tokenizer_config.json.
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            with open(jinja, "rb") as f:
                return f.read(MAX_JSON_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{jinja}: could not read the chat template: {e}") from None
    tmpl = _optional_json(os.path.join(folder, "tokenizer_config.json"), "tokenizer_config.json").get("chat_template")
    if isinstance(tmpl, list):   # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    return tmpl if isinstance(tmpl, str) else None


def _hf_description(tensors: SafetensorsCollection, names: Dict[str, str]) -> str:
    dtypes = sorted({tensors.info(hf).dtype for hf in names.values()})
    conv = "" if dtypes == ["F32"] else ", converted to fp32 at load"
    return f"HF safetensors {'/'.join(dtypes)}{conv}"
