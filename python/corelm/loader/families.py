"""The model families corelm runs, each described once: the names its HF config and GGUF file go by, the
tensor names of its checkpoints, and the features the forward pass switches on for it (ModelSpec's
feature fields; model/config.h in the core). The loaders read these descriptions; adding a family is
one entry here plus its tests."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

# HF tensor names inside a layer (model.layers.<i>.<name>) -> internal names, Llama's checkpoints.
_HF_LLAMA_ATTN = {
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv", "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm"}
_HF_LLAMA_LAYER = {**_HF_LLAMA_ATTN, "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
                   "mlp.down_proj.weight": "w_down"}
_HF_QK_NORM = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
# Gemma 2/3 norm both sides of attention and MLP: HF's post_attention_layernorm is the norm *after*
# attention there, where in Llama it is the norm before the MLP.
_HF_GEMMA_NORMS = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
                   "pre_feedforward_layernorm.weight": "ffn_norm",
                   "post_feedforward_layernorm.weight": "post_ffn_norm"}

# Multimodal checkpoints in transformers' "llava" layout (Gemma 3 4B/12B/27B): the text model's tensors under
# language_model.model.* and language_model.lm_head (hub checkpoints, and what transformers 5's save_pretrained
# writes) or model.language_model.* and lm_head (as transformers 5 computes) -> the text-only checkpoint's
# names; the vision tower and its projector, which corelm does not run, are skipped.
_HF_LLAVA = dict(hf_text_config="text_config",
                 hf_text_prefixes={"language_model.model.": "model.", "model.language_model.": "model.",
                                   "language_model.lm_head.": "lm_head."},
                 hf_towers=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                            "model.multi_modal_projector."))

# GGUF tensor names inside a block (blk.<i>.<name>) -> internal names, as llama.cpp's converter writes them.
_GGUF_LLAMA_ATTN = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm", "attn_q.bias": "bq", "attn_k.bias": "bk",
    "attn_v.bias": "bv"}
_GGUF_LLAMA_LAYER = {**_GGUF_LLAMA_ATTN, "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up",
                     "ffn_down.weight": "w_down"}
_GGUF_QK_NORM = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}
_GGUF_GEMMA_NORMS = {"post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_ffn_norm"}

# Whole-model tensors -> internal names: decoders' checkpoints (Llama's names) and GGUF files.
_HF_DECODER_GLOBAL = {"model.embed_tokens.weight": "tok_embeddings", "model.norm.weight": "norm",
                      "lm_head.weight": "lm_head"}
_GGUF_DECODER_GLOBAL = {"token_embd.weight": "tok_embeddings", "output_norm.weight": "norm", "output.weight": "lm_head"}

# BERT encoders (sentence-transformers' checkpoints, and BertModel's under "bert."): LayerNorm after each
# residual add, so the attention block's norm (attn_norm) is its output LayerNorm and the MLP's (ffn_norm)
# the layer's output LayerNorm; the MLP has no gate (w_up, then GELU, then w_down), every projection a bias.
_HF_BERT_GLOBAL = {"embeddings.word_embeddings.weight": "tok_embeddings",
                   "embeddings.position_embeddings.weight": "pos_embeddings",
                   "embeddings.token_type_embeddings.weight": "type_embeddings",
                   "embeddings.LayerNorm.weight": "embed_norm", "embeddings.LayerNorm.bias": "embed_norm_bias"}
_HF_BERT_LAYER = {
    "attention.self.query.weight": "wq", "attention.self.key.weight": "wk", "attention.self.value.weight": "wv",
    "attention.self.query.bias": "bq", "attention.self.key.bias": "bk", "attention.self.value.bias": "bv",
    "attention.output.dense.weight": "wo", "attention.output.dense.bias": "bo",
    "attention.output.LayerNorm.weight": "attn_norm", "attention.output.LayerNorm.bias": "attn_norm_bias",
    "intermediate.dense.weight": "w_up", "intermediate.dense.bias": "b_up",
    "output.dense.weight": "w_down", "output.dense.bias": "b_down",
    "output.LayerNorm.weight": "ffn_norm", "output.LayerNorm.bias": "ffn_norm_bias"}
_GGUF_BERT_GLOBAL = {"token_embd.weight": "tok_embeddings", "position_embd.weight": "pos_embeddings",
                     "token_types.weight": "type_embeddings", "token_embd_norm.weight": "embed_norm",
                     "token_embd_norm.bias": "embed_norm_bias"}
_GGUF_BERT_LAYER = {
    "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv", "attn_q.bias": "bq", "attn_k.bias": "bk",
    "attn_v.bias": "bv", "attn_output.weight": "wo", "attn_output.bias": "bo", "attn_output_norm.weight": "attn_norm",
    "attn_output_norm.bias": "attn_norm_bias", "ffn_up.weight": "w_up", "ffn_up.bias": "b_up",
    "ffn_down.weight": "w_down", "ffn_down.bias": "b_down", "layer_output_norm.weight": "ffn_norm",
    "layer_output_norm.bias": "ffn_norm_bias"}

# Fused checkpoint tensors split at load (Phi-3): their name -> (the internal parts, in row order).
QKV = ("wq", "wk", "wv")
GATE_UP = ("w_gate", "w_up")

# Mixture of experts. A layer's router is layers.<i>.router; expert e's MLP is layers.<i>.experts.<e>.w_gate,
# w_up and w_down. HF checkpoints hold one tensor per expert ({e} in the name: the expert's index) or, as
# transformers 5 computes with, 3D tensors [expert, rows, cols] stacking every expert's parts; GGUF files
# hold the 3D ones.
_HF_MOE_ROUTER = {"mlp.gate.weight": "router"}
_HF_MOE_EXPERTS = {"mlp.experts.{e}.gate_proj.weight": "w_gate", "mlp.experts.{e}.up_proj.weight": "w_up",
                   "mlp.experts.{e}.down_proj.weight": "w_down"}
_HF_MOE_STACKED = {"mlp.experts.gate_up_proj": GATE_UP, "mlp.experts.down_proj": ("w_down",)}
_GGUF_MOE = {"ffn_gate_inp.weight": "router"}
_GGUF_MOE_STACKED = {"ffn_gate_exps.weight": ("w_gate",), "ffn_up_exps.weight": ("w_up",),
                     "ffn_down_exps.weight": ("w_down",), "ffn_gate_up_exps.weight": GATE_UP}


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
    qk_norm_whole: bool = False         # RMSNorm over the whole q and the whole k projection (OLMoE)
    # Mixture of experts: every layer's MLP is experts a router picks (ModelSpec.num_experts > 0).
    moe: bool = False
    hf_experts: Dict[str, str] = field(default_factory=dict)  # HF per-expert tensor ({e}: index) -> its part
    hf_stacked: Dict[str, Tuple[str, ...]] = field(default_factory=dict)    # HF 3D expert tensor -> its parts
    gguf_stacked: Dict[str, Tuple[str, ...]] = field(default_factory=dict)  # GGUF 3D expert tensor -> its parts
    # The config key and the GGUF key (after "<arch>.") of the MLP's size (an expert's, with experts).
    ffn_keys: Tuple[str, str] = ("intermediate_size", "feed_forward_length")
    # Renormalise the top-k routing weights to sum to 1: "always" (Mixtral) or "config" (norm_topk_prob),
    # and what a GGUF file that does not say (<arch>.expert_weights_norm) means: llama.cpp's choice.
    norm_topk: str = "always"
    gguf_norm_topk: bool = True
    gguf_moe_of: Optional[str] = None   # a GGUF arch that stores this family when it has experts (Mixtral: llama)
    post_norms: bool = False            # RMSNorm on the attention and MLP outputs (Gemma 2/3)
    norm_plus_one: bool = False         # HF's RMSNorm scales by (1 + w); GGUF files store w + 1 already
    activation: str = "silu"            # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False           # embeddings times sqrt(hidden_size)
    softcaps: bool = False              # attention- and final-logit soft-capping (Gemma 2)
    query_pre_attn_scalar: bool = False  # the query scale is query_pre_attn_scalar ** -0.5 (Gemma)
    # Which layers attend only sliding_window tokens: "none", "all" (Mistral), "flag" (all of them when
    # use_sliding_window is set), "qwen2" (its use_sliding_window / max_window_layers, all-or-nothing) or
    # "pattern": layer i slides unless (i + 1) % swa_pattern == 0, unless config.json lists layer_types.
    sliding: str = "none"
    swa_pattern: int = 0
    local_rope_theta: Optional[float] = None  # RoPE base of the sliding layers (Gemma 3's default)
    gguf_permuted_qk: bool = False      # llama.cpp permuted this arch's q/k rows (interleaved RoPE)
    # transformers' defaults for the config keys its class does not require (what a config.json that
    # omits them means; a multimodal class's text config too)
    hf_defaults: Dict[str, object] = field(default_factory=dict)
    # Multimodal classes among hf_classes (text plus a vision tower; corelm runs the text model alone): the
    # config.json key that holds the text model's config, checkpoint tensor-name prefixes of the text model ->
    # the text-only checkpoint's, and the prefixes of the other towers' tensors, which are skipped.
    hf_text_config: Optional[str] = None
    hf_text_prefixes: Dict[str, str] = field(default_factory=dict)
    hf_towers: Tuple[str, ...] = ()
    # Where the checkpoint keeps its whole-model tensors and its layers ("<prefix><i>.<name>")
    hf_global: Dict[str, str] = field(default_factory=lambda: dict(_HF_DECODER_GLOBAL))
    hf_layer_prefix: str = "model.layers."
    gguf_global: Dict[str, str] = field(default_factory=lambda: dict(_GGUF_DECODER_GLOBAL))
    # An encoder (BERT): every token attends to the whole input, learned absolute positions and token
    # types, LayerNorm with biases after each residual add, a gateless GELU MLP, biases on every
    # projection, no lm_head (the hidden states are pooled into embeddings)
    encoder: bool = False


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
    # Gemma 3 1B is a Gemma3ForCausalLM; 4B, 12B and 27B are Gemma3ForConditionalGeneration (images unsupported)
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), "gemma3", 131072,
           {**_HF_LLAMA_LAYER, **_HF_GEMMA_NORMS, **_HF_QK_NORM},
           {**_GGUF_LLAMA_LAYER, **_GGUF_GEMMA_NORMS, **_GGUF_QK_NORM},
           qk_norm=True, post_norms=True, norm_plus_one=True, activation="gelu_tanh", embed_scale=True,
           softcaps=True, query_pre_attn_scalar=True, sliding="pattern", swa_pattern=6,
           local_rope_theta=10000.0, **_HF_LLAVA,
           # Gemma3TextConfig's; the multimodal checkpoints' text_config omits most of them
           hf_defaults=dict(_GEMMA_DEFAULTS, rope_theta=1000000.0, vocab_size=262208, num_attention_heads=8,
                            num_key_value_heads=4, bos_token_id=2, eos_token_id=1)),
    Family("phi3", ("Phi3ForCausalLM",), "phi3", 4096, _HF_LLAMA_LAYER,
           {k: v for k, v in _GGUF_LLAMA_LAYER.items() if k != "ffn_up.weight"},
           hf_fused={"self_attn.qkv_proj.weight": QKV, "mlp.gate_up_proj.weight": GATE_UP},
           gguf_fused={"attn_qkv.weight": QKV, "ffn_up.weight": GATE_UP}, sliding="all"),
    # llama.cpp stores Mixtral as "llama" with an expert count. Its checkpoints name the MoE block
    # block_sparse_moe; transformers 5 computes with it renamed mlp, its experts stacked.
    Family("mixtral", ("MixtralForCausalLM",), None, 4096 * 32,
           {**_HF_LLAMA_ATTN, **_HF_MOE_ROUTER, "block_sparse_moe.gate.weight": "router"},
           {**_GGUF_LLAMA_ATTN, **_GGUF_MOE}, sliding="all", gguf_permuted_qk=True, moe=True,
           hf_experts={f"block_sparse_moe.experts.{{e}}.{w}.weight": p
                       for w, p in (("w1", "w_gate"), ("w3", "w_up"), ("w2", "w_down"))},
           hf_stacked=_HF_MOE_STACKED, gguf_stacked=_GGUF_MOE_STACKED, gguf_moe_of="llama",
           hf_defaults=dict(num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5)),
    # transformers 5 slides every layer when use_sliding_window is set (no max_window_layers)
    Family("qwen3moe", ("Qwen3MoeForCausalLM",), "qwen3moe", 32768,
           {**_HF_LLAMA_ATTN, **_HF_QK_NORM, **_HF_MOE_ROUTER}, {**_GGUF_LLAMA_ATTN, **_GGUF_QK_NORM, **_GGUF_MOE},
           attention_bias="config", qk_norm=True, sliding="flag", moe=True, hf_experts=_HF_MOE_EXPERTS,
           hf_stacked=_HF_MOE_STACKED, gguf_stacked=_GGUF_MOE_STACKED,
           ffn_keys=("moe_intermediate_size", "expert_feed_forward_length"), norm_topk="config",
           hf_defaults=dict(rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8, norm_topk_prob=False,
                            moe_intermediate_size=768)),
    Family("bert", ("BertModel", "BertForMaskedLM"), "bert", 512, _HF_BERT_LAYER, _GGUF_BERT_LAYER,
           attention_bias="always", activation="gelu", encoder=True, hf_global=_HF_BERT_GLOBAL,
           hf_layer_prefix="encoder.layer.", gguf_global=_GGUF_BERT_GLOBAL,
           hf_text_prefixes={"bert.": ""}, hf_towers=("pooler.", "cls.", "bert.pooler."),
           hf_defaults=dict(layer_norm_eps=1e-12, type_vocab_size=2, hidden_act="gelu",
                            position_embedding_type="absolute")),
    Family("olmoe", ("OlmoeForCausalLM",), "olmoe", 4096,
           {**_HF_LLAMA_ATTN, **_HF_QK_NORM, **_HF_MOE_ROUTER}, {**_GGUF_LLAMA_ATTN, **_GGUF_QK_NORM, **_GGUF_MOE},
           attention_bias="config", qk_norm_whole=True, moe=True, hf_experts=_HF_MOE_EXPERTS,
           hf_stacked=_HF_MOE_STACKED, gguf_stacked=_GGUF_MOE_STACKED, norm_topk="config", gguf_norm_topk=False,
           hf_defaults=dict(rms_norm_eps=1e-5, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False)),
)}

SUPPORTED_ARCHS = tuple(FAMILIES)
HF_CLASSES = {c: f.arch for f in FAMILIES.values() for c in f.hf_classes}
GGUF_ARCHS = {f.gguf_arch: f.arch for f in FAMILIES.values() if f.gguf_arch}
GGUF_MOE_ARCHS = {f.gguf_moe_of: f.arch for f in FAMILIES.values() if f.gguf_moe_of}  # arch with experts -> family


def family(arch: str) -> Family:
    return FAMILIES[arch]


def expert_tensor(fam: Family, name: str) -> Optional[Tuple[int, str]]:
    """(expert index, internal part) of a per-expert HF layer tensor name ("mlp.experts.3.up_proj.weight"),
    None for any other name."""
    head, sep, rest = name.partition(".experts.")
    index, _, tail = rest.partition(".")
    if not sep or not index.isdigit() or not index.isascii():
        return None
    part = fam.hf_experts.get(f"{head}.experts.{{e}}.{tail}")
    return (int(index), part) if part else None
