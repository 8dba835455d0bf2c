"""Hugging Face model folders (config.json + safetensors); hub downloads are in hub.py, the checks every
loader shares in checks.py."""
from __future__ import annotations

import glob
import math
import os
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .safetensors import INDEX_FILE, SINGLE_FILE, SafetensorsCollection, open_safetensors_folder
from .families import HF_CLASSES, SUPPORTED_ARCHS, Family, expert_tensor, family
from .spec import LoadedModel, ModelLoadError, ModelSpec, check_finite, check_finite_blocks, kept_float
from .checks import (SIZE_KEYS, Source, add_source, check_experts, check_weight_shapes, few,
                     folder_chat_template, load_tokenizer, optional_json, pos_int, read_json, short, source_shape,
                     split_tensor, validate_spec)

PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".pkl", ".pickle", ".ckpt")

# HF tensor names -> internal names: the family's hf_global and, under its hf_layer_prefix, hf_layer
# (loader/families.py).
# Buffers some checkpoints carry that the engine recomputes.
_HF_IGNORED_RE = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq|embeddings\.position_ids")


# ---------------------------------------------------------------------------------------------------
# config.json -> ModelSpec.

def spec_from_hf_config(config: Dict[str, Any], generation_config: Dict[str, Any], source: str) -> ModelSpec:
    if not isinstance(config, dict):
        raise ModelLoadError(f"{source}: config.json is not a JSON object")
    arch = _hf_arch(config, source)
    fam = family(arch)
    text = hf_text_config(config, fam, source)
    where = "config.json" if text is config else f"config.json {fam.hf_text_config}"
    config = text
    _check_unsupported_features(config, fam, source)

    def req(key):  # a key the config must give, unless transformers' class has a default for it
        if config.get(key) is None and key in fam.hf_defaults:
            return fam.hf_defaults[key]
        if key not in config:
            raise ModelLoadError(f"{source}: {where} has no {key!r}")
        return config[key]

    def opt(key, default=None):  # the config's value, else transformers' default for the family
        v = config.get(key)
        return v if v is not None else fam.hf_defaults.get(key, default)

    hidden, heads = req("hidden_size"), req("num_attention_heads")
    head_dim = opt("head_dim") or (hidden // heads if pos_int(hidden) and pos_int(heads) else None)
    if fam.attention_bias == "config":
        bias = bool(config.get("attention_bias", False))
    else:
        bias = fam.attention_bias == "always"
    layers = req("num_hidden_layers")
    if fam.encoder:
        _check_encoder_config(opt, source)
    ffn_key = fam.ffn_keys[0]
    experts_key, experts = _hf_experts(config, fam, source)
    spec = ModelSpec(
        arch=arch, vocab_size=req("vocab_size"), hidden_size=hidden,
        intermediate_size=req(ffn_key), num_layers=layers,
        num_heads=heads, num_kv_heads=opt("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=opt("layer_norm_eps") if fam.encoder else opt("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(config, fam),
        rope_scaling=_rope_scaling(config, fam, source),
        max_position_embeddings=config.get("max_position_embeddings") or fam.default_max_pos,
        tie_word_embeddings=bool(opt("tie_word_embeddings", False)),
        attention_bias=bias,
        sliding_window=_sliding_window(config, fam, source),
        bos_token_id=_first_set("bos_token_id", generation_config, config, fam.hf_defaults),
        eos_token_ids=_eos_list(_first_set("eos_token_id", generation_config, config, fam.hf_defaults), source),
        activation=fam.activation, qk_norm=fam.qk_norm, post_norms=fam.post_norms,
        embed_scale=float(np.float32(math.sqrt(hidden))) if fam.embed_scale and pos_int(hidden) else 1.0,
        query_pre_attn_scalar=opt("query_pre_attn_scalar") if fam.query_pre_attn_scalar else None,
        attn_logit_softcap=opt("attn_logit_softcapping") if fam.softcaps else None,
        final_logit_softcap=opt("final_logit_softcapping") if fam.softcaps else None,
        sliding_layers=_sliding_layers(config, fam, layers, source),
        rope_local_theta=_rope_local_theta(config, fam),
        rope_dim=_rope_dim(config, head_dim, source), qk_norm_whole=fam.qk_norm_whole,
        num_experts=experts, num_experts_used=opt("num_experts_per_tok", 0) if fam.moe else 0,
        moe_norm_topk=opt("norm_topk_prob", False) if fam.norm_topk == "config" else fam.moe,
        encoder=fam.encoder, type_vocab_size=opt("type_vocab_size", 0) if fam.encoder else 0,
    )
    if "head_dim" not in config and "head_dim" not in fam.hf_defaults and pos_int(hidden) and pos_int(heads) \
            and hidden % heads:
        raise ModelLoadError(f"{source}: hidden_size {hidden} is not divisible by {heads} heads")
    return validate_spec(spec, source, (experts_key, "num_experts_per_tok"))


def _check_encoder_config(opt, source: str) -> None:
    """An encoder's features the forward pass does not have are refused by name."""
    if opt("position_embedding_type") != "absolute":
        raise ModelLoadError(f"{source}: position_embedding_type {opt('position_embedding_type')!r} is not "
                             f"supported (corelm runs learned 'absolute' positions)")
    types = opt("type_vocab_size")
    if not pos_int(types) or types > 1024:
        raise ModelLoadError(f"{source}: type_vocab_size = {types!r} is not a positive integer up to 1024")


# Keys of a multimodal config.json that transformers reads from the outer config, not the text model's: the
# outer class ties lm_head to the embeddings by its own tie_word_embeddings, generation takes the token ids
# from the outer config before the text model's, and a quantized checkpoint says so at the top.
_OUTER_KEYS = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "quantization_config")


def hf_text_config(config: Dict[str, Any], fam: Family, source: str) -> Dict[str, Any]:
    """The config of the model corelm runs: config.json itself, or for a multimodal class the text model's
    config (the family's hf_text_config key) with the keys transformers takes from the outer config."""
    key = fam.hf_text_config
    if key is None or config.get(key) is None:
        return config
    text = config[key]
    if not isinstance(text, dict):
        raise ModelLoadError(f"{source}: config.json {key} is not an object but {short(text)}")
    outer = {k: config[k] for k in _OUTER_KEYS if config.get(k) is not None}
    return {**text, **outer}


_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts")  # transformers maps each MoE class's to the other


def _hf_experts(config: Dict[str, Any], fam: Family, source: str) -> Tuple[str, Any]:
    """(the config key that gives the number of experts, its value); 0 for dense families."""
    given = [k for k in _EXPERT_COUNT_KEYS if config.get(k) is not None]
    if not fam.moe:
        return _EXPERT_COUNT_KEYS[-1], 0
    if len(given) == 2 and config[given[0]] != config[given[1]]:
        raise ModelLoadError(f"{source}: {given[0]} = {short(config[given[0]])} and {given[1]} = "
                             f"{short(config[given[1]])} disagree on the number of experts")
    key = given[0] if given else next(k for k in _EXPERT_COUNT_KEYS if k in fam.hf_defaults)
    return key, config[key] if given else fam.hf_defaults[key]


def _hf_arch(config: Dict[str, Any], source: str) -> str:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs:
        for a in archs:
            if isinstance(a, str) and a in HF_CLASSES:
                return HF_CLASSES[a]
        found = ", ".join(map(str, archs))
    elif config.get("model_type") in SUPPORTED_ARCHS:
        return config["model_type"]
    else:
        found = f"model_type {config.get('model_type')!r}"
    raise ModelLoadError(f"{source}: unsupported architecture {found}; corelm supports "
                         f"{', '.join(HF_CLASSES)}")


# transformers' names of the tanh-approximated GELU
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def _check_unsupported_features(config: Dict[str, Any], fam: Family, source: str) -> None:
    # Refuse what the engine would silently compute wrong.
    act = config.get("hidden_activation") or config.get("hidden_act") or fam.hf_defaults.get("hidden_activation", "silu")
    supported = {"silu": ("silu",), "gelu_tanh": _GELU_TANH, "gelu": ("gelu",)}[fam.activation]
    if act not in supported:
        want = {"silu": "silu (SwiGLU)", "gelu_tanh": "gelu_pytorch_tanh (GeGLU)", "gelu": "gelu (exact)"}[fam.activation]
        raise ModelLoadError(f"{source}: activation {act!r} is not supported for {fam.arch} (corelm implements "
                             f"{want})")
    if config.get("mlp_bias"):
        raise ModelLoadError(f"{source}: MLP biases (mlp_bias: true) are not supported")
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: bidirectional attention (use_bidirectional_attention) is for embedding "
                             f"models, which corelm does not run")
    if fam.attention_bias == "never" and config.get("attention_bias"):
        raise ModelLoadError(f"{source}: attention biases are not supported for {fam.arch}")
    if fam.moe:
        _check_every_layer_moe(config, source)
    if config.get("clip_qkv") is not None:
        raise ModelLoadError(f"{source}: clip_qkv = {short(config['clip_qkv'])} (clamping q, k and v) is not "
                             f"supported")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?") if isinstance(
            config["quantization_config"], dict) else "?"
        raise ModelLoadError(f"{source}: pre-quantized HF checkpoints ({method}) are not supported; "
                             f"use the fp16/bf16/fp32 release or a GGUF file")


