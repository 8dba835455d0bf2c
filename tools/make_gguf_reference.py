#!/usr/bin/env python3
"""Greedy reference continuations of real GGUF files, computed by Hugging Face transformers on the same file
(tests/data/gguf_reference/<file stem>.json), so corelm's direct GGUF loading (Q5_0, Q8_0, Q4_K, Q6_K blocks
multiplied as stored) can be checked token for token against transformers' own dequantization of that file.

transformers loads the GGUF itself (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`): every tensor
is dequantized with gguf.quants to float32 (the same weights `shared/models/gguf_to_hf.py` would save as an HF
folder), and the tokenizer and chat template are rebuilt from the file's own metadata. Before generating, the
script checks that lm_head, the embedding and a few layer-0 tensors equal gguf's dequantization of the file's
tensors bit for bit (an untied `output.weight` stays untied, etc.).

How to regenerate (from the repository root; CPU only, one model at a time). On 2 cores: 0.5B about 4-5 min,
1.5B Q4_K_M about 6-11 min (peak RSS about 12 GB); half that with --no-check-generate. Output is deterministic:
reruns give identical files as long as the library versions recorded in the JSON are the same.

    python3 -m venv /work/venv-torch
    /work/venv-torch/bin/pip install torch==2.13.0      # exactly this: any other torch spec pulls GBs of CUDA
    /work/venv-torch/bin/pip install -c <(echo torch==2.13.0) transformers gguf safetensors tokenizers \\
        sentencepiece accelerate numpy jinja2
    bash ../shared/models/get_models.sh /tmp/cm_models  # fetches the GGUFs and checks their sha256
    /work/venv-torch/bin/python tools/make_gguf_reference.py \\
        /tmp/cm_models/qwen2.5-coder-0.5b-instruct.gguf /tmp/cm_models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

Options: --out DIR (default tests/data/gguf_reference), --new-tokens N (48), --threads N (torch threads),
--no-check-generate (skip the model.generate() cross-check, halves the time).

Fields of <file stem>.json:
  gguf               the file's name (as get_models.sh writes it; tests find it through CORELM_TEST_MODELS)
  gguf_sha256        sha256 of the whole file; gguf_size its size in bytes. A test should skip or fail when
                     its copy's hash differs: the reference is only valid for these exact bytes.
  tensor_types       {ggml type name: number of tensors} in the file (which kernels the reference exercises)
  arch, vocab_size   transformers' config.model_type and config.vocab_size (logits width)
  eos_token_ids      ids counted as end of sequence here: generation_config.eos_token_id, the tokenizer's
                     eos, and <|endoftext|> / <|im_end|> when the vocabulary has them
  transformers_version, torch_version, gguf_version, dtype ("float32"), attn_implementation ("eager"),
  max_new_tokens     the generation settings (no sampling, no repetition penalty, no top-k/top-p)
  cases[]:
    name             short label: fibonacci, capital_france, unicode_code (CJK, emoji with a skin-tone
                     modifier, accents), long_code (116 tokens), chat_palindrome (template's default system
                     prompt), chat_multiturn (system + earlier turns), chat_short (answers "4" then EOS)
    kind             "text" (a plain completion) or "chat"
    prompt_text      the text that was tokenized: the raw prompt for "text"; for "chat", the rendering of
                     messages by the file's chat template, apply_chat_template(messages, tokenize=False,
                     add_generation_prompt=True) (Qwen's template adds its default system prompt when the
                     messages have none)
    messages         (chat only) the messages as given to the template
    add_special_tokens  how prompt_text was tokenized (True for text, False for the rendered chat, which
                     already holds its special tokens); for chat the ids are also checked to equal
                     apply_chat_template(tokenize=True)
    prompt_ids       the exact token ids transformers fed the model (feed these, not a re-tokenization, to
                     test the forward pass alone; compare a re-tokenization to them to test the tokenizer)
    generated_ids    max_new_tokens greedy ids: pure argmax of the float32 logits at each step (ties ->
                     lowest id), fed back one at a time through the KV cache. EOS is neither masked nor a
                     stop: decoding runs on past it (like ignore_eos), so ids after an EOS are still a valid
                     reference for a greedy engine that ignores EOS; one that stops compares up to the EOS.
    runner_up_ids    the second-best id at each step (what a near-tie may legitimately flip to)
    margins          top-1 minus top-2 logit at each step, rounded to 1e-5. A small margin (say < 0.05) marks
                     a near-tie where quantized-kernel rounding may pick runner_up_ids[i] instead; from the
                     first such flip on, the sequences may diverge for good. A test should compare up to the
                     first near-tie step (or first EOS), and demand exact equality before it.
    min_margin       min(margins); near_tie_steps the steps whose margin is < 0.05
    eos_positions    indices i in generated_ids with generated_ids[i] in eos_token_ids ([] if none)
    generated_text   tokenizer.decode(generated_ids) with special tokens shown (for humans only)
    generate_check   "identical" when model.generate(do_sample=False, repetition_penalty=1.0), which stops
                     at EOS, returned a prefix of generated_ids up to and including its EOS; otherwise why not
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import sys
import time

import gguf
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import LONG_CODE  # noqa: E402  (the dijkstra prompt the HF-folder fixtures use too)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "data", "gguf_reference")
NEAR_TIE = 0.05

UNICODE_CODE = (
    "# Grüße aus Köln — 日本語のコメント 👋🏽 naïve café\n"
    "def greet(name: str) -> str:\n"
    "    \"\"\"Say hello in three languages: English, 中文, Español.\"\"\"\n")

# (name, plain prompt text or None, chat messages or None)
PROMPTS = [
    ("fibonacci", "def fibonacci(n):", None),
    ("capital_france", "The capital of France is", None),
    ("unicode_code", UNICODE_CODE, None),
    ("long_code", LONG_CODE, None),
    ("chat_palindrome", None,
     [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]),
    ("chat_multiturn", None,
     [{"role": "system", "content": "You are a helpful coding assistant."},
      {"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "content": "4"},
      {"role": "user",
       "content": "Now write a C function that adds two ints, explain it, and say «thank you» in 日本語."}]),
    ("chat_short", None,  # a one-line answer: where EOS (<|im_end|>) comes is part of the reference
     [{"role": "system", "content": "You are a terse assistant. Answer in one line."},
      {"role": "user", "content": "What is 2+2? Reply with the number only."}]),
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def check_dequantization(model, path):
    """lm_head / embedding / layer-0 weights must equal gguf's own dequantization of the file's tensors."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layer0 = model.model.layers[0]
    pairs = [("token_embd.weight", model.model.embed_tokens.weight),
             ("output.weight" if "output.weight" in tensors else "token_embd.weight", model.lm_head.weight),
             ("blk.0.attn_q.weight", layer0.self_attn.q_proj.weight),
             ("blk.0.attn_v.weight", layer0.self_attn.v_proj.weight),
             ("blk.0.ffn_down.weight", layer0.mlp.down_proj.weight)]
    for gname, param in pairs:
        t = tensors[gname]
        ref = gguf.dequantize(t.data, t.tensor_type).reshape(tuple(param.shape))
        d = float(np.abs(ref.astype(np.float32) - param.detach().float().numpy()).max())
        if d != 0.0:
            raise SystemExit(f"{path}: transformers' {gname} ({t.tensor_type.name}) differs from gguf's "
                             f"dequantization by {d}")
    return dict(sorted(collections.Counter(t.tensor_type.name for t in reader.tensors).items()))


