"""Simulates KV-cache quantization schemes inside a transformers model (fp32 everywhere else) and
measures what each costs: the per-element error of K and V, the logit error against the fp32 cache
(teacher-forced on the fp32 greedy tokens) and whether greedy decoding would change.

Needs torch and transformers (e.g. ~/corelm-peers/venv/bin/python).
  python tools/kv_quant_sim.py MODEL_DIR_OR_GGUF [--tokens 256] [--schemes bf16 i8 i8-had ...]
"""
import argparse
import math
import os

import numpy as np
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CHAT = ["Write a short story about a robot who learns to paint.",
        "Explain how a hash map works, step by step.",
        "What are three good reasons to learn a second language?",
        "Write a Python function that checks whether a string is a palindrome."]
STORIES = [[1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426],
           [1, 274, 287, 381, 261, 370, 352, 266, 268, 388, 426, 346],
           [1, 403, 407, 261, 378, 432, 322, 261, 262, 423, 388, 410, 435, 290, 421],
           [1, 274, 287, 381, 261, 403]]


def hadamard(n):
    """Orthonormal Walsh-Hadamard matrix (n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def q_sym(x, clip=1.0):
    """Symmetric int8, one fp32 scale per row: scale = clip * absmax / 127, round to nearest."""
    amax = x.abs().amax(-1, keepdim=True) * clip
    s = amax / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return torch.clamp(torch.round(x * inv), -127, 127) * s


def q_sym_mse(x):
    """Symmetric int8 with the clip (of the absmax) that minimizes each row's squared error."""
    best, best_err = None, None
    for c in np.linspace(0.5, 1.0, 51):
        y = q_sym(x, float(c))
        err = ((y - x) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, best_err = y, err
        else:
            m = err < best_err
            best, best_err = torch.where(m, y, best), torch.where(m, err, best_err)
    return best


def q_asym(x):
    """Asymmetric 8-bit: a scale and a zero point (the row minimum) per row, levels 0..255."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = (hi - lo) / 255
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return torch.clamp(torch.round((x - lo) * inv), 0, 255) * s + lo


def rotated(fn):
    def g(x):
        h = hadamard(x.shape[-1]).to(x.dtype)
        return fn(x @ h.T) @ h
    return g


BASE = {"fp32": lambda x: x, "bf16": lambda x: x.bfloat16().float(), "fp16": lambda x: x.half().float(),
        "i8": q_sym, "i8-mse": q_sym_mse, "i8-asym": q_asym}
SCHEMES = dict(BASE)
for _n in ("i8", "i8-mse", "i8-asym"):
    SCHEMES[_n + "-had"] = rotated(BASE[_n])


class Sim:
    def __init__(self):
        self.k = self.v = SCHEMES["fp32"]
        self.stats = []

    def attn(self, module, query, key, value, attention_mask, **kw):
        kq, vq = self.k(key), self.v(value)
        for name, a, b in (("K", key, kq), ("V", value, vq)):
            e = (b - a)
            self.stats.append((name, float((e ** 2).mean().sqrt() / (a ** 2).mean().sqrt()),
                               float((e.abs() / a.abs().amax(-1, keepdim=True).clamp_min(1e-30)).max())))
        return sdpa_attention_forward(module, query, kq, vq, attention_mask, **kw)


SIM = Sim()
AttentionInterface.register("kvsim", SIM.attn)


def load(path):
    if path.endswith(".gguf"):
        d, f = os.path.split(path)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="kvsim")
    else:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="kvsim")
    return tok, model.eval()


def prompts(tok, path, n):
    if "stories" in path:
        return STORIES[:n]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in CHAT[:n]]


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--schemes", nargs="+", default=["bf16", "i8", "i8-mse", "i8-asym", "i8-had", "i8-mse-had",
                                                       "i8-asym-had"])
    ap.add_argument("--split", action="store_true", help="also quantize K only and V only")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tok, model = load(a.model)
    for pi, prompt in enumerate(prompts(tok, a.model, a.prompts)):
        prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
        SIM.k = SIM.v = SCHEMES["fp32"]
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=a.tokens, do_sample=False, min_new_tokens=a.tokens)
        full = out[:, :-1]
        ref = model(full).logits[0, len(prompt) - 1:].float()
        ref_tok = ref.argmax(-1)
        top2 = ref.topk(2, -1).values
        gaps = top2[:, 0] - top2[:, 1]
        print(f"p{pi}: {len(prompt)} prompt tokens, min fp32 top-2 gap {gaps.min():.4f} at step {int(gaps.argmin())}, "
              f"gaps < 0.01: {int((gaps < 0.01).sum())}, < 0.05: {int((gaps < 0.05).sum())}")
        variants = [(s, s, s) for s in a.schemes]
        if a.split:
            variants += [(s + " K only", s, "fp32") for s in a.schemes] + [(s + " V only", "fp32", s) for s in a.schemes]
        for label, ks, vs in variants:
            SIM.k, SIM.v, SIM.stats = SCHEMES[ks], SCHEMES[vs], []
            lg = model(full).logits[0, len(prompt) - 1:].float()
            err = (lg - ref).abs().max(-1).values
            flips = torch.nonzero(lg.argmax(-1) != ref_tok).flatten().tolist()
            kst = [s for s in SIM.stats if s[0] == "K"]
            vst = [s for s in SIM.stats if s[0] == "V"]
            first = f"first flip at step {flips[0]} (gap {gaps[flips[0]]:.4f})" if flips else "identical"
            print(f"  {label:18s} K rel-rms err {np.mean([s[1] for s in kst]):.5f} (max/amax {max(s[2] for s in kst):.4f})"
                  f"  V {np.mean([s[1] for s in vst]):.5f}  |dlogit| median {err.median():.4f} max {err.max():.4f}"
                  f"  {first}")


if __name__ == "__main__":
    main()