def _check_every_layer_moe(config: Dict[str, Any], source: str) -> None:
    """The engine runs every layer's MLP as the same mixture of experts: no dense layers between them
    (Qwen3-MoE's mlp_only_layers, decoder_sparse_step), no shared expert beside them (Qwen2-MoE style)."""
    if config.get("mlp_only_layers"):
        raise ModelLoadError(f"{source}: mlp_only_layers = {short(config['mlp_only_layers'])}: dense MLP layers "
                             f"among mixture-of-experts ones are not supported (every layer must route to experts)")
    if config.get("decoder_sparse_step") not in (None, 1):
        raise ModelLoadError(f"{source}: decoder_sparse_step = {short(config['decoder_sparse_step'])}: only every "
                             f"n-th layer routes to experts, which is not supported (every layer must)")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if config.get(key):
            raise ModelLoadError(f"{source}: {key} = {short(config[key])}: shared experts are not supported")


def _rope_params(config: Dict[str, Any], layer_type: str = "full_attention") -> Dict[str, Any]:
    p = config.get("rope_parameters")       # transformers >= 5 keeps theta and scaling here
    if isinstance(p, dict) and isinstance(p.get(layer_type), dict):
        return p[layer_type]                # per layer type (Gemma 3)
    return p if isinstance(p, dict) and "full_attention" not in p else {}