def eos_set(model, tok):
    ids = set()
    e = model.generation_config.eos_token_id
    for x in ([] if e is None else [e] if isinstance(e, int) else e):
        ids.add(int(x))
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    vocab = tok.get_vocab()
    for s in ("<|endoftext|>", "<|im_end|>"):
        if s in vocab:
            ids.add(int(vocab[s]))
    return sorted(ids)


@torch.no_grad()
def greedy(model, prompt_ids, n_new):
    """Pure argmax through the KV cache, EOS not special. Returns (ids, runner-up ids, margins)."""
    out = model(input_ids=torch.tensor([prompt_ids]), past_key_values=DynamicCache(config=model.config),
                use_cache=True)
    gen, second, margins = [], [], []
    for step in range(n_new):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        best = int(torch.argmax(logits))  # first maximum on ties (topk's order on ties is not specified)
        gen.append(best)
        second.append(int(top.indices[1]) if int(top.indices[0]) == best else int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        if step + 1 < n_new:
            out = model(input_ids=torch.tensor([[best]]), past_key_values=out.past_key_values, use_cache=True)
    return gen, second, margins


@torch.no_grad()
def check_against_generate(model, prompt_ids, gen, margins, eos_ids, n_new):
    ids = torch.tensor([prompt_ids])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new,
                         repetition_penalty=1.0, num_beams=1, eos_token_id=eos_ids,
                         pad_token_id=eos_ids[0])[0, len(prompt_ids):].tolist()
    if ref == gen[:len(ref)] and (len(ref) == n_new or ref[-1] in eos_ids):
        return "identical"
    i = next((k for k in range(min(len(ref), len(gen))) if ref[k] != gen[k]), min(len(ref), len(gen)))
    if i < len(margins) and margins[i] < 1e-3:
        return f"generate() differs from step {i}: near-tie (margin {margins[i]:.3g})"
    raise SystemExit(f"manual greedy and model.generate disagree at step {i}: {gen} vs {ref}")


def chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    direct = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    direct = direct["input_ids"] if hasattr(direct, "keys") else direct
    if list(direct) != list(ids):
        raise SystemExit(f"chat template: tokenizing the rendered text gives {ids}, apply_chat_template {direct}")
    return text, ids


def make_reference(path, out_dir, n_new, check_generate):
    t0 = time.time()
    folder, name = os.path.split(os.path.abspath(path))
    digest = sha256(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    types = check_dequantization(model, path)
    eos_ids = eos_set(model, tok)
    t_load = time.time() - t0
    print(f"{name}: {type(model).__name__}, tensor types {types}, eos {eos_ids}, loaded in {t_load:.0f}s",
          flush=True)

    cases = []
    for label, text, messages in PROMPTS:
        t1 = time.time()
        if messages is None:
            kind, add_special = "text", True
            prompt_ids = tok(text, add_special_tokens=True).input_ids
        else:
            kind, add_special = "chat", False
            text, prompt_ids = chat_ids(tok, messages)
        prompt_ids = [int(x) for x in prompt_ids]
        gen, second, margins = greedy(model, prompt_ids, n_new)
        how = check_against_generate(model, prompt_ids, gen, margins, eos_ids, n_new) if check_generate \
            else "not checked"
        case = {"name": label, "kind": kind, "prompt_text": text}
        if messages is not None:
            case["messages"] = messages
        near = [i for i, m in enumerate(margins) if m < NEAR_TIE]
        case.update({"add_special_tokens": add_special, "prompt_ids": prompt_ids, "generated_ids": gen,
                     "runner_up_ids": second, "margins": [round(m, 5) for m in margins],
                     "min_margin": round(min(margins), 5), "near_tie_steps": near,
                     "eos_positions": [i for i, t in enumerate(gen) if t in eos_ids],
                     "generated_text": tok.decode(gen, skip_special_tokens=False), "generate_check": how})
        cases.append(case)
        print(f"  {label}: {len(prompt_ids)} prompt tokens, min margin {min(margins):.4f}, near ties {near}, "
              f"eos at {case['eos_positions']}, generate(): {how}, {time.time() - t1:.0f}s\n"
              f"      -> {case['generated_text']!r}", flush=True)

    doc = {"gguf": name, "gguf_sha256": digest, "gguf_size": os.path.getsize(path), "tensor_types": types,
           "arch": model.config.model_type, "vocab_size": int(model.config.vocab_size), "eos_token_ids": eos_ids,
           "transformers_version": transformers.__version__, "torch_version": torch.__version__,
           "gguf_version": getattr(gguf, "__version__", None) or _dist_version("gguf"),
           "dtype": "float32", "attn_implementation": "eager", "max_new_tokens": n_new,
           "near_tie_threshold": NEAR_TIE, "cases": cases}
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, os.path.splitext(name)[0] + ".json")
    text = json.dumps(doc, ensure_ascii=False, indent=1)
    # lists of numbers on one line each: a few hundred lines instead of thousands
    text = re.sub(r"\[\s*(-?[0-9.e+-]+(?:,\s*-?[0-9.e+-]+)*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(f"  wrote {os.path.relpath(out, REPO)} in {time.time() - t0:.0f}s total", flush=True)
    del model


def _dist_version(dist):
    from importlib.metadata import version
    return version(dist)


def main():
    ap = argparse.ArgumentParser(description="transformers greedy references for real GGUF files")
    ap.add_argument("gguf", nargs="+", help="GGUF files (one JSON each, named after the file's stem)")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-check-generate", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    for path in args.gguf:
        if not os.path.isfile(path):
            sys.exit(f"{path}: no such file")
        make_reference(path, args.out, args.new_tokens, not args.no_check_generate)


if __name__ == "__main__":
    main()
