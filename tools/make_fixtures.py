#!/usr/bin/env python3
"""Reference outputs from transformers for corelm's correctness tests (tests/data/fixtures/).

How to regenerate (from the repository root; CPU only, a few minutes on 2 cores):

    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0          # never unpinned: that pulls GBs of CUDA wheels
    /work/refvenv/bin/pip install -c <(echo torch==2.13.0) transformers gguf safetensors tokenizers \\
        sentencepiece accelerate numpy jinja2
    CONVERT=1 PY=/work/refvenv/bin/python bash ../shared/models/get_models.sh /work/cache/models
    /work/refvenv/bin/python tools/make_tiny_models.py   # only if tests/data/models/tiny-* must be rebuilt
    /work/refvenv/bin/python tools/make_fixtures.py [--cache /work/cache/models] [--only NAME ...]

Models ("model_dir" in the JSON; "cache:X" means <cache>/hf/X, an HF folder converted from the GGUF by
transformers, i.e. the dequantized GGUF weights in float32; "gguf" names the equivalent GGUF when there is one):
  stories260K   tests/data/models/stories260K             (+ stories260K.gguf)
  smollm2       cache:SmolLM2-135M-Instruct               (+ models/SmolLM2-135M-Instruct.Q4_1.gguf)
  qwen2.5-coder cache:Qwen2.5-Coder-0.5B-Instruct          (2 cases only, to keep the 151936-wide logits small)
  tiny-mistral, tiny-qwen2, tiny-llama3, tiny-qwen3, tiny-gemma2, tiny-gemma3, tiny-gemma3-vl, tiny-phi3,
  tiny-qwen3moe, tiny-mixtral, tiny-olmoe
                tests/data/models/tiny-*   (random weights, tools/make_tiny_models.py)
AutoModelForCausalLM loads each folder with its config's class: tiny-gemma3-vl as Gemma3ForConditionalGeneration
(vision tower included), run on text alone (input_ids, no pixel_values).
Models whose folder is missing are skipped with a message.

Per model, <name>.json:
  {"model", "model_dir", "gguf", "transformers_version", "torch_version", "vocab_size",
   "cases": [{"prompt_ids", "prompt_text" (real models), "generated_ids", "last_logits", "step8_logits",
              "margins", "eos_in_generated"}]}
  - transformers in float32, eager attention, CPU, no sampling.
  - tiny-* prompts: random ids in [3, 512) of lengths 1, 7, 40 from a seeded RandomState, redrawn until every
    generation step has a top-1/top-2 margin >= 0.02 and the 48 tokens hold >= 16 distinct ids.
  - generated_ids: 48 greedy tokens (pure argmax, ties -> lowest id), never stopping at EOS and never masking
    it (as `ignore_eos`); cross-checked against model.generate(do_sample=False, repetition_penalty=1.0).
  - last_logits: <name>_p<k>_last_logits.npy, float32 [vocab], logits at the last prompt position (they
    pick generated_ids[0]).
  - step8_logits: <name>_p<k>_step8_logits.npy, float32 [vocab], logits at the last position after the first
    8 generated tokens were fed back one at a time through the KV cache (they pick generated_ids[8]).
  - margins[i]: top-1 minus top-2 logit at generation step i. A tiny margin means a reimplementation may
    legitimately pick the other token there, and the sequences diverge from that step on.
  - MoE models (tiny-qwen3moe, tiny-mixtral, tiny-olmoe): their prompts are also redrawn until, along the cached
    greedy run (prompt, then the generated tokens fed back), the k-th minus (k+1)-th router probability is
    > 1e-3 at every layer and token, so an fp32 engine summing in another order routes to the same top-k
    experts; the script stops if no prompt does (change the model's seed or ROUTER_STD in make_tiny_models.py).
Tokenizers, tokenizer_<name>.json (smollm2, stories260K, qwen2.5-coder):
  {"tokenizer", "source", "transformers_version", "tokenizers_version", "bos_token_id", "eos_token_id",
   "cases": [{"text", "ids_with_special" (add_special_tokens=True), "ids" (add_special_tokens=False),
              "decoded_with_special" (decode(ids_with_special)), "decoded" (decode(ids)),
              "decoded_skip_special" (decode(ids_with_special, skip_special_tokens=True))}],
   "chat_template": str|null, "chat": [{"messages", "add_generation_prompt", "text", "ids"}]}
  "text" is apply_chat_template(messages, tokenize=False, add_generation_prompt=...) and "ids" its
  tokenization with add_special_tokens=False.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "data", "fixtures")
N_NEW = 48
STEP = 8

LONG_STORY = (
    "Once upon a time, in a small village near the sea, there lived a kind old man named Sam. Every morning "
    "he walked to the beach with his dog, Max, to look for shells. One day Max found a big blue box in the sand. "
    "Sam opened the box and saw a tiny map inside. The map showed a path to a hidden garden behind the hill. "
    "Sam and Max were very excited, so they")
LONG_SMOL = (
    "The history of computing is full of machines that were built to solve one problem and ended up solving "
    "many. Charles Babbage designed the Analytical Engine in the 1830s, a mechanical computer that could be "
    "programmed with punched cards. Ada Lovelace wrote what many consider the first computer program for it, "
    "an algorithm to compute Bernoulli numbers. A century later, Alan Turing described a theoretical machine "
    "that could simulate any algorithm, and during the Second World War, engineers built electronic computers "
    "to break codes and calculate artillery tables. In the decades that followed,")
LONG_CODE = (
    "import heapq\n\n\ndef dijkstra(graph, source):\n    \"\"\"Shortest distances from source in a graph given as "
    "{node: [(neighbour, weight), ...]}.\"\"\"\n    dist = {node: float('inf') for node in graph}\n    dist[source] = 0\n"
    "    queue = [(0, source)]\n    while queue:\n        d, node = heapq.heappop(queue)\n        if d > dist[node]:\n"
    "            continue\n        for neighbour, weight in graph[node]:\n            nd = d + weight\n"
    "            if nd < dist[neighbour]:\n")


def real_prompts(name, tok):
    """[(prompt_text, chat messages or None)] for the real models."""
    if name == "stories260K":
        return [("Once upon a time, there was a little girl named Lily.", None),
                ("Tom had a big red ball. He", None),
                (LONG_STORY, None)]
    if name == "smollm2":
        msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        return [(None, msgs),
                ("The three primary colors are", None),
                (LONG_SMOL, None)]
    if name == "qwen2.5-coder":
        msgs = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
        return [(None, msgs), (LONG_CODE, None)]
    raise KeyError(name)


TOKENIZER_STRINGS = [
    "", " ", "   ", "hello", " hello", "hello ", "  leading and trailing  ", "Hello world",
    "HeLLo WoRLD, MiXeD CaSe", "line1\nline2", "\n\n\n", "tab\tseparated\tvalues", "windows\r\nline end",
    "12345 3.14", "1234567890123 -42 +7e-10", "Price: $1,299.99 (approx.)",
    "def f(x):\n    return x * 2  # double\n", "if (a && b) { return c[i++]; }", 'print("hi")',
    "\U0001F44B\U0001F3FD", "Hello \U0001F44B\U0001F3FD world \U0001F30D!", "\U0001F600\U0001F603\U0001F604",
    "你好，世界", "日本語のテキストです", "한국어 문장", "مرحبا بالعالم", "Привет, мир", "Ελληνικά",
    "café naïve résumé Ünïcödé", "e\u0301 (combining accent)",
    "<|im_start|>user\nhi<|im_end|>", "<s>hello</s>", "<|endoftext|>", "<unk>",
    "pneumonoultramicroscopicsilicovolcanoconiosis" * 3, "!!!???...,,,;;;", "-----=====+++++",
    "a\u00a0b", "\u00a0", "zero\u200bwidth", "the the the the the", "I'm sure they'll say we can't, won't, shouldn't",
    "https://example.com/path?q=1&x=y#frag", "back\\slash \\n not a newline",
]
PARAGRAPH = (
    "Language models turn text into tokens, run a stack of attention and feed-forward layers over them, and "
    "predict the next token one step at a time. A CPU engine has to keep the weights compact, stream them "
    "through the caches efficiently, and reuse the keys and values of earlier positions instead of recomputing "
    "them. Tokenization looks simple but hides many corner cases: whitespace, digits, emoji, accents, scripts "
    "without spaces, and special tokens that must never be produced by accident from ordinary user text.")
assert 480 <= len(PARAGRAPH) <= 520, len(PARAGRAPH)
TOKENIZER_STRINGS.append(PARAGRAPH)

CHAT_CASES = [
    [{"role": "user", "content": "Hello! Who are you?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "Write a haiku about\nnewlines\tand tabs  ."}],
]


def model_table(cache):
    m = os.path.join(REPO, "tests", "data", "models")
    return [
        # name, folder, model_dir for the JSON, gguf (repo-relative) or None
        ("stories260K", os.path.join(m, "stories260K"), "tests/data/models/stories260K",
         "tests/data/models/stories260K/stories260K.gguf"),
        ("smollm2", os.path.join(cache, "hf", "SmolLM2-135M-Instruct"), "cache:SmolLM2-135M-Instruct",
         "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        ("qwen2.5-coder", os.path.join(cache, "hf", "Qwen2.5-Coder-0.5B-Instruct"),
         "cache:Qwen2.5-Coder-0.5B-Instruct", None),
        ("tiny-mistral", os.path.join(m, "tiny-mistral"), "tests/data/models/tiny-mistral", None),
        ("tiny-qwen2", os.path.join(m, "tiny-qwen2"), "tests/data/models/tiny-qwen2", None),
        ("tiny-llama3", os.path.join(m, "tiny-llama3"), "tests/data/models/tiny-llama3", None),
        ("tiny-qwen3", os.path.join(m, "tiny-qwen3"), "tests/data/models/tiny-qwen3", None),
        ("tiny-gemma2", os.path.join(m, "tiny-gemma2"), "tests/data/models/tiny-gemma2", None),
        ("tiny-gemma3", os.path.join(m, "tiny-gemma3"), "tests/data/models/tiny-gemma3", None),
        ("tiny-gemma3-vl", os.path.join(m, "tiny-gemma3-vl"), "tests/data/models/tiny-gemma3-vl", None),
        ("tiny-phi3", os.path.join(m, "tiny-phi3"), "tests/data/models/tiny-phi3", None),
        ("tiny-qwen3moe", os.path.join(m, "tiny-qwen3moe"), "tests/data/models/tiny-qwen3moe", None),
        ("tiny-mixtral", os.path.join(m, "tiny-mixtral"), "tests/data/models/tiny-mixtral", None),
        ("tiny-olmoe", os.path.join(m, "tiny-olmoe"), "tests/data/models/tiny-olmoe", None),
    ]


def chat_text(tok, messages, add_generation_prompt):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@torch.no_grad()
def greedy(model, prompt_ids):
    """Pure-argmax decoding through the KV cache. Returns (generated ids, per-step logits [N_NEW, vocab])."""
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1].float().clone()]
    gen = []
    for step in range(N_NEW):
        nxt = int(torch.argmax(logits[-1]))  # first maximum on ties
        gen.append(nxt)
        if step == N_NEW - 1:
            break
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0, -1].float().clone())
    return gen, torch.stack(logits).numpy()


@torch.no_grad()
def check_against_generate(model, prompt_ids, gen, margins, eos_ids):
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW,
                         min_new_tokens=N_NEW, repetition_penalty=1.0, num_beams=1,
                         pad_token_id=eos_ids[0] if eos_ids else 0)[0, len(prompt_ids):].tolist()
    if ref == gen:
        return "identical"
    i = next(k for k in range(min(len(ref), len(gen))) if ref[k] != gen[k]) if ref[:len(gen)] != gen[:len(ref)] \
        else min(len(ref), len(gen))
    why = ("EOS masked by min_new_tokens" if i < len(gen) and gen[i] in eos_ids
           else f"near-tie (margin {margins[i]:.3g})" if i < len(margins) and margins[i] < 1e-3 else None)
    if why is None:
        raise SystemExit(f"manual greedy and model.generate disagree at step {i}: {gen} vs {ref}")
    return f"generate() differs from step {i}: {why}"


TINY_MIN_MARGIN = 0.02
ROUTER_MIN_GAP = 1e-3


@torch.no_grad()
def routing(model, prompt_ids, gen):
    """MoE models: (the smallest k-th minus (k+1)-th router probability, the chosen experts [layers][tokens][k]
    by falling probability) over every layer and token of the cached greedy run (prompt, then the generated
    tokens one at a time: prompt + gen[:-1]); None for a dense model."""
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]
    if not routers:
        return None
    gaps, chosen = [], [[] for _ in routers]

    def hook(mod, inp, out):
        p, idx = torch.softmax(out[0].float(), dim=-1).sort(dim=-1, descending=True)
        gaps.append(float((p[:, mod.top_k - 1] - p[:, mod.top_k]).min()))
        chosen[routers.index(mod)].extend(idx[:, :mod.top_k].tolist())

    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        again, _ = greedy(model, prompt_ids)
    finally:
        for h in handles:
            h.remove()
    assert again == gen
    return min(gaps), chosen


def router_min_gap(model, prompt_ids, gen):
    r = routing(model, prompt_ids, gen)
    return None if r is None else r[0]


def _min_margin(logits):
    top2 = np.sort(logits, axis=1)[:, -2:]
    return float((top2[:, 1] - top2[:, 0]).min())


def eos_list(model, tok):
    e = model.generation_config.eos_token_id
    if e is None:
        e = model.config.eos_token_id
    e = [] if e is None else ([e] if isinstance(e, int) else list(e))
    return [int(x) for x in e]


def make_model_fixture(name, folder, model_dir, gguf):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder)
    eos_ids = eos_list(model, tok)
    vocab = model.config.get_text_config().vocab_size   # a multimodal config nests it (text_config)

    cases = []
    if name.startswith("tiny-"):
        rng = np.random.RandomState({"tiny-mistral": 11, "tiny-qwen2": 12, "tiny-llama3": 13, "tiny-qwen3": 14, "tiny-gemma2": 15,
                                    "tiny-gemma3": 16, "tiny-phi3": 17, "tiny-qwen3moe": 18, "tiny-mixtral": 19,
                                    "tiny-olmoe": 20, "tiny-gemma3-vl": 21}[name])
        prompts = [(None, None, rng.randint(3, 512, size=n).tolist()) for n in (1, 7, 40)]
    else:
        prompts = []
        for text, msgs in real_prompts(name, tok):
            if msgs is not None:
                text = chat_text(tok, msgs, True)
                ids = tok(text, add_special_tokens=False).input_ids
            else:
                ids = tok(text, add_special_tokens=True).input_ids
            prompts.append((text, msgs, ids))

    for k, (text, msgs, prompt_ids) in enumerate(prompts):
        gen, logits = greedy(model, prompt_ids)
        if name.startswith("tiny-"):
            # Random prompts: redraw (deterministically) until greedy decoding is well conditioned, so the
            # fixture tests kernels rather than argmax near-ties (or MoE router near-ties), and is not one token
            # repeated.
            def ill_conditioned():
                if _min_margin(logits) < TINY_MIN_MARGIN or len(set(gen)) < 16:
                    return True
                gap = router_min_gap(model, prompt_ids, gen)
                return gap is not None and gap <= ROUTER_MIN_GAP

            tries = 0
            while ill_conditioned() and tries < 200:
                prompt_ids = rng.randint(3, 512, size=len(prompt_ids)).tolist()
                gen, logits = greedy(model, prompt_ids)
                tries += 1
        top2 = np.sort(logits, axis=1)[:, -2:]
        margins = (top2[:, 1] - top2[:, 0]).tolist()
        how = check_against_generate(model, prompt_ids, gen, margins, eos_ids)
        # a full (cache-free) forward over prompt+generated must agree with the cached logits
        full = model(input_ids=torch.tensor([prompt_ids + gen[:STEP]])).logits[0].float().numpy()
        err0 = float(np.abs(full[len(prompt_ids) - 1] - logits[0]).max())
        err8 = float(np.abs(full[-1] - logits[STEP]).max())
        assert err0 < 1e-3 and err8 < 1e-3, (err0, err8)
        routed = routing(model, prompt_ids, gen)
        gap = routed[0] if routed else None
        if gap is not None and gap <= ROUTER_MIN_GAP:
            raise SystemExit(f"{name} p{k}: router top-k gap {gap:.3g} <= {ROUTER_MIN_GAP}: routing is not decisive, "
                             "change the seed or ROUTER_STD in tools/make_tiny_models.py")
        last_f, step_f = f"{name}_p{k}_last_logits.npy", f"{name}_p{k}_step8_logits.npy"
        np.save(os.path.join(OUT, last_f), np.ascontiguousarray(logits[0], dtype=np.float32))
        np.save(os.path.join(OUT, step_f), np.ascontiguousarray(logits[STEP], dtype=np.float32))
        case = {"prompt_ids": [int(x) for x in prompt_ids]}
        if text is not None:
            case["prompt_text"] = text
        if msgs is not None:
            case["messages"] = msgs
        case.update({"generated_ids": gen, "last_logits": last_f, "step8_logits": step_f,
                     "margins": [round(float(m), 5) for m in margins],
                     "eos_in_generated": any(t in eos_ids for t in gen)})
        if routed:  # MoE: the experts each layer picked for each token of prompt + generated[:-1]
            case["experts"] = routed[1]
        cases.append(case)
        shown = tok.decode(gen) if not name.startswith("tiny-") else gen[:12]
        print(f"  p{k}: {len(prompt_ids)} prompt tokens, min margin {min(margins):.4f}, generate(): {how}, "
              f"cache-vs-full max|d| {max(err0, err8):.2e}"
              + (f", router min top-k gap {gap:.4f}" if gap is not None else "") + f"\n      -> {shown!r}")

    doc = {"model": name, "model_dir": model_dir, "gguf": gguf, "arch": model.config.model_type,
           "vocab_size": vocab, "eos_token_ids": eos_ids,
           "transformers_version": transformers.__version__, "torch_version": torch.__version__,
           "dtype": "float32", "attn_implementation": "eager", "max_new_tokens": N_NEW, "cases": cases}
    with open(os.path.join(OUT, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    return tok


def make_tokenizer_fixture(name, tok, source):
    cases = []
    for text in TOKENIZER_STRINGS:
        with_sp = tok(text, add_special_tokens=True).input_ids
        plain = tok(text, add_special_tokens=False).input_ids
        cases.append({"text": text, "ids_with_special": with_sp, "ids": plain,
                      "decoded_with_special": tok.decode(with_sp, skip_special_tokens=False),
                      "decoded": tok.decode(plain, skip_special_tokens=False),
                      "decoded_skip_special": tok.decode(with_sp, skip_special_tokens=True)})
    chat = []
    template = getattr(tok, "chat_template", None)
    if template:
        for msgs in CHAT_CASES:
            for agp in (True, False):
                text = chat_text(tok, msgs, agp)
                chat.append({"messages": msgs, "add_generation_prompt": agp, "text": text,
                             "ids": tok(text, add_special_tokens=False).input_ids})
    doc = {"tokenizer": name, "source": source, "transformers_version": transformers.__version__,
           "tokenizers_version": tokenizers.__version__, "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id, "cases": cases, "chat_template": template, "chat": chat}
    with open(os.path.join(OUT, f"tokenizer_{name}.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"  tokenizer_{name}.json: {len(cases)} strings, {len(chat)} chat cases")


def main():
    ap = argparse.ArgumentParser(description="transformers reference fixtures for corelm tests")
    ap.add_argument("--cache", default=os.environ.get("CORELM_MODEL_CACHE", "/work/cache/models"),
                    help="get_models.sh destination (holds hf/<name>/)")
    ap.add_argument("--only", nargs="*", help="model names to (re)generate")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    torch.set_grad_enabled(False)
    for name, folder, model_dir, gguf in model_table(args.cache):
        if args.only and name not in args.only:
            continue
        if not os.path.isfile(os.path.join(folder, "config.json")):
            print(f"{name}: {folder} missing, skipped", file=sys.stderr)
            continue
        print(f"{name}: {folder}")
        tok = make_model_fixture(name, folder, model_dir, gguf)
        if not name.startswith("tiny-"):
            make_tokenizer_fixture(name, tok, model_dir)


if __name__ == "__main__":
    main()