def _rope_theta(config: Dict[str, Any], fam: Family):
    for v in (config.get("rope_theta"), _rope_params(config).get("rope_theta")):
        if v is not None:
            return v
    return fam.hf_defaults.get("rope_theta", 10000.0)


def _rope_local_theta(config: Dict[str, Any], fam: Family) -> Optional[float]:
    if fam.local_rope_theta is None:
        return None
    for v in (config.get("rope_local_base_freq"), _rope_params(config, "sliding_attention").get("rope_theta")):
        if v is not None:
            return v
    return fam.local_rope_theta


def _rope_dim(config: Dict[str, Any], head_dim, source: str) -> Optional[int]:
    """Partial rotary (Phi-4-mini rotates 3/4 of each head): the rotated dims, None for all."""
    factor = config.get("partial_rotary_factor", _rope_params(config).get("partial_rotary_factor", 1.0))
    if factor in (None, 1, 1.0) or not pos_int(head_dim):
        return None
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise ModelLoadError(f"{source}: partial_rotary_factor = {short(factor)} must be in (0, 1]")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ModelLoadError(f"{source}: partial_rotary_factor {factor} leaves {dim} rotated dims of {head_dim}; "
                             f"RoPE needs an even number")
    return dim


def _rope_scaling(config: Dict[str, Any], fam: Family, source: str) -> Optional[Dict[str, Any]]:
    s = config.get("rope_scaling")
    if s is None:
        s = _rope_params(config)
    if not isinstance(s, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object or null, not {s!r}")
    s = {k: v for k, v in s.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if "rope_type" not in s and "type" in s:    # transformers < 4.45 called it "type"
        s["rope_type"] = s.pop("type")
    if s.get("rope_type", "default") == "default":
        return None
    if s.get("rope_type") == "longrope":       # Phi-3 keeps the pre-training context at the top level
        for key in ("original_max_position_embeddings", "max_position_embeddings"):
            if key not in s and config.get(key) is not None:
                s[key] = config[key]
    return s


def _sliding_window(config: Dict[str, Any], fam: Family, source: str) -> Optional[int]:
    window = config.get("sliding_window", fam.hf_defaults.get("sliding_window"))
    if fam.sliding in ("all", "pattern"):
        return window
    if fam.sliding == "flag":
        return window if config.get("use_sliding_window") else None
    if fam.sliding == "qwen2" and config.get("use_sliding_window") and window:
        # Qwen2 slides only in layers >= max_window_layers; all-or-nothing is what the engine can do.
        layers, window_layers = config.get("num_hidden_layers", 0), config.get("max_window_layers", 0)
        if not pos_int(window_layers) and window_layers != 0:
            raise ModelLoadError(f"{source}: max_window_layers = {short(window_layers)} is not an integer")
        if pos_int(layers) and window_layers < layers:
            raise ModelLoadError(f"{source}: {fam.arch} sliding-window attention on some layers only "
                                 f"(use_sliding_window with max_window_layers) is not supported yet")
    return None


def _sliding_layers(config: Dict[str, Any], fam: Family, layers, source: str) -> Optional[List[bool]]:
    """Which layers slide, for families whose layers alternate (Gemma): config.json's layer_types, else
    transformers' default pattern (every swa_pattern-th layer attends globally)."""
    if fam.sliding != "pattern" or not pos_int(layers):
        return None
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or \
                not all(t in ("sliding_attention", "full_attention") for t in types):
            raise ModelLoadError(f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for "
                                 f"each of the {layers} layers, not {short(types)}")
        return [t == "sliding_attention" for t in types]
    pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", fam.swa_pattern))
    if not pos_int(pattern):
        raise ModelLoadError(f"{source}: sliding_window_pattern = {short(pattern)} is not a positive integer")
    return [bool((i + 1) % pattern) for i in range(layers)]


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
    generation_config = optional_json(os.path.join(folder, "generation_config.json"), "generation_config.json")
    spec = spec_from_hf_config(config, generation_config, folder)
    spec.pooling, spec.normalize = sentence_transformers_pooling(folder, spec.pooling, spec.normalize)
    experts_key = _hf_experts(hf_text_config(config, family(spec.arch), folder), family(spec.arch), folder)[0]
    names = _map_hf_names(spec, tensors, folder, experts_key)
    shapes = {n: source_shape(tensors.info(src[0]).shape, src) for n, src in names.items()}
    check_experts(spec, shapes, experts_key, folder)
    check_weight_shapes(spec, shapes, folder, dict(SIZE_KEYS["hf"], ffn=family(spec.arch).ffn_keys[0]))
    raw_weight_type, get_raw_weight = _hf_raw_getters(tensors, names, folder)
    return LoadedModel(
        spec=spec, get_weight=_hf_getter(spec, tensors, names, folder), get_raw_weight=get_raw_weight,
        raw_weight_type=raw_weight_type,
        release_weight=lambda n: tensors.release(*names.get(n, ("", 0, -1))),
        tokenizer=load_tokenizer("from_hf_folder", folder, folder),
        chat_template=folder_chat_template(folder), generation_config=generation_config, source=folder,
        source_format="hf", description=_hf_description(tensors, names))


# sentence-transformers' Pooling config keys -> corelm's pooling names
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


def sentence_transformers_pooling(folder: str, pooling: Optional[str], normalize: bool) -> Tuple[Optional[str], bool]:
    """The pooling and normalisation a sentence-transformers folder declares (modules.json: a Pooling
    module's config, a Normalize module); what the caller had where the folder says nothing."""
    path = os.path.join(folder, "modules.json")
    modules = read_json(path, "modules.json") if os.path.isfile(path) else None
    if not isinstance(modules, list):
        return pooling, normalize
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    normalize = "Normalize" in kinds
    pool = kinds.get("Pooling")
    if pool is not None:
        path = str(pool.get("path", ""))
        if os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
            raise ModelLoadError(f"{folder}: modules.json names a Pooling path outside the folder: {path!r}")
        cfg = optional_json(os.path.join(folder, path, "config.json"), f"{path}/config.json")
        modes = [name for key, name in _ST_POOLING.items() if isinstance(cfg, dict) and cfg.get(key) is True]
        others = [k for k, v in (cfg or {}).items() if k.startswith("pooling_mode_") and v is True and k not in _ST_POOLING]
        if others or len(modes) > 1:
            raise ModelLoadError(f"{folder}: {path}/config.json asks for pooling {few(others + modes)}; corelm pools "
                                 f"by one of mean, cls or last token")
        pooling = modes[0] if modes else pooling
    return pooling, normalize


def _open_weights(folder: str) -> SafetensorsCollection:
    has_safetensors = os.path.isfile(os.path.join(folder, INDEX_FILE)) or \
        os.path.isfile(os.path.join(folder, SINGLE_FILE))
    if not has_safetensors:
        pickles = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*"))
                         if p.lower().endswith(PICKLE_SUFFIXES))
        if pickles:
            raise ModelLoadError(
                f"{folder}: the weights are PyTorch pickle files ({few(pickles, 3)}), which can run arbitrary "
                f"code when loaded; corelm refuses them. Use a safetensors version of the model (many hub repos "
                f"have one, or convert it in a sandbox) or a GGUF file.")
        ggufs = glob.glob(os.path.join(folder, "*.gguf"))
        hint = f"; to load a GGUF file, pass its path ({os.path.basename(ggufs[0])})" if ggufs else ""
        raise ModelLoadError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} found{hint}")
    return open_safetensors_folder(folder)


