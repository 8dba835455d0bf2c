"""The model families corelm runs, each described once: the names its HF config and GGUF file go by, the
tensor names of its checkpoints, and the features the forward pass switches on for it (ModelSpec's
feature fields; model/config.h in the core). The loaders read these descriptions; adding a family is
one entry here plus its tests."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

# HF tensor names inside a layer (model.layers.<i>.<name>) -> internal names, Llama's checkpoints.
_HF_LLAMA_LAYER = {
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv", "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm", "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down"}
_HF_QK_NORM = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
# Gemma 2/3 norm both sides of attention and MLP: HF's post_attention_layernorm is the norm *after*
# attention there, where in Llama it is the norm before the MLP.
_HF_GEMMA_NORMS = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
                   "pre_feedforward_layernorm.weight": "ffn_norm",
                   "post_feedforward_layernorm.weight": "post_ffn_norm"}

# GGUF tensor names inside a block (blk.<i>.<name>) -> internal names, as llama.cpp's converter writes them.
_GGUF_LLAMA_LAYER = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up", "ffn_down.weight": "w_down", "attn_q.bias": "bq", "attn_k.bias": "bk",
    "attn_v.bias": "bv"}
_GGUF_QK_NORM = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}
_GGUF_GEMMA_NORMS = {"post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_ffn_norm"}

# Fused checkpoint tensors split at load (Phi-3): their name -> (the internal parts, in row order).
QKV = ("wq", "wk", "wv")
GATE_UP = ("w_gate", "w_up")


@dataclass(frozen=True)
class Family:
    arch: str                           # corelm's name, ModelSpec.arch
    hf_classes: Tuple[str, ...]         # config.json "architectures" entries
    gguf_arch: Optional[str]            # GGUF general.architecture (None: stored under another family's)
    default_max_pos: int                # transformers' default max_position_embeddings
    hf_layer: Dict[str, str]            # HF layer tensor names -> internal names
    gguf_layer: Dict[str, str]          # GGUF block tensor names -> internal names
    hf_fused: Dict[str, Tuple[str, ...]] = field(default_factory=dict)    # HF fused tensor -> its parts
    gguf_fused: Dict[str, Tuple[str, ...]] = field(default_factory=dict)  # GGUF fused tensor -> its parts
    attention_bias: str = "never"       # "always" (Qwen2), "config" (Llama's attention_bias key), "never"
    qk_norm: bool = False               # RMSNorm on each q and k head before RoPE
    post_norms: bool = False            # RMSNorm on the attention and MLP outputs (Gemma 2/3)
    norm_plus_one: bool = False         # HF's RMSNorm scales by (1 + w); GGUF files store w + 1 already
    activation: str = "silu"            # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False           # embeddings times sqrt(hidden_size)
    softcaps: bool = False              # attention- and final-logit soft-capping (Gemma 2)
    query_pre_attn_scalar: bool = False  # the query scale is query_pre_attn_scalar ** -0.5 (Gemma)
    # Which layers attend only sliding_window tokens: "none", "all" (Mistral), "qwen2" (its
    # use_sliding_window / max_window_layers, all-or-nothing) or "pattern": layer i slides unless
    # (i + 1) % swa_pattern == 0, unless config.json lists layer_types.
    sliding: str = "none"
    swa_pattern: int = 0
    local_rope_theta: Optional[float] = None  # RoPE base of the sliding layers (Gemma 3's default)
    gguf_permuted_qk: bool = False      # llama.cpp permuted this arch's q/k rows (interleaved RoPE)
    # transformers' defaults for the config keys its class does not require (what a config.json that
    # omits them means)
    hf_defaults: Dict[str, object] = field(default_factory=dict)


_GEMMA_DEFAULTS = dict(head_dim=256, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                       rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")

FAMILIES: Dict[str, Family] = {f.arch: f for f in (
    Family("llama", ("LlamaForCausalLM",), "llama", 2048, _HF_LLAMA_LAYER, _GGUF_LLAMA_LAYER,
           attention_bias="config", gguf_permuted_qk=True),
    # llama.cpp stores Mistral models as "llama"
    Family("mistral", ("MistralForCausalLM",), None, 4096 * 32, _HF_LLAMA_LAYER, _GGUF_LLAMA_LAYER,
           sliding="all"),
    Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", 32768, _HF_LLAMA_LAYER, _GGUF_LLAMA_LAYER,
           attention_bias="always", sliding="qwen2"),
    Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", 32768, {**_HF_LLAMA_LAYER, **_HF_QK_NORM},
           {**_GGUF_LLAMA_LAYER, **_GGUF_QK_NORM}, attention_bias="config", qk_norm=True, sliding="qwen2",
           hf_defaults=dict(head_dim=128, rms_norm_eps=1e-6)),
    Family("gemma2", ("Gemma2ForCausalLM",), "gemma2", 8192,
           {**_HF_LLAMA_LAYER, **_HF_GEMMA_NORMS}, {**_GGUF_LLAMA_LAYER, **_GGUF_GEMMA_NORMS},
           post_norms=True, norm_plus_one=True, activation="gelu_tanh", embed_scale=True, softcaps=True,
           query_pre_attn_scalar=True, sliding="pattern", swa_pattern=2,
           hf_defaults=dict(_GEMMA_DEFAULTS, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    Family("gemma3", ("Gemma3ForCausalLM",), "gemma3", 131072,
           {**_HF_LLAMA_LAYER, **_HF_GEMMA_NORMS, **_HF_QK_NORM},
           {**_GGUF_LLAMA_LAYER, **_GGUF_GEMMA_NORMS, **_GGUF_QK_NORM},
           qk_norm=True, post_norms=True, norm_plus_one=True, activation="gelu_tanh", embed_scale=True,
           softcaps=True, query_pre_attn_scalar=True, sliding="pattern", swa_pattern=6,
           local_rope_theta=10000.0, hf_defaults=dict(_GEMMA_DEFAULTS, rope_theta=1000000.0)),
    Family("phi3", ("Phi3ForCausalLM",), "phi3", 4096, _HF_LLAMA_LAYER,
           {k: v for k, v in _GGUF_LLAMA_LAYER.items() if k != "ffn_up.weight"},
           hf_fused={"self_attn.qkv_proj.weight": QKV, "mlp.gate_up_proj.weight": GATE_UP},
           gguf_fused={"attn_qkv.weight": QKV, "ffn_up.weight": GATE_UP}, sliding="all"),
)}

SUPPORTED_ARCHS = tuple(FAMILIES)
HF_CLASSES = {c: f.arch for f in FAMILIES.values() for c in f.hf_classes}
GGUF_ARCHS = {f.gguf_arch: f.arch for f in FAMILIES.values() if f.gguf_arch}


def family(arch: str) -> Family:
    return FAMILIES[arch]
