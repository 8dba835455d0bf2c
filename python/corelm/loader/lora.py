"""LoRA adapters from PEFT folders (adapter_config.json + adapter_model.safetensors) and llama.cpp's GGUF
LoRA files, as internal weight names -> (A [rank, in], B [out, rank]) float32 and one scale.

    adapter = load_lora("my-adapter/", spec)          # spec: the base model's ModelSpec
    adapter.rank, adapter.scale, adapter.targets["layers.0.wq"]

Checkpoint names map to internal ones through the family's tables (families.py: hf_layer, gguf_layer and
their fused tensors), so a family's names live in one place. The scale is lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)) times the caller's. Refused with a ModelLoadError that says why: targets corelm does
not adapt (embed_tokens, lm_head, experts), biases, DoRA, per-module ranks, shapes that do not fit the
model, pickles (adapter_model.bin)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from .checks import read_json, weight_shapes_rows
from .families import GGUF_ARCHS, family
from .hf import PICKLE_SUFFIXES
from .spec import ModelLoadError, ModelSpec, weight_shapes

# The internal projections an adapter may target (the core's LoRA parts, cpp/model/lora.h).
LORA_PARTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


@dataclass
class LoraAdapter:
    source: str
    rank: int
    scale: float                                           # alpha / r (or / sqrt(r)) times the caller's scale
    targets: Dict[str, Tuple[np.ndarray, np.ndarray]]      # internal name -> (A [rank, in], B [out, rank])


def load_lora(path: str, spec: ModelSpec, scale: float = 1.0) -> LoraAdapter:
    """A PEFT adapter folder or a GGUF LoRA file for a model of `spec`."""
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ModelLoadError(f"a LoRA scale must be a finite number, got {scale!r}")
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        adapter = _load_peft(path, spec)
    elif os.path.isfile(path) and path.lower().endswith(".gguf"):
        adapter = _load_gguf(path, spec)
    elif os.path.isfile(path) and path.lower().endswith(PICKLE_SUFFIXES):
        raise ModelLoadError(f"{path}: a PyTorch pickle; corelm never unpickles files. Save the adapter as "
                             f"safetensors (PEFT's save_pretrained does by default) or convert it to GGUF.")
    else:
        raise ModelLoadError(f"{path}: not a LoRA adapter (a PEFT folder with {PEFT_CONFIG} and {PEFT_WEIGHTS}, "
                             f"or a GGUF LoRA file)")
    adapter.scale *= float(scale)
    return adapter


# -- PEFT ----------------------------------------------------------------------------------------------
def _load_peft(folder: str, spec: ModelSpec) -> LoraAdapter:
    from .safetensors import SafetensorsFile
    config_path, weights_path = os.path.join(folder, PEFT_CONFIG), os.path.join(folder, PEFT_WEIGHTS)
    if not os.path.isfile(weights_path):
        if any(os.path.isfile(os.path.join(folder, f)) for f in ("adapter_model.bin", "adapter_model.pt")):
            raise ModelLoadError(f"{folder}: the adapter's weights are a PyTorch pickle (adapter_model.bin); corelm "
                                 f"never unpickles files. Save it with safe_serialization (PEFT's default).")
        raise ModelLoadError(f"{folder}: no {PEFT_WEIGHTS}")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{folder}: no {PEFT_CONFIG}")
    cfg = read_json(config_path, "the adapter's config")
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{config_path}: not a JSON object")
    where = config_path
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ModelLoadError(f"{where}: peft_type {peft_type!r}; corelm applies LoRA adapters only")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ModelLoadError(f"{where}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ModelLoadError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    if cfg.get("use_dora"):
        raise ModelLoadError(f"{where}: a DoRA adapter (use_dora); corelm applies plain LoRA only")
    if cfg.get("bias", "none") != "none":
        raise ModelLoadError(f"{where}: bias {cfg.get('bias')!r}; corelm applies adapters without biases "
                             f"(bias \"none\")")
    if cfg.get("fan_in_fan_out"):
        raise ModelLoadError(f"{where}: fan_in_fan_out (transposed Conv1D weights) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ModelLoadError(f"{where}: {key} gives modules their own rank or alpha; corelm takes one rank "
                                 f"and alpha per adapter")
    if cfg.get("modules_to_save"):
        raise ModelLoadError(f"{where}: modules_to_save {cfg['modules_to_save']!r} replaces whole modules; corelm "
                             f"applies low-rank products only")
    targets = cfg.get("target_modules") or []
    for t in [targets] if isinstance(targets, str) else targets:
        if isinstance(t, str) and t.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head", "wte", "tok_embeddings"):
            raise ModelLoadError(f"{where}: target module {t!r}: corelm adapts the attention and MLP projections "
                                 f"only, not embeddings or the output head")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    f = SafetensorsFile(weights_path)
    fam = family(spec.arch)
    pairs: Dict[str, Dict[str, np.ndarray]] = {}   # checkpoint module -> {"A": ..., "B": ...}
    for name in f.keys():
        module, which = _peft_module(name, weights_path)
        pairs.setdefault(module, {})[which] = f.get(name)
    targets_out: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    for module, ab in pairs.items():
        a, b = _pair(ab, module, weights_path)
        head = module
        for old, new in fam.hf_text_prefixes.items():
            if head.startswith(old):
                head = new + head[len(old):]
                break
        layer, rest = _layer_and_rest(head, fam.hf_layer_prefix)
        parts = _parts(fam.hf_layer, fam.hf_fused, rest + ".weight") if layer is not None else None
        if parts is None:
            raise ModelLoadError(f"{weights_path}: LoRA target {module!r} is not a projection corelm adapts "
                                 f"({', '.join(LORA_PARTS)} of each layer; not embeddings, lm_head or experts)")
        _add_targets(targets_out, spec, layer, parts, a, b, module, weights_path)
    return _adapter(weights_path, targets_out, scale, spec)


def _peft_module(name: str, source: str) -> Tuple[str, str]:
    """("model.layers.0.self_attn.q_proj", "A" | "B") of a PEFT tensor name."""
    body = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
    for which in ("A", "B"):
        for suffix in (f".lora_{which}.weight", f".lora_{which}.default.weight"):
            if body.endswith(suffix):
                return body[:-len(suffix)], which
    if "lora_magnitude_vector" in body:
        raise ModelLoadError(f"{source}: {name} is a DoRA magnitude vector; corelm applies plain LoRA only")
    if "lora_embedding" in body:
        raise ModelLoadError(f"{source}: {name} adapts an embedding; corelm adapts the attention and MLP "
                             f"projections only")
    raise ModelLoadError(f"{source}: tensor {name!r} is no LoRA A or B matrix (biases and saved modules are not "
                         f"supported)")


# -- GGUF (llama.cpp's convert_lora_to_gguf.py) --------------------------------------------------------------
def _load_gguf(path: str, spec: ModelSpec) -> LoraAdapter:
    from .gguf import read_gguf, unpermute_rope_rows
    g = read_gguf(path)
    meta = g.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ModelLoadError(f"{path}: not a GGUF LoRA adapter (general.type {meta.get('general.type')!r}, "
                             f"adapter.type {meta.get('adapter.type')!r}; want 'adapter' and 'lora')")
    fam = family(spec.arch)
    arch = meta.get("general.architecture")
    if arch in GGUF_ARCHS and family(GGUF_ARCHS[arch]).gguf_layer != fam.gguf_layer:
        raise ModelLoadError(f"{path}: an adapter for a {arch} model; this model is {spec.arch}")
    pairs: Dict[str, Dict[str, str]] = {}
    for name in g.tensors:
        for which, suffix in (("A", ".weight.lora_a"), ("B", ".weight.lora_b")):
            if name.endswith(suffix):
                pairs.setdefault(name[:-len(suffix)], {})[which] = name
                break
        else:
            raise ModelLoadError(f"{path}: tensor {name!r} is no LoRA lora_a or lora_b matrix")
    heads = {"wq": spec.num_heads, "wk": spec.num_kv_heads}
    targets: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
    rank = None
    for module, ab in pairs.items():
        a, b = _pair({k: g.dequantize(v) for k, v in ab.items()}, module, path)
        rank = rank or a.shape[0]
        layer, rest = _layer_and_rest(module, "blk.")
        parts = _parts(fam.gguf_layer, fam.gguf_fused, rest + ".weight") if layer is not None else None
        if parts is None:
            raise ModelLoadError(f"{path}: LoRA target {module!r} is not a projection corelm adapts "
                                 f"({', '.join(LORA_PARTS)} of each layer; not embeddings, the output head or experts)")
        if fam.gguf_permuted_qk and parts in (("wq",), ("wk",)):   # the converter permuted B's rows as the base's
            b = unpermute_rope_rows(b, heads[parts[0]])
        _add_targets(targets, spec, layer, parts, a, b, module, path)
    if rank is None:
        raise ModelLoadError(f"{path}: the adapter holds no LoRA tensors")
    alpha = meta.get("adapter.lora.alpha")
    if alpha is not None and (not isinstance(alpha, (int, float)) or not math.isfinite(alpha)):
        raise ModelLoadError(f"{path}: adapter.lora.alpha must be a number, got {alpha!r}")
    # llama.cpp: alpha / rank, or 1 where the file gives no alpha (0)
    return _adapter(path, targets, alpha / rank if alpha else 1.0, spec)


# -- shared --------------------------------------------------------------------------------------------------
def _pair(ab: Dict[str, np.ndarray], module: str, source: str) -> Tuple[np.ndarray, np.ndarray]:
    if set(ab) != {"A", "B"}:
        raise ModelLoadError(f"{source}: LoRA target {module!r} has {'A' if 'A' in ab else 'B'} without "
                             f"{'B' if 'A' in ab else 'A'}")
    a, b = np.asarray(ab["A"], dtype=np.float32), np.asarray(ab["B"], dtype=np.float32)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise ModelLoadError(f"{source}: LoRA target {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                             f"want A [rank, in] and B [out, rank]")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ModelLoadError(f"{source}: LoRA target {module!r} holds NaN or infinite values")
    return a, b


def _layer_and_rest(name: str, prefix: str):
    """(layer, name inside the layer) of "<prefix><i>.<rest>", (None, None) for any other name."""
    if not name.startswith(prefix):
        return None, None
    index, _, rest = name[len(prefix):].partition(".")
    return (int(index), rest) if index.isdigit() and index.isascii() and rest else (None, None)


def _parts(layer_names: Dict[str, str], fused: Dict[str, Tuple[str, ...]], tensor: str):
    """The internal projections a layer tensor name stands for (several for a fused tensor), None if none."""
    if tensor in fused:
        return fused[tensor]
    part = layer_names.get(tensor)
    return (part,) if part in LORA_PARTS else None


def _add_targets(out, spec: ModelSpec, layer: int, parts, a, b, module: str, source: str) -> None:
    """One checkpoint target's A and B as internal targets: a fused tensor's B split by rows, A shared."""
    if layer >= spec.num_layers:
        raise ModelLoadError(f"{source}: LoRA target {module!r} is in layer {layer}; the model has {spec.num_layers}")
    rows = [weight_shapes_rows(spec, p) if p != "wo" else spec.hidden_size for p in parts]
    if b.shape[0] != sum(rows):
        raise ModelLoadError(f"{source}: LoRA target {module!r} has B {tuple(b.shape)}, but the model's "
                             f"{'+'.join(parts)} has {sum(rows)} rows")
    r0 = 0
    for p, n in zip(parts, rows):
        name = f"layers.{layer}.{p}"
        if name in out:
            raise ModelLoadError(f"{source}: LoRA target {name} is given twice")
        out[name] = (a, np.ascontiguousarray(b[r0:r0 + n]))
        r0 += n


def _adapter(source: str, targets, scale: float, spec: ModelSpec) -> LoraAdapter:
    if not targets:
        raise ModelLoadError(f"{source}: the adapter holds no LoRA tensors")
    shapes = weight_shapes(spec)
    ranks = {a.shape[0] for a, _ in targets.values()}
    if len(ranks) != 1:
        raise ModelLoadError(f"{source}: the adapter's targets have ranks {sorted(ranks)}; corelm takes one rank "
                             f"per adapter")
    rank = ranks.pop()
    for name, (a, b) in targets.items():
        want = shapes.get(name)
        if want is None:   # a mixture of experts' MLP, or an encoder's missing gate
            raise ModelLoadError(f"{source}: LoRA target {name}: this model has no such projection")
        if a.shape != (rank, want[1]) or b.shape != (want[0], rank):
            raise ModelLoadError(f"{source}: LoRA target {name} has A {tuple(a.shape)} and B {tuple(b.shape)}; this "
                                 f"model's {name} is {tuple(want)}, so A must be ({rank}, {want[1]}) and B "
                                 f"({want[0]}, {rank})")
    return LoraAdapter(source, rank, float(scale), targets)