def _map_hf_names(spec: ModelSpec, tensors: SafetensorsCollection, folder: str,
                  experts_key: str) -> Dict[str, Source]:
    """internal name -> (HF tensor name, first row, end row; -1 for all rows), for every tensor the file
    holds that the engine uses."""
    fam = family(spec.arch)
    names, unknown = {}, []
    layer_re = re.compile(re.escape(fam.hf_layer_prefix) + r"(\d+)\.(.+)")
    for hf in tensors:
        name = _text_model_name(fam, hf)
        if name is None:
            continue            # a multimodal checkpoint's vision tower: the engine runs the text model alone
        m = layer_re.fullmatch(name)
        rest = m.group(2) if m else None
        if rest in fam.hf_fused or rest in fam.hf_stacked:
            stacked = rest in fam.hf_stacked
            parts = fam.hf_stacked[rest] if stacked else fam.hf_fused[rest]
            for internal, src in split_tensor(spec, int(m.group(1)), hf, tuple(tensors.info(hf).shape), parts,
                                              stacked, experts_key, folder).items():
                add_source(names, internal, src, folder)
            continue
        internal = fam.hf_global.get(name)
        if internal is None and m:
            expert = expert_tensor(fam, rest)
            if rest in fam.hf_layer:
                internal = f"layers.{int(m.group(1))}.{fam.hf_layer[rest]}"
            elif expert:
                internal = f"layers.{int(m.group(1))}.experts.{expert[0]}.{expert[1]}"
        if internal == "lm_head" and spec.tie_word_embeddings:
            continue            # tied: the engine reuses tok_embeddings; a stored copy is redundant
        if internal is None:
            if not _HF_IGNORED_RE.fullmatch(name):
                unknown.append(hf)
            continue
        add_source(names, internal, (hf, 0, -1), folder)
    if unknown:
        raise ModelLoadError(f"{folder}: unknown tensors for a {spec.arch} model: {few(unknown)}")
    if "lm_head" not in names and not spec.tie_word_embeddings and not spec.encoder:
        raise ModelLoadError(f"{folder}: lm_head.weight is missing and tie_word_embeddings is false")
    return names


