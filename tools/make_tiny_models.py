#!/usr/bin/env python3
"""Build the tiny random-weight HF test models in tests/data/models/ with transformers.

    /work/refvenv/bin/python tools/make_tiny_models.py            # writes tests/data/models/tiny-*/
    /work/refvenv/bin/python tools/make_tiny_models.py --out DIR  # somewhere else
    /work/refvenv/bin/python tools/make_tiny_models.py tiny-olmoe ... # only the named models

Needs a reference venv with torch==2.13.0 (CPU) and transformers (see tools/README.md). Deterministic: each
model is seeded, so re-running reproduces the same bytes for the same torch/transformers versions.

Each folder holds config.json, generation_config.json, model.safetensors (float32), and the stories260K
tokenizer (tokenizer.json / tokenizer_config.json, vocab 512: BOS 1, EOS 2, UNK 0).

  tiny-mistral  MistralForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, FFN 160,
                vocab 512, sliding_window null, rope_theta 10000, untied lm_head.
  tiny-qwen2    Qwen2ForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, FFN 160, vocab 512,
                q/k/v biases (Qwen2 always has them; o_proj has none), rope_theta 1e6, untied lm_head.
  tiny-llama3   LlamaForCausalLM: hidden 64, 3 layers, 4 heads / 1 KV head (MQA), head_dim 32 (so
                n_heads*head_dim = 128 != hidden), FFN 128, vocab 512, tied embeddings, rope_theta 5e5,
                llama3 RoPE scaling (factor 8, low 1, high 4, original_max_position_embeddings 64),
                max_position_embeddings 1024.

  tiny-qwen3    Qwen3ForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 32, FFN 160, q/k head norms.
  tiny-gemma2   Gemma2ForCausalLM: hidden 64, 4 layers alternating sliding (window 8) and global, 4 heads / 2 KV,
                head_dim 16, FFN 128, GeGLU, post-norms, attention soft-cap 5, final soft-cap 20, tied.
  tiny-gemma3   Gemma3ForCausalLM: hidden 64, 6 layers (5 sliding with window 8 and RoPE base 1e4, the 6th
                global with base 1e6 and linear scaling 4), 4 heads / 1 KV, head_dim 32, q/k head norms, tied.
  tiny-gemma3-vl Gemma3ForConditionalGeneration (Gemma 3 4B/12B/27B's class): tiny-gemma3's text model under
                "text_config" (same seed, so the same text weights, saved as model.language_model.*) beside a
                tiny SigLIP vision tower (hidden 16, 1 layer, 2 heads, 28x28 images of 14x14 patches) and its
                projector (4 tokens per image), which corelm ignores.
  tiny-phi3     Phi3ForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV, FFN 128, fused qkv and gate/up,
                partial rotary 0.75, LongRoPE (original context 128 of 512).

  tiny-qwen3moe Qwen3MoeForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 32, q/k head norms,
                every layer MoE: 8 experts, top-2, expert FFN 48 (moe_intermediate_size; intermediate_size 160
                unused), norm_topk_prob true, rope_theta 1e6, untied lm_head.
  tiny-mixtral  MixtralForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, 8 experts, top-2
                (weights renormalised over the top 2), expert FFN 48, sliding_window null, rope_theta 1e6, untied.
  tiny-olmoe    OlmoeForCausalLM: hidden 64, 2 layers, 4 heads / 4 KV heads (MHA), head_dim 16, q/k RMSNorms
                over the whole q (64) and k (64) projections, 8 experts, top-2, expert FFN 48,
                norm_topk_prob false, clip_qkv null, rope_theta 1e4, untied.
Gemma's norms are drawn as 1 + N(0, 0.1) like the others: its RMSNorm scales by (1 + w), so about 2.

Weights are drawn much larger than transformers' init (std 0.02) so the logits are peaked and greedy decoding
is non-trivial: linear weights N(0, 0.15), embeddings N(0, 1) (N(0, 0.2) when tied, as it is also the LM
head), lm_head N(0, 0.3), biases N(0, 0.2), RMSNorm weights 1 + N(0, 0.1). MoE experts are drawn like the
dense MLPs, N(0, 0.15); the routers (mlp.gate, [n_experts, hidden]) are drawn N(0, ROUTER_STD), 10x
transformers' init, so routing is decisive (router logits of std ~1.6 over an RMSNorm output of scale ~1; larger
would make the top-1 expert swallow the softmax and squeeze the k-th/(k+1)-th probability gap that
make_fixtures.py requires to be > 1e-3 along every fixture run, so that an fp32 engine summing in another order
picks the same top-k experts).

config.json is written by transformers 5 (RoPE settings under "rope_parameters"); the classic keys that
HF-hub configs carry (rope_theta, rope_scaling, head_dim, torch_dtype, ...) are added next to it, so a loader
that only knows the transformers-4 layout reads the same values.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                          Gemma3ForConditionalGeneration, Gemma3TextConfig, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          OlmoeConfig, OlmoeForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(REPO, "tests", "data", "models", "stories260K")

COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2, pad_token_id=None, hidden_act="silu", attention_dropout=0.0)

MODELS = {
    "tiny-mistral": dict(
        seed=1001, cls=MistralForCausalLM, cfg_cls=MistralConfig,
        cfg=dict(COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=160,
                 max_position_embeddings=2048, sliding_window=None, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        legacy=dict(rope_theta=10000.0, rope_scaling=None)),
    "tiny-qwen2": dict(
        seed=1002, cls=Qwen2ForCausalLM, cfg_cls=Qwen2Config,
        cfg=dict(COMMON, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=160,
                 max_position_embeddings=4096, use_sliding_window=False, sliding_window=None, max_window_layers=2,
                 tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        legacy=dict(rope_theta=1000000.0, rope_scaling=None)),
    "tiny-llama3": dict(
        seed=1003, cls=LlamaForCausalLM, cfg_cls=LlamaConfig,
        cfg=dict(COMMON, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                 max_position_embeddings=1024, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}),
        legacy=dict(rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "tiny-qwen3": dict(
        seed=1004, cls=Qwen3ForCausalLM, cfg_cls=Qwen3Config,
        cfg=dict(COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=32, intermediate_size=160,
                 max_position_embeddings=4096, use_sliding_window=False, sliding_window=None, max_window_layers=2,
                 tie_word_embeddings=False, attention_bias=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        legacy=dict(rope_theta=1000000.0, rope_scaling=None)),
    "tiny-gemma2": dict(
        seed=1005, cls=Gemma2ForCausalLM, cfg_cls=Gemma2Config, norm_mean=1.0, emb_std=0.1,
        cfg=dict(COMMON, hidden_act=None, hidden_activation="gelu_pytorch_tanh", num_hidden_layers=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=8192,
                 sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=20.0,
                 tie_word_embeddings=True, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        legacy=dict(rope_theta=10000.0, rope_scaling=None)),
    "tiny-gemma3": dict(
        seed=1006, cls=Gemma3ForCausalLM, cfg_cls=Gemma3TextConfig, norm_mean=1.0, emb_std=0.1,
        cfg=dict(COMMON, hidden_act=None, hidden_activation="gelu_pytorch_tanh", num_hidden_layers=6,
                 num_key_value_heads=1, head_dim=32, intermediate_size=128, max_position_embeddings=32768,
                 sliding_window=8, query_pre_attn_scalar=32, final_logit_softcapping=None,
                 attn_logit_softcapping=None, tie_word_embeddings=True, rms_norm_eps=1e-6,
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
        legacy=dict(rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
                    rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "tiny-phi3": dict(
        seed=1007, cls=Phi3ForCausalLM, cfg_cls=Phi3Config,
        cfg=dict(COMMON, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=128,
                 max_position_embeddings=512, original_max_position_embeddings=128, sliding_window=None,
                 tie_word_embeddings=False, pad_token_id=0,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "original_max_position_embeddings": 128,
                                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                  "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}),
        legacy=dict(rope_theta=10000.0, partial_rotary_factor=0.75, original_max_position_embeddings=128,
                    rope_scaling={"type": "longrope",
                                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                  "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})),
    "tiny-qwen3moe": dict(
        seed=1008, cls=Qwen3MoeForCausalLM, cfg_cls=Qwen3MoeConfig,
        cfg=dict(COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=32, intermediate_size=160,
                 moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, use_sliding_window=False,
                 sliding_window=None, tie_word_embeddings=False, attention_bias=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        legacy=dict(rope_theta=1000000.0, rope_scaling=None, num_experts=8)),  # transformers 5 writes num_local_experts
    "tiny-mixtral": dict(
        seed=1009, cls=MixtralForCausalLM, cfg_cls=MixtralConfig,
        cfg=dict(COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                 num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096, sliding_window=None,
                 tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        legacy=dict(rope_theta=1000000.0, rope_scaling=None)),
    "tiny-olmoe": dict(
        seed=1011, cls=OlmoeForCausalLM, cfg_cls=OlmoeConfig,
        cfg=dict(COMMON, num_hidden_layers=2, num_key_value_heads=4, intermediate_size=48, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None, max_position_embeddings=4096,
                 tie_word_embeddings=False, attention_bias=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        legacy=dict(rope_theta=10000.0, rope_scaling=None)),
}
# tiny-gemma3's text model (its seed: the same text weights) inside Gemma 3's multimodal class; "wrap": the outer
# config's class, the key that holds the text config, and the outer config's other keys
MODELS["tiny-gemma3-vl"] = dict(
    MODELS["tiny-gemma3"], cls=Gemma3ForConditionalGeneration,
    wrap=dict(cfg_cls=Gemma3Config, key="text_config", mm_tokens_per_image=4,
              vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                                 vision_use_head=False)))
ROUTER_STD = 0.2
VISION_STD = 0.02   # a multimodal model's vision tower and projector: never run by the text-only fixtures


def init_weights(model: torch.nn.Module, tied: bool, seed: int, norm_mean: float = 1.0, emb_std=None) -> None:
    g = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean)

    with torch.no_grad():
        # named_parameters() lists a tied tensor once; the vision tower's names sort after the text model's
        # (model.language_model.*), so a multimodal model draws the same text weights as its text-only twin
        for name, p in sorted(model.named_parameters()):
            if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
                normal(p, VISION_STD)
            elif name.endswith("embed_tokens.weight"):
                normal(p, emb_std or (0.2 if tied else 1.0))
            elif name == "lm_head.weight":
                normal(p, 0.3)
            elif "norm" in name:
                normal(p, 0.1, mean=norm_mean)
            elif name.endswith(".bias"):
                normal(p, 0.2)
            elif name.endswith(".gate.weight") and p.dim() == 2:  # MoE router [n_experts, hidden]
                normal(p, ROUTER_STD)
            elif ".experts." in name and p.dim() == 3:  # fused experts [n_experts, out, in]
                normal(p, 0.15)
            elif name.endswith(".weight") and p.dim() == 2:
                normal(p, 0.15)
            else:
                raise RuntimeError(f"unexpected parameter {name} {tuple(p.shape)}")


def add_legacy_keys(path: str, cfg: dict, legacy: dict, nested=None) -> dict:
    """Write the transformers-4 style keys next to transformers 5's rope_parameters (in config[nested], the text
    model's config of a multimodal class)."""
    top = json.load(open(path))
    c = top[nested] if nested else top
    c.update(legacy)
    c["head_dim"] = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    c.pop("rope_parameters", None) if "rope_local_base_freq" in legacy else None  # Gemma 3's hub layout
    for k in ("num_key_value_heads", "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps",
              "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "hidden_size"):
        c[k] = cfg[k]
    if "sliding_window" in cfg:
        c["sliding_window"] = cfg["sliding_window"]
    top.setdefault("torch_dtype", top.get("dtype", "float32"))
    with open(path, "w") as f:
        json.dump(top, f, indent=2)
        f.write("\n")
    return c


def build(name: str, spec: dict, out_root: str) -> None:
    out = os.path.join(out_root, name)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(spec["seed"])
    cfg = spec["cfg_cls"](**{k: v for k, v in spec["cfg"].items() if v is not None or k != "hidden_act"})
    wrap = spec.get("wrap")
    if wrap:  # a multimodal class: the text config nested in the outer one
        outer = {k: v for k, v in wrap.items() if k not in ("cfg_cls", "key")}
        cfg = wrap["cfg_cls"](**{wrap["key"]: cfg}, tie_word_embeddings=spec["cfg"]["tie_word_embeddings"], **outer)
    model = spec["cls"](cfg).to(torch.float32).eval()
    init_weights(model, spec["cfg"]["tie_word_embeddings"], spec["seed"], spec.get("norm_mean", 1.0),
                 spec.get("emb_std"))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(STORIES, f), os.path.join(out, f))
    c = add_legacy_keys(os.path.join(out, "config.json"), spec["cfg"], spec["legacy"], wrap and wrap["key"])
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {type(model).__name__}, {n:,} parameters, rope {c.get('rope_parameters')} -> {out}")

    # sanity: greedy decoding from a fixed prompt should not collapse to one repeated token
    ids = torch.tensor([[1, 300, 45, 77, 210]])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24, pad_token_id=0)
    tail = gen[0, ids.shape[1]:].tolist()
    print(f"  greedy sample: {tail} ({len(set(tail))} distinct)")
    if len(set(tail)) < 8:
        raise SystemExit(f"{name}: greedy output is degenerate, change the seed or the init scale")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "models"))
    ap.add_argument("names", nargs="*", default=list(MODELS))
    args = ap.parse_args()
    for n in args.names:
        build(n, MODELS[n], args.out)


if __name__ == "__main__":
    main()