def _text_model_name(fam: Family, hf: str) -> Optional[str]:
    """A checkpoint tensor's name in a text-only checkpoint (a multimodal checkpoint's text model is under
    another prefix, the family's hf_text_prefixes); None for a tensor of its other towers (hf_towers)."""
    for prefix, text_prefix in fam.hf_text_prefixes.items():
        if hf.startswith(prefix):
            hf = text_prefix + hf[len(prefix):]
            break
    return None if hf.startswith(fam.hf_towers) else hf


def _hf_getter(spec: ModelSpec, tensors: SafetensorsCollection, names: Dict[str, Source],
               folder: str) -> Callable[[str], np.ndarray]:
    plus_one = family(spec.arch).norm_plus_one

    def get_weight(name: str) -> np.ndarray:
        if name not in names:
            raise ModelLoadError(f"no weight named {name!r}")
        hf = names[name][0]
        w = np.ascontiguousarray(tensors.get(*names[name]), dtype=np.float32)
        if plus_one and name.endswith("norm"):
            w = w + np.float32(1)   # Gemma's RMSNorm scales by (1 + w), computed in float32 as transformers
        return check_finite(w, folder, hf)
    return get_weight


def _hf_raw_getters(tensors: SafetensorsCollection, names: Dict[str, Source], folder: str):
    """(raw_weight_type, get_raw_weight) for the stored bf16 matrices: their rows as the file has them
    (set_weight_raw "BF16"), packed with no float copy of the matrix."""
    def raw_weight_type(name: str) -> Optional[str]:
        src = names.get(name)
        if src is None or kept_float(name):
            return None
        info = tensors.info(src[0])
        return "BF16" if info.dtype == "BF16" and len(source_shape(info.shape, src)) == 2 else None

    def get_raw_weight(name: str):
        if raw_weight_type(name) is None:
            return None
        raw = tensors.raw_bf16(*names[name])
        check_finite_blocks("BF16", raw, folder, names[name][0])
        return "BF16", raw, source_shape(tensors.info(names[name][0]).shape, names[name])
    return raw_weight_type, get_raw_weight


def _hf_description(tensors: SafetensorsCollection, names: Dict[str, str]) -> str:
    dtypes = sorted({tensors.info(src[0]).dtype for src in names.values()})
    conv = "" if dtypes == ["F32"] else ", converted to fp32 at load"
    return f"HF safetensors {'/'.join(dtypes)}{conv}"
